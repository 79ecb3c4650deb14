"""The gap between the engine that sampled a policy's own responses and the trainer that learns from
them, measured every step and corrected by a part (``method.correction``; docs/design.md, "Engine and
trainer").

The rollout engine records log mu of each token it sampled (``RolloutGroup.gen_logprobs``); the
trainer computes log pi_old of the same token, in the forward pass that also serves the step's first
update (or before the first update, for rows trained later). With the same weights the two differ by
kernels and precision (vLLM in bf16, a KV cache against a full forward) and, with ``rollout.lag``,
by the weights themselves. Per own token, rho = pi_old / mu = exp(log pi_old - log mu).

:func:`gap` measures it (the ``mismatch_*`` metrics: the k3 estimate of KL(mu || pi_old), the mean
and largest |log rho|, the fraction of tokens outside the correction's bounds); a correction turns it
into a weight per own token that the loss multiplies its per-token term by (a detached factor, as
verl, TRL and OpenRLHF apply theirs; 0 masks a token out of the loss but not out of its
denominator). Peer responses get weight 1: they were sampled by another model, in another
vocabulary, and are re-tokenised; the compatibility gate is GRAFT's correction for them. A pair that
shares one tokenizer does not change that: the receiver trains on the peer's *text* re-encoded, and
mu of the peer's engine is the peer's policy, not the receiver's (an importance weight against it is
the gate's s, not this gap).

A correction is ``fn(log_ratio, mask, cfg) -> weight`` over one micro-batch: ``log_ratio`` ``[m, T]``
float64 (log pi_old - log mu), ``mask`` ``[m, T]`` (own tokens with an engine log-prob), ``cfg`` the
method config; ``weight`` ``[m, T]`` (read on ``mask`` only), or ``None`` for no correction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graft_rl.methods.config import check_range
from graft_rl.methods.registry import CORRECTIONS, CorrectionPart
from graft_rl.stats import StepStats

__all__ = ["ICEPOP_BOUNDS", "LARGE_GAP_KL", "gap", "register_correction", "sequence_log_ratio"]

#: IcePop's two-sided band [alpha, beta] (Ling Team, "Every Step Evolves", 2025: 0.5 and 5; verl's
#: ``rollout_is_threshold="0.5_5.0"`` form, not ``rollout_rs_threshold``, which is verl's rejection sampling
#: and keeps ratios in [0.2, 2]); also the band ``mismatch_out`` counts against with no correction
ICEPOP_BOUNDS = (0.5, 5.0)

#: a run whose mean ``mismatch_kl`` is above this gets a line in its summary and report: a bf16 vLLM
#: engine beside an FSDP trainer is typically 1e-4 to 1e-3 per token on dense models (Yao et al. 2025;
#: the TIS and IcePop reports), and training has been seen to collapse above it
LARGE_GAP_KL = 1e-3

#: log-ratios are clamped to this before ``exp`` (a sequence's sum of them can be large)
MAX_LOG = 20.0


def register_correction(
    name: str,
    level: str = "token",
    bounds: Callable[..., tuple[float, float]] | None = None,
    Params=None,
    check=None,
) -> Callable:
    """Decorator: make ``fn(log_ratio, mask, cfg) -> weight | None`` available as ``method.correction: NAME``.
    ``level``: ``token`` or ``sequence``; ``bounds``: ``cfg -> (low, high)``, the ratios it leaves as they
    are (``mismatch_out`` counts what lies outside); ``Params``/``check``: its own ``method.KEY`` keys."""
    return CORRECTIONS.register(name, level=level, bounds=bounds, Params=Params, check=check)


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[m]``: each response's log of the product of its token ratios, sum_t log rho_t over ``mask``."""
    return (log_ratio * mask.to(log_ratio.dtype)).sum(dim=1)


# --------------------------------------------------------------------------- the parts
@register_correction("none", bounds=lambda cfg: ICEPOP_BOUNDS)
def no_correction(log_ratio, mask, cfg):
    """No correction (the paper's setting and the default): the gap is measured, the loss is as before."""
    return None


@dataclass
class TISParams:
    # C of truncated importance sampling, min(rho, C): 2.0, verl's default (Yao et al. 2025); TRL's cap,
    # ``vllm_importance_sampling_clip_max`` (formerly ``vllm_importance_sampling_cap``), defaults to 3.0
    tis_cap: float = 2.0


def _check_tis(cfg) -> None:
    check_range(cfg, {"tis_cap": (1.0, math.inf, True)})


@register_correction("tis", bounds=lambda cfg: (0.0, cfg.tis_cap), Params=TISParams, check=_check_tis)
def tis(log_ratio, mask, cfg):
    """Token-level truncated importance sampling: weight ``min(rho_t, C)`` per own token (Yao et al.,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", 2025; verl's
    ``rollout_is: token`` with ``rollout_is_threshold: 2.0``, OpenRLHF's ``--vllm_is_correction_type
    tis``, TRL's ``token_truncate``). ``C``: ``method.tis_cap`` (2.0, verl's default; TRL's
    ``vllm_importance_sampling_clip_max`` defaults to 3.0: set ``method.tis_cap=3`` to match it)."""
    return torch.exp(log_ratio.clamp(-MAX_LOG, math.log(cfg.tis_cap)))


@register_correction(
    "tis_sequence", level="sequence", bounds=lambda cfg: (0.0, cfg.tis_cap), Params=TISParams, check=_check_tis
)
def tis_sequence(log_ratio, mask, cfg):
    """Sequence-level truncated importance sampling: every token of a response weighted by
    ``min(prod_t rho_t, C)`` (verl's ``rollout_is: sequence``; TRL's ``sequence_truncate``).
    ``C``: ``method.tis_cap`` (2.0)."""
    seq = sequence_log_ratio(log_ratio, mask).clamp(-MAX_LOG, math.log(cfg.tis_cap))
    return torch.exp(seq)[:, None].expand_as(log_ratio)


