"""Baselines as their official code runs them, and the smaller deviations (issue 12). Each test
fails on the code before the fidelity pass."""

from __future__ import annotations

import pytest
import torch
from runs import checked_method as _method
from runs import k_groups as _groups

from graft_rl.engine.config import load_config
from graft_rl.methods import build_exchange
from graft_rl.policy import RolloutGroup


@pytest.mark.parametrize(
    "kw",
    [
        {"name": "sgt"},
        {"name": "sgt", "selection": "graft"},
        {"name": "hacpo"},
        {"name": "hacpo", "selection": "graft"},
    ],
)
def test_sgt_and_hacpo_keep_peer_data_with_its_prompt_in_ordinary_order(kw):
    """SGT's NLL target and HACPO's pooled peer rollouts travel with their prompt's own group; only
    GRAFT's "how" packs peer groups last."""
    ex = build_exchange(_method(**kw))
    b = ex.build("B", {"A": _groups("A"), "B": _groups("B")}, {"A", "B"}, 4, torch.Generator().manual_seed(0))
    assert any(r.is_peer for r in b.rows)
    assert not any(b.group_is_peer)
    for r in b.rows:  # each peer row sits in the group of its own prompt
        own = {x.group for x in b.rows if x.prompt_id == r.prompt_id and not x.is_peer}
        assert own == {r.group}


def test_a_source_group_is_mixed_by_its_own_n():
    """A replayed peer sampled n=16: k=4 of 16 is mixed, though 4 = the receiver's n."""
    n16 = [
        RolloutGroup(
            f"q{q}", f"{q}+{q}=?", "P", ["x"] * 16, [[1]] * 16, [[-1.0]] * 16, ["stop"] * 16, [1.0] * 4 + [0.0] * 12
        )
        for q in range(8)
    ]
    recv = [
        RolloutGroup(f"q{q}", f"{q}+{q}=?", "B", ["y"] * 4, [[1]] * 4, [[-1.0]] * 4, ["stop"] * 4, [0.0] * 4)
        for q in range(8)
    ]
    ex = build_exchange(_method(name="graft", balance=False))
    b = ex.build("B", {"B": recv, "P": n16}, {"B"}, 4, torch.Generator().manual_seed(0))
    assert b.stats["exchanged_in"] == 8


def test_logprobs_use_the_rollout_temperature(tiny_pair):
    """SPEC §2: log-probs in the loss and the compatibility score come from logits / T, both paths."""
    from graft_rl.policy import Policy, PolicyConfig

    for fused in (True, False):
        pol = Policy(PolicyConfig("A", str(tiny_pair[0]), fused_logprobs=fused))
        batch = pol.encode_texts(["Q"], ["3+4=7 \\boxed{7}"], [True])
        plain, mask = pol.token_logprobs(batch)
        pol.logprob_temperature = 0.5
        hot, _ = pol.token_logprobs(batch)
        seq = torch.tensor([batch.prompt_ids[0] + batch.response_ids[0]])
        with torch.no_grad():
            logits = pol.model(input_ids=seq).logits[0, len(batch.prompt_ids[0]) - 1 : -1]
        want = (logits / 0.5).log_softmax(-1).gather(1, torch.tensor(batch.response_ids[0])[:, None])[:, 0]
        torch.testing.assert_close(hot[0], want, atol=1e-5, rtol=0)
        assert not torch.allclose(hot, plain)


def test_sgt_graft_how_is_graft_without_balancing():
    """The paper: "The reported variant corresponds to GRAFT without balanced exchange"."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    for scale in ("paper/pair1", "testbed"):
        how = load_config(root / scale / "sgt_graft_how.yaml").method
        nobal = load_config(root / scale / "graft_no_balance.yaml").method
        assert how == nobal


def test_stored_trajectory_presets_cover_both_directions_of_every_pair():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "paper"
    for pair in ("pair1", "pair2", "pair3"):
        stored = sorted(p.name for p in (root / pair).glob("graft_stored_*.yaml"))
        assert len(stored) == 2, stored
        receivers = {load_config(root / pair / s).policies[0].name for s in stored}
        assert len(receivers) == 2
