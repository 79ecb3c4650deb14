"""The loss parts (methods/losses.py): GSPO's equation, its difference from the sequence-ratio ablation,
and GSPO training a minibatch with weighted peer responses."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    loss, stats = obj.minibatch(t, [0, 1, 2], step=1)(lp, torch.ones(M, T), [0, 1, 2])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1.0 - 1.0 + 0.0) / 3)  # on-policy: s = 1; the gated peer counts 0
    assert lp.grad[2].abs().sum() == 0 and lp.grad[0].abs().sum() > 0  # weight 0: no gradient
    assert stats["tokens_peer"] == T and stats["tokens_self"] == 2 * T
