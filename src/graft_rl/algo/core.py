"""GRAFT's equations (paper Sections 3-4; the choices the paper leaves open in docs/fidelity.md) as pure tensor functions.

Every function here is framework-free: torch only, no I/O, no model code, no Python
loop over responses. Shapes: ``G`` prompts, ``n`` rollouts per
prompt, ``M`` responses, ``T`` tokens. All functions accept CPU or GPU tensors of any
float dtype; arithmetic that needs precision (means, exponentials, sums over tokens) is
carried out in at least float32 and the result is returned in the input dtype.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "grpo_advantages",
    "complementary_mask",
    "balanced_exchange",
    "mean_token_logprob",
    "compatibility_score",
    "compatibility_weight",
    "policy_loss",
    "clipped_token_mask",
    "minibatch_order",
    "MAX_LOG_RATIO",
]

#: ``log rho`` is clamped to this magnitude before ``exp`` so that a token whose
#: probability collapsed cannot produce ``inf * 0 = nan`` in the surrogate.
#: ``exp(20) ~ 4.9e8`` is far outside any clip range, so the clipped objective is unchanged.
MAX_LOG_RATIO = 20.0


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype (bf16, fp16, int, bool) computes in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.float32


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    r"""Group-normalised GRPO advantages (paper Section 3, Preliminaries).

    .. math:: \hat a_i = \frac{r_i - \mathrm{mean}(\mathcal R(q))}{\mathrm{std}(\mathcal R(q)) + \epsilon_{adv}}

    ``std`` is the unbiased (Bessel-corrected) standard deviation, as in verl and TRL
    (docs/fidelity.md). A group of size 1 has no contrast and gets advantage 0; a group whose
    rewards are all equal gets 0 as well (numerator is 0).

    Args:
        rewards: ``[G, n]`` rewards of each prompt's rollout group (any real dtype).
        eps: the GRPO normalisation stabiliser :math:`\epsilon_{adv}` (Table 3: 1e-6).

    Returns:
        ``[G, n]`` advantages, same dtype as ``rewards`` (float32 for integer/bool input).

    Examples:
        >>> grpo_advantages(torch.tensor([[1., 0., 0., 0.], [1., 1., 1., 1.]]))
        tensor([[ 1.5000, -0.5000, -0.5000, -0.5000],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    if rewards.dim() != 2:
        raise ValueError(f"grpo_advantages: rewards must be [G, n], got shape {tuple(rewards.shape)}")
    r = rewards.to(_work_dtype(rewards))
    n = r.shape[1]
    if n <= 1:
        return torch.zeros_like(r, dtype=_out_dtype(rewards))
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=1)
    return ((r - mean) / (std + eps)).to(_out_dtype(rewards))


def complementary_mask(k_src: torch.Tensor, k_recv: torch.Tensor, n: int) -> torch.Tensor:
    r"""Complementary candidates for transfer source -> receiver (paper Eq. in Section 4.1).

    .. math:: \mathcal C_{A\to B} = \{q : k_B(q) = 0 \wedge 1 \le k_A(q) < n\}

    The receiver's whole group failed and the source's group is *mixed*: it has at least
    one success and at least one failure, so its own GRPO advantages carry a contrast.

    Args:
        k_src: ``[G]`` success counts of the source model's groups.
        k_recv: ``[G]`` success counts of the receiver model's groups.
        n: rollouts per prompt of the source (the group size).

    Returns:
        ``[G]`` bool mask of candidate prompts.

    Examples:
        >>> complementary_mask(torch.tensor([3, 0, 8, 1]), torch.tensor([0, 0, 0, 2]), n=8)
        tensor([ True, False, False, False])
    """
    if k_src.shape != k_recv.shape or k_src.dim() != 1:
        raise ValueError(
            f"complementary_mask: k_src and k_recv must both be [G], got {tuple(k_src.shape)} and {tuple(k_recv.shape)}"
        )
    return (k_recv == 0) & (k_src >= 1) & (k_src < n)


def _keep_top_m_with_ties(k_src: torch.Tensor, candidates: torch.Tensor, m: int) -> torch.Tensor:
    """Candidates whose ``k_src`` is >= the m-th largest ``k_src`` among candidates (ties kept)."""
    if m <= 0:
        return torch.zeros_like(candidates)
    # Non-candidates sort below every candidate; counts are small integers, so float is exact.
    ranked = torch.where(candidates, k_src.to(torch.float64), torch.full_like(k_src, -1, dtype=torch.float64))
    threshold = torch.topk(ranked, m, sorted=True).values[m - 1]
    return candidates & (k_src.to(torch.float64) >= threshold)


def balanced_exchange(
    k_a: torch.Tensor, k_b: torch.Tensor, n: int, balance: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Complementary group replacement with balanced exchange (paper Section 4.1).

    Candidates are :math:`\mathcal C_{A\to B}` and :math:`\mathcal C_{B\to A}`
    (:func:`complementary_mask`). With ``balance`` the common target is
    :math:`m = \min(|\mathcal C_{A\to B}|, |\mathcal C_{B\to A}|)`; in each direction the
    candidates are ranked by the *source's* success count, descending, and every candidate
    whose count is at least the m-th largest is kept, so all ties at the boundary stay
    (docs/fidelity.md). ``m = 0`` exchanges nothing in either direction. Without ``balance``
    every candidate is kept (the "w/o balancing" ablation, and stored-trajectory replay).

    Args:
        k_a: ``[G]`` success counts of model A's groups.
        k_b: ``[G]`` success counts of model B's groups.
        n: rollouts per prompt (same for both models).
        balance: apply balanced exchange.

    Returns:
        ``(a_to_b, b_to_a)``, ``[G]`` bool masks: ``a_to_b[q]`` means B's failed group for
        prompt ``q`` is replaced by A's group.

    Examples:
        >>> balanced_exchange(torch.tensor([3, 0, 5]), torch.tensor([0, 2, 0]), n=8)
        (tensor([False, False,  True]), tensor([False,  True, False]))
    """
    c_ab = complementary_mask(k_a, k_b, n)
    c_ba = complementary_mask(k_b, k_a, n)
    if not balance:
        return c_ab, c_ba
    m = int(torch.minimum(c_ab.sum(), c_ba.sum()).item())
    return _keep_top_m_with_ties(k_a, c_ab, m), _keep_top_m_with_ties(k_b, c_ba, m)


def mean_token_logprob(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Length-normalised sequence log-likelihood :math:`\bar\ell(\pi, o^M \mid q)` (Section 4.2).

    .. math:: \bar\ell(\pi, o^M\mid q) = \frac{1}{|o^M|}\sum_{t=1}^{|o^M|} \log\pi(o^M_t \mid q, o^M_{<t})

    A response with no unmasked token has no defined mean: it gets ``nan``, which
    :func:`compatibility_weight` maps to weight 0 (the response is gated out).

    Args:
        token_logprobs: ``[M, T]`` per-token log-probabilities (padding may hold anything finite).
        mask: ``[M, T]`` 1/True on response tokens, 0/False on padding.

    Returns:
        ``[M]`` mean log-probabilities, dtype of ``token_logprobs``.

    Examples:
        >>> mean_token_logprob(torch.tensor([[-1., -3., 0.], [-2., 0., 0.]]),
        ...                    torch.tensor([[1, 1, 0], [1, 0, 0]]))
        tensor([-2., -2.])
    """
    if token_logprobs.shape != mask.shape or token_logprobs.dim() != 2:
        raise ValueError(
            "mean_token_logprob: token_logprobs and mask must both be [M, T], "
            f"got {tuple(token_logprobs.shape)} and {tuple(mask.shape)}"
        )
    wd = _work_dtype(token_logprobs)
    m = mask.to(wd)
    total = (token_logprobs.to(wd) * m).sum(dim=1)
    count = m.sum(dim=1)
    out = torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("nan")))
    return out.to(token_logprobs.dtype)


