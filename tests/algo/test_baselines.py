"""Appendix B / G building blocks: each test names the paper definition it checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl.algo import (
    balanced_exchange,
    count_matched_random_prompts,
    dynamic_sampling_mask,
    grpo_advantages,
    hacpo_advantages,
    hacpo_capability_ratio,
    hacpo_peer_clip_lower,
    hacpo_policy_loss,
    luffy_policy_loss,
    luffy_shaping,
    policy_loss,
    pooled_advantages,
    random_admission_weight,
    reference_kl,
    sgt_eligible,
    sgt_nll,
    sgt_select,
    success_only_mask,
)


def test_pooled_groups_normalise_over_concatenated_group():
    recv = torch.tensor([[0.0, 0.0, 0.0]])
    src = torch.tensor([[1.0, 1.0, 0.0]])
    a_recv, a_src = pooled_advantages(recv, src)
    ref = grpo_advantages(torch.cat([recv, src], dim=1))
    assert torch.allclose(torch.cat([a_recv, a_src], dim=1), ref)
    # pooled advantages differ from the source-computed ones GRAFT keeps
    assert not torch.allclose(a_src, grpo_advantages(src))


def test_success_only_removes_failed_peer_rows_from_numerator_and_denominator():
    mask = torch.ones(4, 3)
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    is_peer = torch.tensor([False, False, True, True])
    m = success_only_mask(mask, rewards, is_peer)
    assert m.sum(dim=1).tolist() == [3, 3, 0, 3]  # own failure kept, peer failure dropped
    lp = torch.zeros(4, 3)
    adv = torch.tensor([-1.0, 1.0, -0.5, 0.5])
    _, st = policy_loss(lp, lp, adv, m)
    assert st["num_tokens"].item() == 9


def test_count_matched_random_prompts_match_counts_and_are_uniform():
    k_a = torch.tensor([3, 0, 5, 2, 0, 0, 7, 1])
    k_b = torch.tensor([0, 2, 0, 0, 4, 1, 0, 0])
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n=8)
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(8)
    for _ in range(2000):
        ra, rb = count_matched_random_prompts(a_to_b, b_to_a, g)
        assert ra.sum() == a_to_b.sum() and rb.sum() == b_to_a.sum()
        hits += ra.float()
    # irrespective of rewards: every prompt is chosen about equally often
    freq = hits / 2000
    assert torch.allclose(freq, torch.full((8,), int(a_to_b.sum()) / 8), atol=0.05)


def test_random_admission_matches_gate_count_with_min_s_1_weights():
    s = torch.tensor([0.5, 0.9, 1.4, 0.2, 0.85, 0.3])
    w = random_admission_weight(s, delta=0.8, generator=torch.Generator().manual_seed(1))
    admitted = w > 0
    assert int(admitted.sum()) == 3  # the gate admits 0.9, 1.4 and 0.85
    assert torch.allclose(w[admitted], s[admitted].clamp(max=1.0))


def test_luffy_shaping_function():
    x = torch.tensor([0.0, 0.1, 0.5, 1.0])
    assert torch.allclose(luffy_shaping(x), x / (x + 0.1))


def test_luffy_peer_tokens_use_shaped_probability_no_clip_own_tokens_clipped():
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[2.0, 2.0], [0.5, 0.25]]))  # own ratio 2 (clipped); peer probs .5/.25
    adv = torch.tensor([1.0, 2.0])
    is_peer = torch.tensor([False, True])
    loss, st = luffy_policy_loss(lp.requires_grad_(), old, adv, torch.ones(2, 2), is_peer)
    own = 2 * 1.28 * 1.0
    peer = (0.5 / 0.6 + 0.25 / 0.35) * 2.0
    assert loss.item() == pytest.approx(-(own + peer) / 4)
    assert st["clip_frac"].item() == 1.0
    loss.backward()
    # gradient of -f(exp(lp))*a/4 w.r.t. lp is -a*gamma*p/(p+gamma)^2/4 for peer tokens
    p = torch.tensor([0.5, 0.25])
    assert torch.allclose(lp.grad[1], -2.0 * 0.1 * p / (p + 0.1) ** 2 / 4)


def test_sgt_eligibility_has_no_upper_bound_on_peer_successes():
    assert sgt_eligible(torch.tensor([0, 0, 0, 2]), torch.tensor([8, 1, 0, 3])).tolist() == [True, True, False, False]


def test_sgt_select_picks_a_correct_response_uniformly():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    selected = torch.tensor([True, True, False])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(1000):
        idx = sgt_select(rewards, selected, g)
        assert idx[1] == -1 and idx[2] == -1  # no success / not selected
        assert rewards[0, idx[0]] == 1
        counts[idx[0]] += 1
    assert counts[0] == counts[2] == 0 and abs(counts[1] - counts[3]) < 150


def test_sgt_nll_is_lambda_times_token_mean_nll():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = sgt_nll(lp, mask)
    assert out.item() == pytest.approx(0.1 * 6 / 3)
    out.backward()
    assert torch.allclose(lp.grad, -0.1 * mask / 3)
    assert sgt_nll(torch.zeros(0, 2), torch.zeros(0, 2)).item() == 0.0


def test_hacpo_peer_lower_bound_rises_per_minibatch_update_and_caps_at_one():
    # indexed by the minibatch update within a step (HACPO's recipe), restarting each step
    assert hacpo_peer_clip_lower(0) == 0.8
    assert hacpo_peer_clip_lower(2) == pytest.approx(0.85)
    assert hacpo_peer_clip_lower(100) == 1.0
    with pytest.raises(ValueError):
        hacpo_peer_clip_lower(-1)


def test_hacpo_capability_ratio_is_bounded():
    assert hacpo_capability_ratio(0.4, 0.2) == pytest.approx(2.0)
    assert hacpo_capability_ratio(0.9, 0.01) == 10.0
    assert hacpo_capability_ratio(0.001, 0.9) == 0.1


def test_hacpo_capability_aware_baseline():
    rs = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    rp = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    a_s, a_p = hacpo_advantages(rs, rp, capability_self=0.25, capability_peer=0.5)
    pooled = torch.cat([rs, rp], 1)
    # row 0: baseline = mean(1, 0, 0.5, 0.5) = 0.5 (peer rewards weighted by P_self/P_peer)
    std0 = pooled[0].std()
    assert torch.allclose(a_s[0], (rs[0] - 0.5) / (std0 + 1e-6))
    assert torch.allclose(a_p[0], (rp[0] - 0.5) / (std0 + 1e-6))
    # row 1: uniform rewards -> plain mean, zero advantage
    assert torch.all(a_s[1] == 0) and torch.all(a_p[1] == 0)
    # a baseline above 1 falls back to the learner's own mean
    a_s2, _ = hacpo_advantages(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]), 1.0, 0.1)
    std = torch.tensor([1.0, 0.0, 1.0, 1.0]).std()
    assert torch.allclose(a_s2[0], (torch.tensor([1.0, 0.0]) - 0.5) / (std + 1e-6))


def test_hacpo_loss_sequence_ratio_clipping():
    mask = torch.ones(2, 2)
    old = torch.full((2, 2), -1.0)
    lp = torch.full((2, 2), -1.0 + 0.01, requires_grad=True)  # own ratio exp(0.01) > 1 + 4e-4
    src = torch.tensor([-1.0, -0.5])  # peer ratio exp(-0.49) ~ 0.61 < 0.8 lower bound
    adv = torch.tensor([1.0, 1.0])
    is_peer = torch.tensor([False, True])
    loss, st = hacpo_policy_loss(lp, old, src, adv, mask, is_peer, update_index=0, capability_ratio=2.0)
    own = 1 + 4e-4
    peer = 0.8 * 0.8 * 2.0
    assert loss.item() == pytest.approx(-(own + peer) / 2, rel=1e-5)
    assert st["clip_frac"].item() == 1.0 and st["peer_clip_frac_low"].item() == 1.0
    assert st["peer_clip_lower"].item() == pytest.approx(0.8)
    assert st["clipped_seq"].tolist() == [True, True]


def test_hacpo_log_ratio_is_clamped_at_the_recipes_10():
    mask = torch.ones(1, 2)
    lp = torch.full((1, 2), -1.0, requires_grad=True)
    _, st = hacpo_policy_loss(
        lp,
        torch.full((1, 2), -40.0),
        torch.tensor([-40.0]),
        torch.tensor([-1.0]),
        mask,
        torch.tensor([False]),
        update_index=0,
    )
    loss, _ = hacpo_policy_loss(
        lp,
        torch.full((1, 2), -40.0),
        torch.tensor([-40.0]),
        torch.tensor([-1.0]),
        mask,
        torch.tensor([False]),
        update_index=0,
    )
    # own objective min(r a, clip(r) a) with a = -1 picks r = e^10 (not e^20): loss = e^10
    assert loss.item() == pytest.approx(float(torch.exp(torch.tensor(10.0))), rel=1e-5)


def test_dynamic_sampling_keeps_non_zero_variance_groups():
    r = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.2]])
    assert dynamic_sampling_mask(r).tolist() == [True, False, False, True]


# --------------------------------------------------------------------------- KL to a reference
def test_reference_kl_is_zero_at_the_reference_and_matches_k3():
    lp = -torch.rand(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float64)
    assert float(reference_kl(lp, lp, mask)) == 0.0
    ref = -torch.rand(3, 5, dtype=torch.float64)
    r = ref - lp
    expected = ((r.exp() - r - 1) * mask).sum() / mask.sum()
    assert torch.allclose(reference_kl(lp, ref, mask), expected)
    assert float(reference_kl(lp, ref, torch.zeros_like(mask))) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        reference_kl(lp, ref[:, :4], mask)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_reference_kl_is_nonnegative_and_pulls_towards_the_reference(M, T, seed):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(M, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = -torch.rand(M, T, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(M, T, dtype=torch.float64)
    kl = reference_kl(lp, ref, mask)
    assert float(kl.detach()) >= 0
    kl.backward()
    # d/dlp (e^{ref-lp} - (ref-lp) - 1) = 1 - e^{ref-lp}: descending moves lp towards ref
    expected = (1 - torch.exp(ref - lp.detach())) / (M * T)
    assert torch.allclose(lp.grad, expected)
    assert ((lp.grad * (lp.detach() - ref)) >= -1e-12).all()
