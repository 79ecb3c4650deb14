"""HACPO as graft-rl builds it (methods/hacpo.py: its advantage, loss and pooled composition; the
recipe's capability window, peer bound, KL and EOS handling): the method's tests in one place. The
equations themselves are tests/algo/test_baselines.py's."""

from __future__ import annotations

import pytest
import torch
from passes import one_pass
from runs import checked_method as _method
from runs import k_groups
from runs import row_tensors as _rows

from graft_rl.engine.config import load_config
from graft_rl.methods import build_exchange, build_objective
from graft_rl.methods.objectives import RowTensors
from graft_rl.policy import RolloutGroup


def test_hacpo_peer_rollouts_still_have_a_gradient_late_in_training():
    """The peer lower bound follows the minibatch update index within a step (HACPO's recipe), not
    the global step: at step 100 the first update still trains on peer rollouts."""
    obj = build_objective(_method(name="hacpo"))
    t = _rows([True, True])
    lp = torch.full((2, 3), -1.15, requires_grad=True)  # ratio exp(-0.05) vs the source mean -1.1: inside [0.8, 1]
    loss, _ = one_pass(obj, t, [0, 1], lp, step=100, update_index=0)
    loss.backward()
    assert lp.grad.abs().sum() > 0


def test_hacpo_update_index_restarts_every_step(make_cfg, fake_rewards, monkeypatch):
    from graft_rl.engine.trainer import Trainer
    from graft_rl.methods.objectives import Objective

    seen = []
    real = Objective.contribution

    def spy(self, lp, old, t, rows, norm, correction=None, step=0, update_index=0):
        if not seen or seen[-1] != (step, update_index):  # one entry per update, however many passes
            seen.append((step, update_index))
        return real(self, lp, old, t, rows, norm, correction, step, update_index)

    monkeypatch.setattr(Objective, "contribution", spy)
    Trainer(make_cfg({"name": "hacpo"}, steps=2, run="hacpo_idx"), show_progress=False).run()
    for step in (1, 2):
        per_policy = [u for s, u in seen if s == step]
        assert per_policy == [0, 1, 2, 3] * 2  # 8 prompts / minibatch 2 = 4 updates, for A then B


def test_hacpo_kl_covers_own_responses_only():
    """HACPO's recipe applies its KL loss to self tokens only; peer tokens far from the reference add nothing."""
    obj = build_objective(_method(name="hacpo", kl_coef=1.0))
    t = _rows([False, True])
    lp = torch.full((2, 3), -1.0)
    lp[1] = -3.0  # the peer row is far from the reference, the own row equals it
    _, stats = one_pass(obj, t, [0, 1], lp.requires_grad_(), step=1, update_index=0)
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-7)


def test_hacpo_logs_self_and_peer_clip_fractions():
    obj = build_objective(_method(name="hacpo"))
    t = _rows([False, True])
    lp = torch.full((2, 3), -0.5, requires_grad=True)  # own ratio e^0.5 (clipped), peer e^0.6 > 1 (clipped)
    _, stats = one_pass(obj, t, [0, 1], lp, step=1)
    assert stats["tokens_self"] == 3 and stats["tokens_peer"] == 3
    assert stats["clipped_tokens_self"] == 3 and stats["clipped_tokens_peer"] == 3


@pytest.mark.parametrize("pair", ["pair1", "pair2", "pair3"])
@pytest.mark.parametrize("row", ["hacpo", "hacpo_graft_which"])
def test_hacpo_presets_take_the_recipes_four_updates_of_512_responses(pair, row):
    """The recipe: 128 prompts x (8 own + 8 peer) = 2,048 responses in minibatches of
    ppo_mini_batch_size 64 x n 8 = 512: 4 updates per step (ours had minibatch 64: 2)."""
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "paper" / pair / f"{row}.yaml")
    assert cfg.prompt_batch // cfg.minibatch == 4 and cfg.prompt_batch % cfg.minibatch == 0
    assert cfg.minibatch * 2 * cfg.n == 512


