"""dtype and device agnosticism of the algo API (float32, bfloat16, float64; CPU and CUDA when present)."""

from __future__ import annotations

import doctest

import pytest
import torch

import graft_rl.algo.baselines
import graft_rl.algo.core
from graft_rl.algo import (
    balanced_exchange,
    compatibility_score,
    compatibility_weight,
    grpo_advantages,
    mean_token_logprob,
    minibatch_order,
    policy_loss,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_pipeline_in_dtype(dtype, device):
    g = torch.Generator().manual_seed(0)
    G, n, T = 6, 4, 5
    rewards = (torch.rand(G, n, generator=g) > 0.5).to(dtype).to(device)
    adv = grpo_advantages(rewards)
    assert adv.dtype == dtype and adv.device.type == device
    k = rewards.sum(dim=1).long()
    a_to_b, b_to_a = balanced_exchange(k, torch.zeros_like(k), n)
    assert a_to_b.device.type == device
    lp64 = -torch.rand(G * n, T, generator=g, dtype=torch.float64)
    lp = lp64.to(dtype).to(device).requires_grad_(True)
    mask = torch.ones(G * n, T, device=device)
    mean = mean_token_logprob(lp.detach(), mask)
    assert mean.dtype == dtype
    s = compatibility_score(mean, mean - 0.05)
    w = compatibility_weight(s)
    assert w.dtype == dtype and torch.all(w > 0)
    loss, stats = policy_loss(lp, lp.detach() + 0.01, adv.flatten(), mask, weights=w)
    assert loss.dtype == dtype and loss.device.type == device
    loss.backward()
    assert lp.grad is not None and lp.grad.dtype == dtype
    ref, _ = policy_loss(lp64, lp64 + 0.01, adv.flatten().double().cpu(), mask.double().cpu(), weights=w.double().cpu())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert loss.double().cpu().item() == pytest.approx(ref.item(), rel=tol, abs=tol)
    assert all(v.dtype == torch.float32 for v in stats.values())
    order = minibatch_order(a_to_b, 4)
    assert all(b.device.type == device for b in order)


@pytest.mark.parametrize("module", [graft_rl.algo.core, graft_rl.algo.baselines])
def test_docstring_worked_examples(module):
    """Every worked example in the algo docstrings is exact."""
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
