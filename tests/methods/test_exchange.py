"""The exchange (methods/exchange.py, the driver's side): each shipped selection, composition and
weighting on synthetic rollouts (no model), what each receiver trains on, with any advantage part
(source-computed advantages of the chosen estimator, pooled groups)."""

from __future__ import annotations

import pytest
import torch
from runs import EXPECTED_A_TO_B, k_groups

from graft_rl import algo
from graft_rl.methods import MethodConfig, build_exchange
from graft_rl.policy import RolloutGroup


def _groups(policy: str, k: list[int], n: int = 4) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            f"q{q}",
            f"{q}+{q}=?",
            policy,
            [f"{policy}{i}" for i in range(n)],
            [[1, 2]] * n,
            [[-1.0, -1.0]] * n,
            ["stop"] * n,
            [1.0] * kq + [0.0] * (n - kq),
        )
        for q, kq in enumerate(k)
    ]


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_graft_with_any_advantage_grafts_with_the_sources_advantages_of_that_estimator(advantage):
    cfg = MethodConfig(name="graft", advantage=advantage, balance=False)  # one direction has candidates
    cfg.validate()
    groups = {"A": _groups("A", [2, 0, 1, 4]), "B": _groups("B", [0, 0, 4, 1])}
    b = build_exchange(cfg).build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))
    est = {
        "grpo": lambda r: algo.grpo_advantages(r, 1e-6),
        "dr_grpo": algo.dr_grpo_advantages,
        "rloo": algo.rloo_advantages,
    }
    grafted = [r for r in b.rows if r.is_peer]
    assert {r.prompt_id for r in grafted} == {"q0"}  # B failed q0, A's group is mixed
    want = est[advantage](torch.tensor([groups["A"][0].rewards], dtype=torch.float64))[0].tolist()
    assert [r.advantage for r in grafted] == pytest.approx(want)  # source-computed, by the chosen estimator
    own = [r for r in b.rows if r.prompt_id == "q2"]
    want_own = est[advantage](torch.tensor([groups["B"][2].rewards], dtype=torch.float64))[0].tolist()
    assert [r.advantage for r in own] == pytest.approx(want_own)


def test_a_pooled_composition_uses_the_chosen_advantage_over_the_pool():
    cfg = MethodConfig(name="graft", pooled=True, advantage="rloo", balance=False)
    cfg.validate()
    groups = {"A": _groups("A", [2]), "B": _groups("B", [0])}
    b = build_exchange(cfg).build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))
    pooled = torch.tensor([groups["B"][0].rewards + groups["A"][0].rewards], dtype=torch.float64)
    assert [r.advantage for r in b.rows] == pytest.approx(algo.rloo_advantages(pooled)[0].tolist())


def _build(**kw):
    cfg = MethodConfig(**kw)
    cfg.validate()
    ex = build_exchange(cfg)
    groups = {"A": k_groups("A"), "B": k_groups("B")}
    return ex.build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))


def test_graft_batch_replaces_failed_groups_only():
    b = _build(name="graft")
    assert {r.prompt_id for r in b.rows if r.is_peer} == EXPECTED_A_TO_B
    assert len(b.rows) == 8 * 4 and sum(b.group_is_peer) == 2
    assert b.stats["candidates_in"] == 3 and b.stats["exchanged_in"] == 2
    assert all(r.src_mean_logprob == pytest.approx(-1.0) for r in b.rows)


def test_success_only_excludes_failed_peer_responses():
    b = _build(name="graft", success_only=True)
    peer = [r for r in b.rows if r.is_peer]
    assert all(r.include == (r.reward > 0) for r in peer)
    assert all(r.include for r in b.rows if not r.is_peer)
    # advantages still come from the full source group
    q5 = [r.advantage for r in peer if r.prompt_id == "q5"]
    assert q5 == pytest.approx(algo.grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))[0].tolist())


def test_pooled_groups_keep_own_group_and_pool_advantages():
    b = _build(name="graft", pooled=True)
    q2 = [r for r in b.rows if r.prompt_id == "q2"]
    assert len(q2) == 8 and sum(r.is_peer for r in q2) == 4
    a_own, a_src = algo.pooled_advantages(torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert [r.advantage for r in q2] == pytest.approx(a_own[0].tolist() + a_src[0].tolist())


def test_sgt_adds_one_correct_peer_response_as_auxiliary_target():
    b = _build(name="sgt")
    aux = [r for r in b.rows if r.is_aux]
    # SGT's rule: B fails and A has >= 1 success: q0, q2, q4 (A all-pass still counts), q5
    assert {r.prompt_id for r in aux} == {"q0", "q2", "q4", "q5"}
    assert all(r.reward == 1.0 and r.source == "A" for r in aux)
    assert sum(1 for r in b.rows if not r.is_aux) == 32  # own groups untouched


def test_random_prompts_are_count_matched():
    b = _build(name="graft", selection="random")
    assert b.stats["exchanged_in"] == 2


def test_hacpo_pools_every_prompt():
    b = _build(name="hacpo")
    assert sum(1 for r in b.rows if r.is_peer) == 32 and len(b.rows) == 64


def test_grpo_has_no_peer_rows():
    b = _build(name="grpo")
    assert not any(r.is_peer for r in b.rows) and len(b.rows) == 32


def test_the_weighting_parts_moved_with_notice():
    from graft_rl.methods import weighting

    with pytest.warns(DeprecationWarning, match=r"moved to graft_rl.methods.weighting in 0.2.0"):
        from graft_rl.methods.exchange import register_weighting
    assert register_weighting is weighting.register_weighting
