"""The advantage parts (methods/advantages.py): each is its algo equation (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl import algo
from graft_rl.methods import MethodConfig
from graft_rl.methods.advantages import AdvantageContext
from graft_rl.methods.registry import ADVANTAGES

rewards_2d = st.integers(1, 4).flatmap(
    lambda g: st.integers(2, 8).flatmap(
        lambda n: st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=n, max_size=n), min_size=g, max_size=g)
    )
)


# ---------------------------------------------------------------- advantages: their equations
@settings(max_examples=60, deadline=None)
@given(rewards_2d)
def test_rloo_is_the_reward_minus_the_mean_of_the_others(rows):
    """RLOO (Ahmadian et al., 2024, Eq. 7): a_i = r_i - 1/(n-1) sum_{j != i} r_j = n/(n-1) (r_i - mean r)."""
    r = torch.tensor(rows, dtype=torch.float64)
    a = algo.rloo_advantages(r)
    n = r.shape[1]
    for g in range(r.shape[0]):
        for i in range(n):
            others = [r[g, j] for j in range(n) if j != i]
            assert float(a[g, i]) == pytest.approx(float(r[g, i] - sum(others) / (n - 1)), abs=1e-12)
    assert torch.allclose(a, n / (n - 1) * (r - r.mean(1, keepdim=True)))
    assert torch.allclose(a.sum(1), torch.zeros(r.shape[0], dtype=torch.float64), atol=1e-12)  # zero-sum per group


@settings(max_examples=60, deadline=None)
@given(rewards_2d, st.floats(-3, 3))
def test_dr_grpo_subtracts_the_mean_and_is_shift_invariant(rows, shift):
    """Dr. GRPO (Liu et al., 2025, Eq. 3): a_i = r_i - mean(r); no std, so scaling rewards scales it."""
    r = torch.tensor(rows, dtype=torch.float64)
    a = algo.dr_grpo_advantages(r)
    assert torch.allclose(a, r - r.mean(1, keepdim=True))
    assert torch.allclose(algo.dr_grpo_advantages(r + shift), a)
    assert torch.allclose(algo.dr_grpo_advantages(2 * r), 2 * a)


@settings(max_examples=40, deadline=None)
@given(rewards_2d)
def test_the_registered_advantages_are_the_algo_equations(rows):
    r = torch.tensor(rows, dtype=torch.float64)
    ctx = AdvantageContext("A", MethodConfig(name="graft"))
    assert torch.equal(ADVANTAGES.get("grpo")(r, ctx), algo.grpo_advantages(r, 1e-6))
    assert torch.equal(ADVANTAGES.get("dr_grpo")(r, ctx), algo.dr_grpo_advantages(r))
    assert torch.equal(ADVANTAGES.get("rloo")(r, ctx), algo.rloo_advantages(r))
