"""Property-based tests (hypothesis) of GRAFT's selection, balancing, gating, loss and ordering rules."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from graft_rl.algo import (
    balanced_exchange,
    compatibility_weight,
    complementary_mask,
    grpo_advantages,
    minibatch_order,
    policy_loss,
)

settings.register_profile("graft", max_examples=150, deadline=None, derandomize=True)
settings.load_profile("graft")


@st.composite
def counts(draw, max_g=40):
    n = draw(st.integers(1, 16))
    g = draw(st.integers(0, max_g))
    k_a = draw(st.lists(st.integers(0, n), min_size=g, max_size=g))
    k_b = draw(st.lists(st.integers(0, n), min_size=g, max_size=g))
    return torch.tensor(k_a, dtype=torch.long), torch.tensor(k_b, dtype=torch.long), n


@given(counts())
def test_prop_selection_is_subset_of_complementary_candidates(c):
    k_a, k_b, n = c
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n)
    assert not (a_to_b & ~complementary_mask(k_a, k_b, n)).any()
    assert not (b_to_a & ~complementary_mask(k_b, k_a, n)).any()
    # a prompt never moves both ways: each direction requires the receiver to fail everything
    assert not (a_to_b & b_to_a).any()


@given(counts())
def test_prop_balancing_keeps_at_least_m_and_exactly_the_ties(c):
    k_a, k_b, n = c
    c_ab, c_ba = complementary_mask(k_a, k_b, n), complementary_mask(k_b, k_a, n)
    m = min(int(c_ab.sum()), int(c_ba.sum()))
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n)
    for sel, cand, k_src in ((a_to_b, c_ab, k_a), (b_to_a, c_ba, k_b)):
        if m == 0:
            assert not sel.any()
            continue
        assert int(sel.sum()) >= m
        ranked = sorted(k_src[cand].tolist(), reverse=True)
        threshold = ranked[m - 1]
        # kept exactly the candidates at or above the m-th largest source count
        assert torch.equal(sel, cand & (k_src >= threshold))
        # any extra beyond m are ties at the boundary
        extra = int(sel.sum()) - m
        assert extra <= sum(1 for v in ranked[m:] if v == threshold) and extra == sum(
            1 for v in ranked[m:] if v == threshold
        )


@given(counts())
def test_prop_balancing_is_symmetric_under_swapping_models(c):
    k_a, k_b, n = c
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n)
    b_to_a2, a_to_b2 = balanced_exchange(k_b, k_a, n)
    assert torch.equal(a_to_b, a_to_b2) and torch.equal(b_to_a, b_to_a2)


@given(counts())
def test_prop_balancing_invariant_to_prompt_permutation(c):
    k_a, k_b, n = c
    perm = torch.randperm(k_a.shape[0], generator=torch.Generator().manual_seed(k_a.shape[0]))
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n)
    pa, pb = balanced_exchange(k_a[perm], k_b[perm], n)
    assert torch.equal(a_to_b[perm], pa) and torch.equal(b_to_a[perm], pb)


@given(counts())
def test_prop_unbalanced_is_superset_of_balanced(c):
    k_a, k_b, n = c
    bal = balanced_exchange(k_a, k_b, n)
    unbal = balanced_exchange(k_a, k_b, n, balance=False)
    for s, u in zip(bal, unbal, strict=True):
        assert not (s & ~u).any()


@given(
    st.lists(st.floats(0.0, 3.0, allow_nan=False), min_size=1, max_size=30),
    st.floats(0.05, 1.5, allow_nan=False),
)
def test_prop_gate_threshold_strict_and_weight_bounded(scores, delta):
    s = torch.tensor(scores, dtype=torch.float64)
    w = compatibility_weight(s, delta=delta)
    assert torch.all((w >= 0) & (w <= 1))
    assert torch.all(w[s <= delta] == 0)  # strict '>' gate
    above = s > delta
    assert torch.allclose(w[above], s[above].clamp(max=1.0))
    nf = compatibility_weight(s, delta=delta, floor=False)
    assert torch.allclose(nf, s.clamp(max=1.0))
    assert torch.all(nf >= w)


@given(st.lists(st.integers(0, 1), min_size=1, max_size=16), st.integers(1, 30))
def test_prop_grpo_advantages_sum_to_zero_and_order_rewards(rewards, g):
    r = torch.tensor([rewards] * g, dtype=torch.float64)
    adv = grpo_advantages(r)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(g, dtype=torch.float64), atol=1e-9)
    if 0 < sum(rewards) < len(rewards):
        row = adv[0]
        assert torch.all(row[r[0] == 1] > 0) and torch.all(row[r[0] == 0] < 0)


@given(
    st.integers(1, 12),
    st.integers(1, 9),
    st.integers(0, 10_000),
    st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
)
def test_prop_denominator_counts_gated_tokens(M, T, seed, wlist):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(M, T, generator=g, dtype=torch.float64)
    lp = old + 0.3 * torch.randn(M, T, generator=g, dtype=torch.float64)
    adv = torch.randn(M, generator=g, dtype=torch.float64)
    mask = (torch.rand(M, T, generator=g) > 0.2).double()
    w = torch.tensor(wlist[:M], dtype=torch.float64)
    loss, stats = policy_loss(lp, old, adv, mask, weights=w)
    rho = torch.exp(lp - old)
    obj = torch.minimum(rho * adv[:, None], rho.clamp(0.8, 1.28) * adv[:, None])
    expected = -(obj * mask * w[:, None]).sum() / mask.sum().clamp_min(1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)
    assert stats["num_tokens"].item() == mask.sum().item()
    # zeroing a response's weight leaves the denominator unchanged
    w0 = w.clone()
    w0[0] = 0.0
    _, stats0 = policy_loss(lp, old, adv, mask, weights=w0)
    assert stats0["num_tokens"].item() == stats["num_tokens"].item()


@given(
    st.lists(st.booleans(), min_size=0, max_size=60),
    st.integers(1, 20),
    st.sampled_from(["last", "first", "uniform"]),
    st.integers(0, 2**31 - 1),
)
def test_prop_minibatch_order_partitions_groups(peer_list, size, position, seed):
    is_peer = torch.tensor(peer_list, dtype=torch.bool)
    batches = minibatch_order(is_peer, size, position, torch.Generator().manual_seed(seed))
    flat = torch.cat(batches) if batches else torch.zeros(0, dtype=torch.long)
    assert sorted(flat.tolist()) == list(range(len(peer_list)))  # a partition of range(G)
    assert all(0 < len(b) <= size for b in batches)
    assert all(len(b) == size for b in batches[:-1])  # only the last may be short
    if position == "last":
        seen_peer_batch = False
        for b in batches:
            has_peer = bool(is_peer[b].any())
            if seen_peer_batch:
                # once a minibatch holds a grafted group, no own-only minibatch follows
                assert has_peer
            seen_peer_batch |= has_peer
        # concatenated order: every own group precedes every grafted group
        n_own = int((~is_peer).sum())
        assert not is_peer[flat[:n_own]].any()
    if position == "first":
        n_peer = int(is_peer.sum())
        assert is_peer[flat[:n_peer]].all()