@pytest.mark.slow
def test_hacpo_peer_bound_steps_through_0_8_to_0_875_in_a_step(make_cfg, fake_rewards, monkeypatch):
    """On a tiny pair at the presets' ratio (4 minibatches per step): the peer lower bound of the
    loss is 0.8, 0.825, 0.85, 0.875 in every step, for each receiver."""
    from graft_rl import algo
    from graft_rl.engine.trainer import Trainer

    bounds = []
    real = algo.hacpo_policy_loss

    def spy(*a, **kw):
        loss, st = real(*a, **kw)
        bounds.append(round(float(st["peer_clip_lower"]), 4))
        return loss, st

    monkeypatch.setattr(algo, "hacpo_policy_loss", spy)
    Trainer(make_cfg({"name": "hacpo"}, steps=2, run="hacpo4", prompt_batch=8, minibatch=2), show_progress=False).run()
    # one micro-batch per minibatch here: 2 steps x 2 receivers x 4 updates
    assert bounds == [0.8, 0.825, 0.85, 0.875] * 4


def test_hacpo_omega_is_clipped_to_its_recipes_0_1_to_10():
    """omega = P_self / P_src, clipped to [0.1, 10] (recipe: 1 / CapabilityTracker.ratio, ratio in [0.1, 10])."""
    from graft_rl import algo

    # the upper clip: P_self / P_src = 20, clipped to 10. With one success in 8 own and 12 peer
    # responses the clipped baseline is (1 + 10 x 1) / 20 = 0.55; unclipped, (1 + 20 x 1) / 20 = 1.05
    # would exceed 1 and fall back to the own mean 1/8, so the two differ
    own8, peer12 = torch.zeros(1, 8), torch.zeros(1, 12)
    own8[0, 0], peer12[0, 0] = 1.0, 1.0
    a_own, a_peer = algo.hacpo_advantages(own8, peer12, 0.5, 0.025)
    pooled20 = torch.cat([own8, peer12], dim=1)[0]
    scale = pooled20.std() + 1e-6
    assert torch.allclose(a_own[0], ((own8[0] - 0.55) / scale).to(a_own.dtype))
    assert not torch.allclose(a_own[0], ((own8[0] - 1 / 8) / scale).to(a_own.dtype))  # what no clip would give
    assert torch.allclose(a_peer[0], ((peer12[0] - 0.55) / scale).to(a_peer.dtype))
    own, peer = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    pooled = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # P_self 1e-8, P_src 0.5: omega 2e-8 unclipped, 0.1 clipped
    a_own, a_peer = algo.hacpo_advantages(own, peer, 1e-8, 0.5)
    b = (1.0 + 0.0 + 0.1 + 0.1) / 4
    assert torch.allclose(a_own[0], ((pooled[:2] - b) / (pooled.std() + 1e-6)).to(a_own.dtype))


def test_hacpo_capability_floor_is_the_recipes_1e_8(make_cfg, fake_rewards):
    from graft_rl.engine.trainer import Trainer
    from graft_rl.methods.hacpo import CAPABILITY_FLOOR

    assert CAPABILITY_FLOOR == 1e-8
    tr = Trainer(make_cfg({"name": "hacpo"}, steps=1, run="floor"), show_progress=False)
    tr.method.load_state_dict({"success_history": {"A": [0.0, 0.0]}})
    assert tr.method.capability_of("A") == 1e-8


def test_hacpo_kl_is_seq_mean_token_mean_low_var_kl_clamped_to_10():
    """The recipe: low_var_kl (k3 clamped to +-10) token-mean per own response, summed over own
    responses and divided by the minibatch's responses; peer responses carry none."""
    from graft_rl.methods import build_objective

    M, T = 3, 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    ref = torch.zeros(M, T)
    ref[0, 0] = 30.0  # k3 = e^20 - 21 clamped to 10 (the log ratio itself clamped to 20 first)
    ref[1] = -1.0
    t = RowTensors(
        torch.zeros(M, T),
        mask,
        [0.0] * M,
        [1.0] * M,
        [False, False, True],
        [True] * M,
        [False] * M,
        [0.0] * M,
        ref=ref,
        extras={"kappa": [1.0] * M},
    )
    coef = 0.5
    obj = build_objective(_method(name="hacpo", kl_coef=coef))
    lp = torch.zeros(M, T, requires_grad=True)
    loss, st = one_pass(obj, t, [0, 1, 2], lp, step=1, update_index=0)
    k3_row1 = float(torch.exp(torch.tensor(-1.0)) + 1 - 1)  # r = -1: e^-1 - (-1) - 1
    expected = coef * ((10.0 / 4) + k3_row1) / 3  # advantages are 0: the policy term is 0
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_hacpo_pops_a_final_eos_from_sequence_means(tiny_pair):
    """The recipe pops a finished response's final EOS (own and peer) before the sequence mean; the
    source's mean generation log-prob likewise leaves the EOS out."""

    groups = {
        p: [
            RolloutGroup(
                "q0",
                "0+0=?",
                p,
                ["a", "b"],
                [[5, 6, 2], [5, 6]],
                [[-1.0, -2.0, -9.0], [-1.0, -2.0]],
                ["stop", "length"],
                [1.0, 0.0],
            )
        ]
        for p in ("A", "B")
    }
    ex = build_exchange(_method(name="hacpo"))
    batch = ex.build("B", groups, {"A", "B"}, 2, torch.Generator().manual_seed(0))
    peer = [r for r in batch.rows if r.is_peer]
    assert peer[0].src_mean_logprob == pytest.approx(-1.5)  # (-1 - 2) / 2: the EOS's -9 left out
    assert peer[1].src_mean_logprob == pytest.approx(-1.5)  # truncated: every token counts


