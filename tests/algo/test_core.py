"""Each test names the SPEC section 2 / paper rule it checks."""

from __future__ import annotations

import math

import pytest
import torch

from graft_rl import algo
from graft_rl.algo import (
    balanced_exchange,
    compatibility_score,
    compatibility_weight,
    complementary_mask,
    grpo_advantages,
    mean_token_logprob,
    minibatch_order,
    policy_loss,
)


# ------------------------------------------------------------------ GRPO advantages
def test_rule_grpo_advantage_uses_unbiased_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    std = math.sqrt(((0.75**2) + 3 * 0.25**2) / 3)  # Bessel: divide by n-1 (the biased std, /n, is 0.433)
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (std + 1e-6)  # r - mean 0.25
    assert torch.allclose(grpo_advantages(r), expected)
    assert not torch.allclose(grpo_advantages(r), expected * (std + 1e-6) / (math.sqrt(0.1875) + 1e-6))


def test_rule_grpo_advantage_eps_in_denominator():
    r = torch.tensor([[1.0, 0.0]])
    std = math.sqrt(0.5)
    assert grpo_advantages(r, eps=0.5)[0, 0].item() == pytest.approx(0.5 / (std + 0.5))


def test_rule_group_of_size_one_gets_zero_advantage():
    assert torch.equal(grpo_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


def test_rule_uniform_group_gets_zero_advantage():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 3))


def test_grpo_advantages_accepts_integer_and_bool_rewards():
    adv = grpo_advantages(torch.tensor([[True, False]]))
    assert adv.dtype == torch.float32 and adv[0, 0] > 0 > adv[0, 1]


def test_grpo_advantages_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"rewards must be \[G, n\]"):
        grpo_advantages(torch.zeros(4))


# ------------------------------------------------------------------ complementary candidates
def test_rule_candidate_requires_receiver_all_fail_and_source_mixed():
    k_src = torch.tensor([3, 0, 8, 1, 7, 2])
    k_recv = torch.tensor([0, 0, 0, 2, 0, 1])
    # 0: recv fails, src mixed -> yes; 1: src fails too; 2: src all-pass (no contrast);
    # 3: recv not all-fail; 4: src 7/8 -> yes; 5: recv has a success
    assert complementary_mask(k_src, k_recv, n=8).tolist() == [True, False, False, False, True, False]


def test_complementary_mask_shape_error():
    with pytest.raises(ValueError, match="k_src and k_recv"):
        complementary_mask(torch.tensor([1, 2]), torch.tensor([0]), n=8)


# ------------------------------------------------------------------ balanced exchange
def test_rule_balanced_exchange_worked_example():
    a_to_b, b_to_a = balanced_exchange(torch.tensor([3, 0, 5]), torch.tensor([0, 2, 0]), n=8)
    assert a_to_b.tolist() == [False, False, True]
    assert b_to_a.tolist() == [False, True, False]


def test_rule_balanced_exchange_keeps_all_ties_at_boundary():
    # A->B candidates: prompts 0..3 with k_a = 5, 3, 3, 1; B->A candidates: prompts 4, 5 -> m = 2.
    k_a = torch.tensor([5, 3, 3, 1, 0, 0])
    k_b = torch.tensor([0, 0, 0, 0, 4, 2])
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n=8)
    # 2nd largest k_a among candidates is 3, and both 3s are kept (3 prompts > m).
    assert a_to_b.tolist() == [True, True, True, False, False, False]
    assert b_to_a.tolist() == [False, False, False, False, True, True]


def test_rule_balanced_exchange_m_zero_exchanges_nothing():
    a_to_b, b_to_a = balanced_exchange(torch.tensor([3, 4, 5]), torch.tensor([0, 0, 0]), n=8)
    assert not a_to_b.any() and not b_to_a.any()


def test_rule_without_balance_every_candidate_moves():
    a_to_b, b_to_a = balanced_exchange(torch.tensor([3, 4, 5]), torch.tensor([0, 0, 0]), n=8, balance=False)
    assert a_to_b.all() and not b_to_a.any()


def test_rule_balancing_ranks_by_source_count_not_receiver():
    # B->A has one candidate (prompt 3); A->B has prompts 0 (k_a=1) and 1 (k_a=6).
    a_to_b, _ = balanced_exchange(torch.tensor([1, 6, 0, 0]), torch.tensor([0, 0, 0, 5]), n=8)
    assert a_to_b.tolist() == [False, True, False, False]


