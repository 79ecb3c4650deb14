"""Ways to share between policies published after the paper (beyond the paper; docs/fidelity.md,
"Methods after the paper"): SAPO's swarm draw, PRP's truncated density ratio, F-TIS's filtered
truncated importance weights. Pure functions, named after their sources; the parts in
:mod:`graft_rl.methods` pick their inputs. (XGRPO's pooled baseline is
:func:`graft_rl.algo.pooled_advantages` over the receiver's group and every peer's.)
"""

from __future__ import annotations

import torch

from graft_rl.algo.core import MAX_LOG_RATIO, _work_dtype

__all__ = ["ftis_token_weights", "sapo_draw", "truncated_sequence_ratio"]


def sapo_draw(informative: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""SAPO's external data points (arXiv 2509.08721, Section 4: "From the shared pool, it removes
    rollouts with zero advantage, samples :math:`J` rollouts from the remaining ones"): ``count``
    indices drawn uniformly without replacement among the ``informative`` ones (fewer when fewer
    are; genrl's ``min(num_transplants, len(trees))``), in the order drawn.

    Args:
        informative: ``[P]`` bool, True for an external data point whose advantages are not all zero.
        count: :math:`J`.
        generator: the draw's ``torch.Generator`` (CPU).

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> sapo_draw(torch.tensor([True, False, True, True]), 2, g).tolist()
        [3, 0]
    """
    if informative.dim() != 1:
        raise ValueError(f"sapo_draw: informative must be [P], got shape {tuple(informative.shape)}")
    if count < 0:
        raise ValueError(f"sapo_draw: count must be >= 0, got {count}")
    idx = torch.nonzero(informative.to("cpu", torch.bool)).flatten()
    perm = torch.randperm(len(idx), generator=generator)
    return idx[perm[:count]]


def truncated_sequence_ratio(recv_logprob_sum: torch.Tensor, src_logprob_sum: torch.Tensor, cap: float) -> torch.Tensor:
    r"""PRP's importance weight of a peer response (Mutual RL, arXiv 2605.07244: "PRP pays a
    density-ratio variance cost"; our reading, docs/fidelity.md): the density ratio of the whole
    response under the receiver and under the peer that sampled it, truncated at ``cap``.

    .. math:: w_j = \min\Big(\exp\big(\textstyle\sum_t \log\pi_{old}(y_{j,t}) - \sum_t \log\mu(y_{j,t})\big),\ C\Big)

    Each sum runs over its own tokenisation of the same text (the receiver's re-tokenisation, the
    peer's sampled tokens), so the ratio is of the text's two probabilities. The log-ratio is clamped
    to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before the exponential.

    Examples:
        >>> truncated_sequence_ratio(torch.tensor([-3.0, -1.0]), torch.tensor([-1.0, -3.0]), 2.0)
        tensor([0.1353, 2.0000])
    """
    wd = _work_dtype(recv_logprob_sum)
    log_ratio = (recv_logprob_sum.to(wd) - src_logprob_sum.to(wd)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap).to(recv_logprob_sum.dtype)


def ftis_token_weights(
    old_logprobs: torch.Tensor,
    src_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    cap: float = 2.0,
    kl_threshold: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""F-TIS's weights of off-policy (peer) tokens (arXiv 2605.22537: truncated importance sampling
    combined with filtering out negative-advantage off-policy samples whose KL exceeds a threshold;
    our reading of its summaries, docs/fidelity.md). Per token, the truncated importance weight of the
    receiver's pi_old over the sampler's mu; per response, the k3 estimate of KL(mu || pi_old) over its
    tokens, and a response with a negative advantage and a KL above ``kl_threshold`` is filtered out
    (weight 0 on every token):

    .. math:: w_{j,t} = \min\big(\pi_{old}(y_{j,t}) / \mu(y_{j,t}),\ C\big)\cdot
              \mathbb 1\big[\hat a_j \ge 0 \ \lor\ \widehat{KL}_j \le \tau\big],\qquad
              \widehat{KL}_j = \mathrm{mean}_t\big(\rho_{j,t} - 1 - \log\rho_{j,t}\big),\ \rho = \pi_{old}/\mu

    Args:
        old_logprobs: ``[M, T]`` the receiver's log-probs of the tokens before the update.
        src_logprobs: ``[M, T]`` the sampler's log-probs of the same tokens (one vocabulary).
        mask: ``[M, T]`` response tokens.
        advantages: ``[M]`` the responses' advantages.
        cap: :math:`C`, the truncation. kl_threshold: :math:`\tau`.

    Returns:
        ``(weights [M, T], kl [M], kept [M] bool)``; weights are 0 outside ``mask``.

    Examples:
        >>> old = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.9]]))
        >>> mu = torch.log(torch.tensor([[0.5, 0.1], [0.1, 0.1]]))
        >>> w, kl, kept = ftis_token_weights(old, mu, torch.ones(2, 2), torch.tensor([1.0, -1.0]))
        >>> w.tolist(), kept.tolist()
        ([[1.0, 2.0], [0.0, 0.0]], [True, False])
    """
    if old_logprobs.shape != src_logprobs.shape or old_logprobs.shape != mask.shape or old_logprobs.dim() != 2:
        raise ValueError(
            "ftis_token_weights: old_logprobs, src_logprobs and mask must be one [M, T] shape, got "
            f"{tuple(old_logprobs.shape)}, {tuple(src_logprobs.shape)}, {tuple(mask.shape)}"
        )
    wd = torch.float64
    m = mask.to(wd)
    log_rho = ((old_logprobs.to(wd) - src_logprobs.to(wd)) * m).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = (torch.expm1(log_rho) - log_rho) * m
    kl = k3.sum(1) / m.sum(1).clamp(min=1.0)
    kept = (advantages.to(wd) >= 0) | (kl <= kl_threshold)
    weights = torch.exp(log_rho).clamp(max=cap) * m * kept.to(wd)[:, None]
    return weights.to(old_logprobs.dtype), kl.to(old_logprobs.dtype), kept