@pytest.mark.slow
def test_hacpo_training_masks_the_final_eos(make_cfg, fake_rewards, monkeypatch):
    from graft_rl.engine.trainer import Trainer
    from graft_rl.engine.worker import PolicyWorker
    from graft_rl.methods.objectives import Objective

    seen = {}
    real_enc = PolicyWorker._encode

    def enc(self, batch, max_new_tokens=None):
        tb = real_enc(self, batch, max_new_tokens)
        seen[self.policy.name] = (batch, tb)
        return tb

    masks = []
    real = Objective.normalisers

    def spy(t, rows):  # once per minibatch, before its passes
        masks.append(t.mask.clone())
        return real(t, rows)

    monkeypatch.setattr(PolicyWorker, "_encode", enc)
    monkeypatch.setattr(Objective, "normalisers", staticmethod(spy))
    Trainer(make_cfg({"name": "hacpo"}, steps=1, run="eos", max_new_tokens=24, minibatch=8), show_progress=False).run()
    batch, tb = seen["B"]
    mask = masks[-1]
    checked = 0
    for i, r in enumerate(batch.rows):
        n_tok = len(tb.response_ids[i])
        if r.finished and n_tok > 1 and i not in tb.cut:
            assert mask[i, n_tok - 1] == 0 and mask[i, : n_tok - 1].all()
            checked += 1
        else:
            assert mask[i, :n_tok].all()
    assert len(batch.rows) == 8 * 8 and checked > 0  # own + peer on every prompt; some finished


def test_hacpo_graft_which_keeps_peer_responses_of_unselected_prompts_with_zero_advantage():
    """Appendix G: 'We keep the HACPO configuration [...] Peer responses on all other prompts receive
    zero advantage': every prompt pools the peer group (own advantages from HACPO's pooled
    baseline), and only the selected prompts' peer responses carry an advantage."""
    from runs import EXPECTED_A_TO_B

    from graft_rl import algo

    ex = build_exchange(_method(name="hacpo", selection="graft"))
    groups = {"A": k_groups("A"), "B": k_groups("B")}
    b = ex.build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0), capability={"A": 0.4, "B": 0.2})
    assert len(b.rows) == 8 * 8 and b.stats["exchanged_in"] == 2
    for q in range(8):
        rows = [r for r in b.rows if r.prompt_id == f"q{q}"]
        own = torch.tensor([[r.reward for r in rows if not r.is_peer]], dtype=torch.float64)
        peer = torch.tensor([[r.reward for r in rows if r.is_peer]], dtype=torch.float64)
        a_own, a_peer = algo.hacpo_advantages(own, peer, 0.2, 0.4)
        assert [r.advantage for r in rows if not r.is_peer] == pytest.approx(a_own[0].tolist())
        want = a_peer[0].tolist() if f"q{q}" in EXPECTED_A_TO_B else [0.0] * 4
        assert [r.advantage for r in rows if r.is_peer] == pytest.approx(want)


def test_hacpo_keeps_cut_peer_responses_in_the_loss_as_its_recipe_truncates_them(make_cfg, fake_rewards):
    """Issue 32 item 9: HACPO's recipe truncates an over-long peer response to the budget and trains
    on it (overflow="truncate"); GRAFT leaves it out (test_the_trainer_counts_cut_peer_responses)."""
    import json

    from graft_rl.engine.store import RecordStore
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "hacpo"}, steps=1, run="cut_hacpo", max_new_tokens=6), show_progress=False)
    tr.run()
    lines = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    cut = sum(ln["peer_cut"] for ln in lines if ln["policy"] == "A")
    assert cut > 0
    rows = RecordStore(tr.run_dir).read_exchange("A")
    assert rows and all(r["included"] for r in rows)
