"""The loss parts (methods/losses.py): GSPO's equation, its difference from the sequence-ratio ablation,
and GSPO training a minibatch with weighted peer responses."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from passes import one_pass

from graft_rl import algo
from graft_rl.methods import MethodConfig, build_objective
from graft_rl.methods.objectives import RowTensors

# ---------------------------------------------------------------- GSPO: its equation
seq = st.integers(1, 5).flatmap(
    lambda m: st.tuples(
        st.lists(st.lists(st.floats(-3, -0.01), min_size=4, max_size=4), min_size=m, max_size=m),
        st.lists(st.lists(st.floats(-0.05, 0.05), min_size=4, max_size=4), min_size=m, max_size=m),
        st.lists(st.floats(-2, 2), min_size=m, max_size=m),
        st.lists(st.integers(1, 4), min_size=m, max_size=m),
    )
)


@settings(max_examples=60, deadline=None)
@given(seq)
def test_gspo_is_the_sequence_mean_of_the_clipped_length_normalised_ratio(case):
    """GSPO (Zheng et al., 2025, Eqs. 5-7): s_i = exp(mean_t (log pi - log pi_old)),
    L = -1/M sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)."""
    old_rows, delta_rows, adv, lengths = case
    old = torch.tensor(old_rows, dtype=torch.float64)
    lp = old + torch.tensor(delta_rows, dtype=torch.float64)
    mask = torch.tensor([[1.0] * k + [0.0] * (4 - k) for k in lengths], dtype=torch.float64)
    a = torch.tensor(adv, dtype=torch.float64)
    loss, stats = algo.gspo_policy_loss(lp, old, a, mask)
    want, clipped = [], 0
    for i, k in enumerate(lengths):
        s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in range(k)) / k)
        want.append(-min(s * adv[i], min(max(s, 1 - 3e-4), 1 + 4e-4) * adv[i]))
        clipped += not (1 - 3e-4 <= s <= 1 + 4e-4)
    assert float(loss) == pytest.approx(sum(want) / len(want), abs=1e-9)
    assert float(stats["clip_frac"]) == pytest.approx(clipped / len(lengths))  # responses clipped, not tokens


def test_gspo_differs_from_the_sequence_ratio_ablation_in_aggregation_and_range():
    """The ``ratio: sequence`` ablation keeps GRAFT's token mean and 0.2/0.28 range; GSPO averages over
    responses and clips at 3e-4/4e-4. Same ratios, different losses."""
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    lp = old.clone()
    lp[0] += 0.01  # s = e^0.01: inside 1 +- 0.2, outside 1 + 4e-4
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    ablation, _ = algo.policy_loss(lp, old, adv, mask, None, 0.2, 0.28, "sequence")
    gspo, st = algo.gspo_policy_loss(lp, old, adv, mask)
    s = math.exp(0.01)
    assert float(ablation) == pytest.approx(-(4 * s * 1 + 1 * (-1)) / 5, rel=1e-5)  # token mean, unclipped
    assert float(gspo) == pytest.approx(-((1 + 4e-4) * 1 + 1 * (-1)) / 2, rel=1e-5)  # response mean, clipped
    assert float(st["clip_frac"]) == 0.5


def test_gspo_as_a_loss_part_trains_a_minibatch_and_weights_peer_responses():
    cfg = MethodConfig(name="graft", loss="gspo")
    cfg.validate()
    obj = build_objective(cfg)
    M, T = 3, 4
    t = RowTensors(
        torch.full((M, T), -1.0),
        torch.ones(M, T),
        [1.0, -1.0, 2.0],
        [1.0, 1.0, 0.0],
        [False, False, True],
        [True] * M,
        [False] * M,
        [-1.0] * M,
    )
    lp = torch.full((M, T), -1.0, requires_grad=True)
    loss, stats = one_pass(obj, t, [0, 1, 2], lp, step=1)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1.0 - 1.0 + 0.0) / 3)  # on-policy: s = 1; the gated peer counts 0
    assert lp.grad[2].abs().sum() == 0 and lp.grad[0].abs().sum() > 0  # weight 0: no gradient
    # the gated peer response (weight 0) is not trained: neither clipped nor counted (issue 49)
    assert stats["tokens_peer"] == 0 and stats["tokens_self"] == 2 * T


# ---------------------------------------------------------------- what each loss says it clipped (issue 49)
# One micro-batch, old log-prob log 0.5 everywhere, two tokens a row:
#   row 0 own,  adv +1, ratios 1.8 / 1.0      row 1 own,  adv -1, ratios 1.0 / 1.0
#   row 2 peer, adv +1, ratios 1.8 / 1.8      row 3 peer, adv +1, ratios 1.8 / 1.8, weight 0 (gated)
# Source mean log-probs (HACPO's peer ratio): row 2 log 0.5 (ratio 1.8), row 3 log 0.9 (ratio 1.0).
# Expected (clipped self, self tokens, clipped peer, peer tokens): a weighted loss neither trains nor
# counts the gated row; LUFFY and HACPO ignore the weight, so it counts for them.
CLIP_CASES = {
    "token_mean_clip": ({"name": "graft"}, (1, 4, 2, 2)),  # token ratios: 1.8 > 1.28 clipped
    "sequence ratio": ({"name": "graft", "ratio": "sequence"}, (2, 4, 2, 2)),  # row 0: sqrt(1.8) > 1.28
    "gspo": ({"name": "graft", "loss": "gspo"}, (2, 4, 2, 2)),  # whole responses, range 3e-4 / 4e-4
    "luffy": ({"name": "luffy"}, (1, 4, 0, 4)),  # peer tokens are never clipped
    "hacpo": ({"name": "hacpo"}, (2, 4, 2, 4)),  # own: its tiny range; peer: r > 1 (row 2), not row 3
}


@pytest.mark.parametrize("case", sorted(CLIP_CASES))
def test_each_loss_reports_the_clipped_tokens_it_clipped(case):
    keys, (c_self, n_self, c_peer, n_peer) = CLIP_CASES[case]
    cfg = MethodConfig(**keys)
    cfg.validate()
    obj = build_objective(cfg)
    half, most = math.log(0.5), math.log(0.9)
    t = RowTensors(
        torch.full((4, 2), half),
        torch.ones(4, 2),
        [1.0, -1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 0.0],
        [False, False, True, True],
        [True] * 4,
        [False] * 4,
        [half, half, half, most],
    )
    lp = torch.tensor([[most, half], [half, half], [most, most], [most, most]], requires_grad=True)
    _, stats = one_pass(obj, t, [0, 1, 2, 3], lp, step=1)
    got = tuple(stats[k] for k in ("clipped_tokens_self", "tokens_self", "clipped_tokens_peer", "tokens_peer"))
    assert got == (c_self, n_self, c_peer, n_peer)


def test_a_loss_that_clips_nothing_reports_zero_and_one_that_says_nothing_reports_no_counts():
    """The objective computes no clipping on a loss's behalf: ``clips=False`` is 0 clipped; a clipping
    loss without ``clipped`` in its stats has no self/peer counts (``clip_frac_*`` then absent)."""
    from graft_rl.methods.objectives import Objective
    from graft_rl.methods.registry import LossPart

    def plain(lp, old, mask, ctx):
        return -(lp * mask).sum() / mask.sum(), {}

    t = RowTensors(
        torch.zeros(2, 2), torch.ones(2, 2), [1.0, 1.0], [1.0, 1.0], [False, True], [True] * 2, [False] * 2, [0.0] * 2
    )
    lp = torch.zeros(2, 2, requires_grad=True)
    cfg = MethodConfig(name="graft")
    for clips, want in (
        (False, {"clipped_tokens_self": 0.0, "tokens_self": 2.0, "clipped_tokens_peer": 0.0}),
        (True, {}),
    ):
        loss = LossPart(name="plain", fn=plain, clips=clips)
        _, stats = one_pass(Objective(cfg, loss=loss), t, [0, 1], lp, step=1)
        assert {k: v for k, v in stats.items() if k in want or k.startswith("clipped")} == want