# ------------------------------------------------------------------ compatibility
def test_rule_mean_token_logprob_is_length_normalised():
    lp = torch.tensor([[-1.0, -2.0, -3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert mean_token_logprob(lp, mask).item() == pytest.approx(-2.0)


def test_empty_response_mean_is_nan_and_gated_out():
    mean = mean_token_logprob(torch.zeros(1, 3), torch.zeros(1, 3))
    assert torch.isnan(mean).all()
    s = compatibility_score(mean, torch.tensor([-1.0]))
    assert compatibility_weight(s).item() == 0.0
    assert compatibility_weight(s, floor=False).item() == 0.0


def test_rule_compatibility_score_is_exp_of_mean_difference():
    s = compatibility_score(torch.tensor([-1.2, -0.5]), torch.tensor([-1.0, -1.0]))
    assert torch.allclose(s, torch.exp(torch.tensor([-0.2, 0.5])))


def test_rule_gate_is_strict_at_delta():
    w = compatibility_weight(torch.tensor([0.8, 0.80001, 0.79999]), delta=0.8)
    assert w[0].item() == 0.0
    assert w[1].item() == pytest.approx(0.80001)
    assert w[2].item() == 0.0


def test_rule_weight_capped_at_one():
    assert compatibility_weight(torch.tensor([1.0, 3.5, float("inf")])).tolist() == [1.0, 1.0, 1.0]


def test_rule_no_floor_ablation_is_min_s_1():
    w = compatibility_weight(torch.tensor([0.1, 0.8, 2.0]), floor=False)
    assert torch.allclose(w, torch.tensor([0.1, 0.8, 1.0]))


def test_compatibility_weight_is_detached():
    s = torch.tensor([0.9, 1.2], requires_grad=True)
    assert not compatibility_weight(s).requires_grad


# ------------------------------------------------------------------ policy loss
def _written_out_loss(lp, old, adv, mask, w, eps_low=0.2, eps_high=0.28):
    """The objective J of Section 4.2 written token by token, as a reference."""
    total, count = 0.0, 0.0
    for j in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[j, t]:
                count += 1
                rho = torch.exp(lp[j, t] - old[j, t])
                total = total + w[j] * torch.minimum(rho * adv[j], torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv[j])
    return -total / count


def test_rule_token_loss_matches_written_out_formula_and_gradient():
    g = torch.Generator().manual_seed(0)
    M, T = 5, 7
    old = -torch.rand(M, T, generator=g, dtype=torch.float64) * 3
    lp = (old + 0.4 * torch.randn(M, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(M, generator=g, dtype=torch.float64)
    mask = (torch.rand(M, T, generator=g) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    w = torch.tensor([1.0, 1.0, 0.0, 0.85, 0.93], dtype=torch.float64)
    loss, _ = policy_loss(lp, old, adv, mask, weights=w)
    ref = _written_out_loss(lp, old, adv, mask, w)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    (grad_ref,) = torch.autograd.grad(ref, lp)
    assert torch.allclose(grad, grad_ref, atol=1e-12)
    # gated response (w=0) and padding receive no gradient
    assert torch.all(grad[2] == 0)
    assert torch.all(grad[mask == 0] == 0)


def test_policy_loss_gradcheck():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    # keep ratios away from clip kinks, where the gradient is not defined
    lp = (old + torch.tensor([0.05, -0.05, 0.5, -0.6], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.7, 0.3], dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    w = torch.tensor([1.0, 0.9, 0.85], dtype=torch.float64)
    for ratio in ("token", "sequence"):
        assert torch.autograd.gradcheck(lambda x, ratio=ratio: policy_loss(x, old, adv, mask, w, ratio=ratio)[0], (lp,))


def test_rule_denominator_counts_gated_tokens():
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, 1.0])
    loss_gated, st = policy_loss(lp, lp, adv, mask, weights=torch.tensor([1.0, 0.0]))
    # only response 0 contributes (3 tokens x 1), but all 6 tokens are in the denominator
    assert loss_gated.item() == pytest.approx(-3.0 / 6.0)
    assert st["num_tokens"].item() == 6 and st["num_active_tokens"].item() == 3


def test_rule_self_responses_have_unit_weight_by_default():
    lp = torch.log(torch.full((2, 2), 0.5))
    adv = torch.tensor([0.5, -1.0])
    a, _ = policy_loss(lp, lp, adv, torch.ones(2, 2))
    b, _ = policy_loss(lp, lp, adv, torch.ones(2, 2), weights=torch.ones(2))
    assert a.item() == b.item() == pytest.approx(0.25)


def test_rule_clipping_is_asymmetric_by_advantage_sign():
    old = torch.zeros(4, 1)
    lp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, st = policy_loss(lp, old, adv, torch.ones(4, 1))
    # a>0, rho=1.5 -> clipped to 1.28; a<0, rho=1.5 -> unclipped -1.5
    # a>0, rho=0.5 -> unclipped 0.5;    a<0, rho=0.5 -> clipped to -0.8
    assert loss.item() == pytest.approx(-(1.28 - 1.5 + 0.5 - 0.8) / 4)
    assert st["clip_frac"].item() == pytest.approx(0.5)
    assert st["clip_frac_pos_adv"].item() == pytest.approx(0.5)
    assert st["clip_frac_neg_adv"].item() == pytest.approx(0.5)


def test_clip_frac_split_by_sign():
    old = torch.zeros(3, 2)
    lp = torch.log(torch.tensor([[1.4, 1.0], [1.0, 1.0], [0.7, 0.7]]))
    adv = torch.tensor([2.0, 1.0, -1.0])
    _, st = policy_loss(lp, old, adv, torch.ones(3, 2))
    assert st["clip_frac_pos_adv"].item() == pytest.approx(1 / 4)
    assert st["clip_frac_neg_adv"].item() == pytest.approx(1.0)
    assert st["clip_frac"].item() == pytest.approx(3 / 6)


def test_rule_sequence_ratio_uses_masked_mean_log_ratio():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.1, 0.3, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(lp, old, torch.tensor([1.0]), mask, ratio="sequence")
    rho = math.exp(0.2)
    assert loss.item() == pytest.approx(-min(rho, 1.28) * 2 / 2)


def test_per_token_advantages_accepted():
    lp = torch.zeros(2, 2)
    a2 = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    loss, _ = policy_loss(lp, lp, a2, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-(1 + 2 + 0 - 1) / 4)


def test_policy_loss_empty_minibatch_is_zero_and_differentiable():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, st = policy_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and st["clip_frac"].item() == 0.0


def test_policy_loss_collapsed_probability_stays_finite():
    old = torch.full((1, 2), -1.0)
    lp = torch.tensor([[-1e4, 60.0]], requires_grad=True)
    loss, _ = policy_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


def test_policy_loss_errors_name_the_argument():
    with pytest.raises(ValueError, match="ratio must be"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), ratio="seq")
    with pytest.raises(ValueError, match="weights must be"):
        policy_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2), torch.ones(2, 1), weights=torch.ones(3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(3), torch.ones(2, 1))


def test_rule_first_update_is_unclipped_because_rho_is_one():
    """Section 4.2 'Peer-last updates': before the first step rho = 1, so nothing is clipped."""
    lp = -torch.rand(4, 5)
    _, st = policy_loss(lp, lp, torch.randn(4), torch.ones(4, 5))
    assert st["clip_frac"].item() == 0.0


# ------------------------------------------------------------------ minibatch order
def test_rule_peer_last_own_groups_come_first():
    is_peer = torch.tensor([True, False, True, False, False, True, False])
    batches = minibatch_order(is_peer, 2, "last", torch.Generator().manual_seed(3))
    flat = torch.cat(batches)
    n_own = int((~is_peer).sum())
    assert not is_peer[flat[:n_own]].any() and is_peer[flat[n_own:]].all()
    assert [len(b) for b in batches] == [2, 2, 2, 1]


def test_rule_peer_first_puts_grafted_groups_first():
    is_peer = torch.tensor([False, True, False, True])
    flat = torch.cat(minibatch_order(is_peer, 3, "first", torch.Generator().manual_seed(0)))
    assert is_peer[flat[:2]].all() and not is_peer[flat[2:]].any()


def test_minibatch_order_is_reproducible_with_generator():
    is_peer = torch.rand(50, generator=torch.Generator().manual_seed(0)) > 0.7
    for pos in ("last", "first", "uniform"):
        a = minibatch_order(is_peer, 8, pos, torch.Generator().manual_seed(5))
        b = minibatch_order(is_peer, 8, pos, torch.Generator().manual_seed(5))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_minibatch_order_errors():
    with pytest.raises(ValueError, match="minibatch_size"):
        minibatch_order(torch.tensor([True]), 0)
    with pytest.raises(ValueError, match="position"):
        minibatch_order(torch.tensor([True]), 1, position="middle")


def test_minibatch_order_empty_batch():
    assert minibatch_order(torch.zeros(0, dtype=torch.bool), 4) == []


def test_import_loads_torch_only():
    import subprocess
    import sys

    code = (
        "import sys; from graft_rl import algo; "
        "bad=[m for m in sys.modules if m.split('.')[0] in ('transformers','vllm','ray','pyarrow','math_verify')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_public_api_names_exist():
    for name in (
        "grpo_advantages",
        "complementary_mask",
        "balanced_exchange",
        "mean_token_logprob",
        "compatibility_score",
        "compatibility_weight",
        "policy_loss",
        "minibatch_order",
    ):
        assert callable(getattr(algo, name))