def compatibility_score(recv_mean_logprob: torch.Tensor, src_mean_logprob: torch.Tensor) -> torch.Tensor:
    r"""Sequence-level compatibility of a peer response (paper Section 4.2, compatibility gate).

    .. math:: s(o\mid q) = \exp\big(\bar\ell(\pi_{\theta^B_{old}}, o^B\mid q) - \bar\ell(\pi_\phi, o^A\mid q)\big)

    ``recv_mean_logprob`` is the receiver's mean log-prob of its own re-tokenisation of the
    response text; ``src_mean_logprob`` the source's mean *generation* log-prob on its own
    tokens. Neither is differentiated through: the score is fixed for the step.

    Examples:
        >>> compatibility_score(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0]))
        tensor([1.0000, 0.3679])
    """
    if recv_mean_logprob.shape != src_mean_logprob.shape:
        raise ValueError(
            "compatibility_score: recv_mean_logprob and src_mean_logprob must have the same shape [M], "
            f"got {tuple(recv_mean_logprob.shape)} and {tuple(src_mean_logprob.shape)}"
        )
    wd = _work_dtype(recv_mean_logprob)
    diff = recv_mean_logprob.detach().to(wd) - src_mean_logprob.detach().to(wd)
    return torch.exp(diff).to(recv_mean_logprob.dtype)


def per_char_compatibility_score(
    recv_sum_logprob: torch.Tensor, src_sum_logprob: torch.Tensor, chars: torch.Tensor
) -> torch.Tensor:
    r"""Tokenisation-invariant compatibility (beyond the paper; ``method.compatibility: per_char``).

    .. math:: s_{char}(o\mid q) = \exp\big((\textstyle\sum_t \log\pi_B(o^B_t) - \sum_t \log\pi_A(o^A_t)) / |o|_{chars}\big)

    The token-mean score of :func:`compatibility_score` divides each side by its own token count,
    so a receiver whose tokenizer cuts the text into more (likelier) pieces looks more compatible;
    dividing both summed log-likelihoods of the same text by its character count does not.

    Args:
        recv_sum_logprob: ``[M]`` the receiver's summed log-probs of its own tokens of each text.
        src_sum_logprob: ``[M]`` the source's summed generation log-probs of its own tokens.
        chars: ``[M]`` characters of each response text (>= 1).

    Examples:
        >>> per_char_compatibility_score(torch.tensor([-4.0]), torch.tensor([-2.0]), torch.tensor([4.0]))
        tensor([0.6065])
    """
    if not recv_sum_logprob.shape == src_sum_logprob.shape == chars.shape:
        raise ValueError("per_char_compatibility_score: recv_sum_logprob, src_sum_logprob and chars must all be [M]")
    return torch.exp((recv_sum_logprob.detach() - src_sum_logprob.detach()) / chars)


def compatibility_weight(score: torch.Tensor, delta: float = 0.8, floor: bool = True) -> torch.Tensor:
    r"""Gated, capped compatibility weight (paper Section 4.2 and Appendix G).

    .. math:: w(o\mid q) = \mathbf 1[s(o\mid q) > \delta] \cdot \min\{s(o\mid q), 1\}

    The gate is strict: ``s == delta`` is rejected. ``floor=False`` is the "no floor"
    ablation, :math:`w = \min\{s, 1\}` for every response. A non-finite score (``nan``
    from an empty response) always gets weight 0; ``+inf`` is capped to 1.

    Examples:
        >>> compatibility_weight(torch.tensor([0.5, 0.8, 0.9, 1.7]))
        tensor([0.0000, 0.0000, 0.9000, 1.0000])
        >>> compatibility_weight(torch.tensor([0.5, 0.8, 0.9, 1.7]), floor=False)
        tensor([0.5000, 0.8000, 0.9000, 1.0000])
    """
    s = score.detach()
    capped = torch.nan_to_num(s, nan=0.0).clamp(min=0.0, max=1.0)
    if not floor:
        return capped
    return torch.where(s > delta, capped, torch.zeros_like(capped))


def _per_token(x: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """Broadcast a ``[M]`` per-response tensor to ``[M, T]``; pass ``[M, T]`` through."""
    if x.dim() == 1:
        if x.shape[0] != like.shape[0]:
            raise ValueError(f"policy_loss: {name} must be [M]={like.shape[0]} or [M, T], got {tuple(x.shape)}")
        return x.unsqueeze(1).expand_as(like)
    if x.shape != like.shape:
        raise ValueError(f"policy_loss: {name} must be [M] or [M, T]={tuple(like.shape)}, got {tuple(x.shape)}")
    return x


def _ratio_terms(logprobs, old_logprobs, advantages, mask, ratio):
    """``(work dtype, mask, log rho, rho, per-token advantages)`` of :func:`policy_loss`'s surrogate:
    token (or, ``ratio="sequence"``, per-response masked-mean) log-ratios, clamped before ``exp``."""
    wd = _work_dtype(logprobs)
    m = mask.to(wd)
    log_ratio = logprobs.to(wd) - old_logprobs.detach().to(wd)
    if ratio == "sequence":
        seq = (log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
        log_ratio = seq.unsqueeze(1).expand_as(m)
    rho = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    a = _per_token(advantages.detach().to(wd), m, "advantages")
    return wd, m, log_ratio, rho, a


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ratio: Literal["token", "sequence"] = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Compatibility-weighted, token-clipped surrogate (paper Section 4.2, objective J).

    .. math::
        \mathcal L = -\frac{1}{\sum_j |o_j|} \sum_j w_j \sum_t
        \min\big(\rho_{j,t}\hat a_j,\ \mathrm{clip}(\rho_{j,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})\hat a_j\big),
        \qquad \rho_{j,t} = \exp(\log\pi_\theta - \log\pi_{\theta_{old}})

    The denominator is the number of response tokens in the minibatch, *gated ones
    included* (docs/fidelity.md): a peer response with ``w = 0`` still dilutes the mean.
    Own responses carry ``w = 1`` (``weights=None`` means all ones). With
    ``ratio="sequence"`` (the Table 2 "token ratio" ablation) every token of response
    ``j`` uses :math:`\rho_j = \exp(\text{masked mean}_t(\log\pi_\theta - \log\pi_{old}))`.
    ``log rho`` is clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` for numerical safety.

    Args:
        logprobs: ``[M, T]`` current log-probs of the receiver's tokens (carries the gradient).
        old_logprobs: ``[M, T]`` receiver log-probs before the step's first update (no gradient).
        advantages: ``[M]`` or ``[M, T]`` advantages (source-computed for grafted responses).
        mask: ``[M, T]`` response-token mask.
        weights: ``[M]`` compatibility weights, or ``None`` for all ones; or ``[M, T]`` per-token weights
            (the compatibility weight times a correction's weight, :mod:`graft_rl.methods.corrections`).
        eps_low: lower clip range (Table 3: 0.2).
        eps_high: upper clip range (Table 3: 0.28).
        ratio: ``"token"`` (GRAFT) or ``"sequence"``.

    Returns:
        ``(loss, stats)``: scalar loss to minimise (dtype of ``logprobs``) and detached
        0-d float32 tensors, computed over response tokens whose weight is non-zero:
        ``clip_frac`` (tokens where the clipped term is active, i.e. strictly smaller),
        ``clip_frac_pos_adv`` / ``clip_frac_neg_adv`` (the same among tokens with
        positive / negative advantage; ratios above ``1+eps_high`` / below ``1-eps_low``),
        ``ratio_mean``, ``approx_kl`` (``mean 0.5 (log rho)^2``), ``num_tokens`` (the
        denominator) and ``num_active_tokens``.

    Examples:
        >>> lp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
        >>> loss, st = policy_loss(lp, lp, torch.tensor([1.0, -1.0]), torch.ones(2, 2),
        ...                        weights=torch.tensor([1.0, 0.5]))
        >>> loss  # -(1*(1+1) + 0.5*(-1-1)) / 4
        tensor(-0.2500)
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            "policy_loss: logprobs, old_logprobs and mask must all be [M, T], got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if ratio not in ("token", "sequence"):
        raise ValueError(f"policy_loss: ratio must be 'token' or 'sequence', got {ratio!r}")
    wd, m, log_ratio, rho, a = _ratio_terms(logprobs, old_logprobs, advantages, mask, ratio)
    surr = rho * a
    surr_clipped = rho.clamp(1.0 - eps_low, 1.0 + eps_high) * a
    objective = torch.minimum(surr, surr_clipped)
    w = (
        torch.ones_like(m)
        if weights is None
        else _per_token(weights.detach().to(wd), m, "weights")  # [M] per response, or [M, T] per token
    )
    num_tokens = m.sum()
    loss = -(objective * m * w).sum() / num_tokens.clamp_min(1.0)

    with torch.no_grad():
        active = m * (w != 0).to(wd)
        clipped = (surr_clipped < surr).to(wd) * active
        pos = active * (a > 0).to(wd)
        neg = active * (a < 0).to(wd)

        def frac(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
            return (num.sum() / den.sum().clamp_min(1.0)).float()

        stats = {
            "clip_frac": frac(clipped, active),
            "clip_frac_pos_adv": frac(clipped * pos, pos),
            "clip_frac_neg_adv": frac(clipped * neg, neg),
            "ratio_mean": frac(rho * active, active),
            "approx_kl": frac(0.5 * log_ratio.pow(2) * active, active),
            "num_tokens": num_tokens.float(),
            "num_active_tokens": active.sum().float(),
        }
    return loss.to(logprobs.dtype), stats


def clipped_token_mask(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ratio: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    r"""Bool ``[M, T]``: the tokens whose clipped term of :func:`policy_loss` is active (strictly smaller
    than the unclipped one), among response tokens whose weight is non-zero: the tokens behind its
    ``clip_frac``, for the self/peer clipping diagnostics of the paper's Table 9. No gradient.

    Examples:
        >>> lp = torch.log(torch.tensor([[0.9, 0.5]]))
        >>> old = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> clipped_token_mask(lp, old, torch.tensor([1.0]), torch.ones(1, 2))  # 1.8 > 1.28 clipped
        tensor([[ True, False]])
    """
    with torch.no_grad():
        _, _, _, rho, a = _ratio_terms(logprobs.detach(), old_logprobs, advantages, mask, ratio)
        clipped = rho.clamp(1.0 - eps_low, 1.0 + eps_high) * a < rho * a
        active = mask.bool()
        if weights is not None:  # [M] or [M, T], as policy_loss takes them
            active = active & (_per_token(weights.detach(), mask, "weights") != 0)
        return clipped & active


def minibatch_order(
    is_peer: torch.Tensor,
    minibatch_size: int,
    position: Literal["last", "first", "uniform"] = "last",
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    r"""Order a receiver's prompt groups into minibatches (paper Section 4.2, peer-last updates).

    ``last`` (GRAFT): own groups first, shuffled, then grafted groups, shuffled; cut into
    consecutive minibatches of ``minibatch_size`` prompts (the last one may be smaller).
    Every minibatch holding a grafted group therefore comes after every own-only one, so
    by the time peer tokens are seen the ratios have moved and token clipping can act.
    ``first`` puts the grafted groups first (Appendix G, "peer minibatch position").
    ``uniform`` shuffles all groups together, so grafted groups land in minibatches
    uniformly at random (our reading of Appendix G's "shuffles ... uniformly at random
    at every step"; it is the ordering a plain shuffled data loader gives).

    Args:
        is_peer: ``[G]`` bool, True for a grafted (peer) group.
        minibatch_size: prompts per minibatch (Table 3: 32).
        position: ``"last"``, ``"first"`` or ``"uniform"``.
        generator: optional ``torch.Generator`` (CPU) for reproducible shuffles.

    Returns:
        A list of 1-D ``int64`` index tensors (on ``is_peer``'s device) that partition
        ``range(G)``, in processing order.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> [b.tolist() for b in minibatch_order(torch.tensor([True, False, False, True, False]), 2, generator=g)]
        [[4, 1], [2, 3], [0]]
    """
    if is_peer.dim() != 1:
        raise ValueError(f"minibatch_order: is_peer must be [G], got shape {tuple(is_peer.shape)}")
    if minibatch_size < 1:
        raise ValueError(f"minibatch_order: minibatch_size must be >= 1, got {minibatch_size}")
    if position not in ("last", "first", "uniform"):
        raise ValueError(f"minibatch_order: position must be 'last', 'first' or 'uniform', got {position!r}")
    peer = is_peer.detach().to("cpu", torch.bool)
    g_total = peer.shape[0]
    if position == "uniform":
        order = torch.randperm(g_total, generator=generator)
    else:
        own_idx = torch.nonzero(~peer).flatten()
        peer_idx = torch.nonzero(peer).flatten()
        own_idx = own_idx[torch.randperm(own_idx.numel(), generator=generator)]
        peer_idx = peer_idx[torch.randperm(peer_idx.numel(), generator=generator)]
        order = torch.cat([own_idx, peer_idx] if position == "last" else [peer_idx, own_idx])
    return [chunk.to(is_peer.device) for chunk in torch.split(order, minibatch_size) if chunk.numel()]