@dataclass
class IcePopParams:
    icepop_low: float = ICEPOP_BOUNDS[0]  # alpha: tokens with rho below it are masked out (IcePop: 0.5)
    icepop_high: float = ICEPOP_BOUNDS[1]  # beta: tokens with rho above it are masked out (IcePop: 5.0)


def _check_icepop(cfg) -> None:
    check_range(cfg, {"icepop_low": (0.0, 1.0, True), "icepop_high": (1.0, math.inf, False)})


@register_correction(
    "icepop", bounds=lambda cfg: (cfg.icepop_low, cfg.icepop_high), Params=IcePopParams, check=_check_icepop
)
def icepop(log_ratio, mask, cfg):
    """IcePop (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model", 2025, Eq. 6): ``M(rho_t) = rho_t`` if ``alpha <= rho_t <= beta``, else 0: the
    token keeps its importance weight inside the band and leaves the loss outside it (its
    denominator keeps it). ``alpha``, ``beta``: ``method.icepop_low`` / ``icepop_high`` (0.5 / 5.0, the
    paper's; verl's ``"0.5_5.0"``; OpenRLHF's ``icepop``)."""
    rho = torch.exp(log_ratio.clamp(-MAX_LOG, MAX_LOG))
    keep = (rho >= cfg.icepop_low) & (rho <= cfg.icepop_high)
    return torch.where(keep, rho, torch.zeros_like(rho))


@dataclass
class MaskSequenceParams:
    mask_cap: float = 3.0  # C of TRL's sequence mask: a response with prod_t rho_t > C leaves the loss (TRL: 3.0)


@register_correction(
    "mask_sequence",
    level="sequence",
    bounds=lambda cfg: (0.0, cfg.mask_cap),
    Params=MaskSequenceParams,
    check=lambda cfg: check_range(cfg, {"mask_cap": (1.0, math.inf, True)}),
)
def mask_sequence(log_ratio, mask, cfg):
    """TRL's sequence mask (``GRPOConfig(vllm_importance_sampling_mode="sequence_mask")``, cap
    ``vllm_importance_sampling_clip_max=3.0``, formerly ``vllm_importance_sampling_cap``): every token of a response weighted by ``rho = prod_t
    rho_t``, and a response with ``rho > C`` masked out whole. ``C``: ``method.mask_cap`` (3.0)."""
    seq = sequence_log_ratio(log_ratio, mask)
    rho = torch.exp(seq.clamp(-MAX_LOG, math.log(cfg.mask_cap) + 1.0))
    w = torch.where(seq <= math.log(cfg.mask_cap), rho, torch.zeros_like(rho))
    return w[:, None].expand_as(log_ratio)


# --------------------------------------------------------------------------- measuring
def gap(
    old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, part: CorrectionPart, cfg
) -> tuple[torch.Tensor | None, StepStats]:
    """``(weight, sums)`` of one micro-batch: the correction's weight ``[m, T]`` (float32, 1 off ``mask``;
    None for no correction) and the sums and maxima the step's ``mismatch_*`` / ``correction_*`` metrics
    are formed from (:mod:`graft_rl.stats`; docs/metrics.md):

    - ``mismatch_tokens``: own tokens with an engine log-prob (``mask``);
    - ``mismatch_k3``: sum of k3 = (rho - 1) - log rho, an unbiased estimate of KL(mu || pi_old) per token
      under mu's samples (Schulman, "Approximating KL divergence", 2020);
    - ``mismatch_abs``: sum of |log rho|; maximum ``mismatch_abs`` (in ``peaks``): the largest;
    - ``mismatch_out``: tokens whose ratio (the token's, or its response's for a sequence-level
      correction) lies outside the correction's bounds;
    - ``correction_weight`` / ``correction_masked`` (a correction only): sum of the weights, tokens weighted 0.

    Computed in float64 (``expm1``: k3 of a 1e-7 gap is 5e-15, not float32 rounding).
    """
    m = mask.to(torch.float64)
    log_ratio = (old.detach().to(torch.float64) - mu.to(torch.float64)) * m
    k3 = torch.expm1(log_ratio.clamp(max=MAX_LOG)) - log_ratio
    lo, hi = part.bounds(cfg) if part.bounds is not None else ICEPOP_BOUNDS
    if part.level == "sequence":
        seq = sequence_log_ratio(log_ratio, mask)[:, None].expand_as(log_ratio)
        out = (seq < _log(lo)) | (seq > _log(hi))
    else:
        out = (log_ratio < _log(lo)) | (log_ratio > _log(hi))
    sums = StepStats()
    sums.add("mismatch_tokens", float(m.sum()))
    sums.add("mismatch_k3", float((k3 * m).sum()))
    sums.add("mismatch_abs", float((log_ratio.abs() * m).sum()))
    sums.add("mismatch_out", float((out.to(torch.float64) * m).sum()))
    if m.numel() and float(m.sum()) > 0:
        sums.peak("mismatch_abs", float((log_ratio.abs() * m).max()))
    w = part(log_ratio, mask, cfg)
    if w is None:
        return None, sums
    w = torch.where(mask.bool(), w.to(torch.float64), torch.ones_like(log_ratio))
    sums.add("correction_weight", float((w * m).sum()))
    sums.add("correction_masked", float(((w == 0).to(torch.float64) * m).sum()))
    return w.to(torch.float32), sums


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf
