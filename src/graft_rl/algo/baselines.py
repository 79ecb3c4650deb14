"""Building blocks of the paper's baselines and ablations (Appendix B and Appendix G).

Each is a small pure function next to the GRAFT core, named after its paper definition.
The trainer's method objects combine them; nothing here knows about models or data.
"""

from __future__ import annotations

import torch

from graft_rl.algo.core import (
    MAX_LOG_RATIO,
    _out_dtype,
    _per_token,
    _work_dtype,
    grpo_advantages,
    mean_token_logprob,
)

__all__ = [
    "dr_grpo_advantages",
    "rloo_advantages",
    "gspo_policy_loss",
    "pooled_advantages",
    "success_only_mask",
    "count_matched_random_prompts",
    "random_admission_weight",
    "luffy_shaping",
    "luffy_policy_loss",
    "sgt_eligible",
    "sgt_select",
    "sgt_nll",
    "hacpo_peer_clip_lower",
    "hacpo_capability_ratio",
    "hacpo_advantages",
    "hacpo_policy_loss",
    "dynamic_sampling_mask",
    "reference_kl",
    "sequence_reference_kl",
]


# --------------------------------------------------------------------------- other estimators
def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    r"""Dr. GRPO's advantage (Liu et al., 2025, Eq. 3): the group mean subtracted, no division by its std.

    .. math:: \hat a_i = r_i - \mathrm{mean}(\mathcal R(q))

    Args:
        rewards: ``[G, n]``.
    Returns:
        ``[G, n]``, in ``rewards``' dtype.

    Examples:
        >>> dr_grpo_advantages(torch.tensor([[1., 0., 0., 0.], [1., 1., 1., 1.]]))
        tensor([[ 0.7500, -0.2500, -0.2500, -0.2500],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    if rewards.dim() != 2:
        raise ValueError(f"dr_grpo_advantages: rewards must be [G, n], got {tuple(rewards.shape)}")
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    r"""RLOO's leave-one-out advantage (Kool et al., 2019; Ahmadian et al., 2024, Eq. 7): each response's
    baseline is the mean reward of the *other* responses of its group.

    .. math:: \hat a_i = r_i - \frac{1}{n-1}\sum_{j \ne i} r_j = \frac{n}{n-1}\,(r_i - \mathrm{mean}(\mathcal R(q)))

    A group of one response has no other to compare with: advantage 0.

    Args:
        rewards: ``[G, n]``.
    Returns:
        ``[G, n]``, in ``rewards``' dtype (float32 for integer or bool input).

    Examples:
        >>> rloo_advantages(torch.tensor([[1., 0., 0., 0.], [1., 1., 0., 0.]]))
        tensor([[ 1.0000, -0.3333, -0.3333, -0.3333],
                [ 0.6667,  0.6667, -0.6667, -0.6667]])
    """
    if rewards.dim() != 2:
        raise ValueError(f"rloo_advantages: rewards must be [G, n], got {tuple(rewards.shape)}")
    r = rewards.to(_work_dtype(rewards))
    n = r.shape[1]
    if n <= 1:
        return torch.zeros_like(r, dtype=_out_dtype(rewards))
    others = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return (r - others).to(_out_dtype(rewards))


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""GSPO's sequence-level clipped objective (Zheng et al., 2025, "Group Sequence Policy Optimization", Eqs. 5-7).

    .. math:: s_i = \exp\Big(\frac{1}{|o_i|}\sum_t \log\frac{\pi_\theta(o_{i,t}|\cdot)}{\pi_{old}(o_{i,t}|\cdot)}\Big),\quad
              \mathcal L = -\frac{1}{M}\sum_i w_i \min\big(s_i \hat a_i,\ \mathrm{clip}(s_i, 1-\epsilon_{low}, 1+\epsilon_{high})\,\hat a_i\big)

    The length-normalised sequence ratio, one clip per response, and a mean over responses
    (sequence-mean); its clip range is GSPO's (3e-4 / 4e-4), two orders of magnitude below PPO's.
    GRAFT's ``ratio: sequence`` ablation (:func:`~graft_rl.algo.policy_loss`) uses the same ratio
    but keeps the token mean over the minibatch and GRAFT's token clip range. Responses without
    tokens in ``mask`` are left out of the mean. ``weights``: a per-response factor (GRAFT's gate), or
    per token ``[M, T]`` (the gate times a correction's weight of each token): then each response's term
    is GSPO-token's (GSPO Eq. 10), the mean over its tokens of ``w_t`` times the surrogate of
    :math:`s_{i,t} = \mathrm{sg}(s_i)\,\pi_\theta(y_t)/\mathrm{sg}(\pi_\theta(y_t))` (value :math:`s_i`, the
    gradient of token t alone), as verl's ``compute_policy_loss_gspo`` multiplies its ``pg_losses`` by
    ``rollout_is_weights`` before its ``seq-mean-token-mean``: a token weighted 0 gets no gradient.

    Args:
        logprobs: ``[M, T]`` current log-probs.
        old_logprobs: ``[M, T]`` log-probs before the step's first update.
        advantages: ``[M]``.
        mask: ``[M, T]`` response-token mask.
        weights: ``[M]``, ``[M, T]`` or None.

    Returns:
        ``(loss, stats)``; stats: ``clip_frac`` (responses clipped), ``ratio_mean``, ``clipped_seq``
        (``[M]`` bool).

    Examples:
        >>> lp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25]]))
        >>> loss, st = gspo_policy_loss(lp, lp, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
        >>> float(loss), float(st["clip_frac"])
        (0.0, 0.0)
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError("gspo_policy_loss: logprobs, old_logprobs and mask must all be [M, T]")
    M = logprobs.shape[0]
    if advantages.shape != (M,) or (weights is not None and weights.shape not in ((M,), logprobs.shape)):
        raise ValueError(f"gspo_policy_loss: advantages must be [M]={M}, weights [M] or [M, T]")
    wd = _work_dtype(logprobs)
    m = mask.to(wd)
    tokens = m.sum(dim=1)
    valid = tokens > 0
    log_ratio = ((logprobs.to(wd) - old_logprobs.detach().to(wd)) * m).sum(dim=1) / tokens.clamp_min(1.0)
    s = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    a = advantages.detach().to(wd)
    if weights is not None and weights.dim() == 2:  # GSPO-token: each token's term times its own weight
        s_tok = _sequence_ratio_per_token(s, log_ratio, logprobs.to(wd))
        per_tok = -torch.minimum(s_tok * a[:, None], s_tok.clamp(1 - eps_low, 1 + eps_high) * a[:, None])
        per_seq = (per_tok * weights.detach().to(wd) * m).sum(dim=1) / tokens.clamp_min(1.0)
    else:
        per_seq = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
    if weights is not None and weights.dim() == 1:
        per_seq = per_seq * weights.detach().to(wd)
    per_seq = torch.where(valid, per_seq, torch.zeros_like(per_seq))
    loss = per_seq.sum() / valid.sum().clamp_min(1)
    with torch.no_grad():
        clipped = ((s < 1 - eps_low) | (s > 1 + eps_high)) & valid
        v = valid.to(wd)
        stats = {
            "clip_frac": clipped.to(wd).sum().div(v.sum().clamp_min(1)).float(),
            "ratio_mean": (s * v).sum().div(v.sum().clamp_min(1)).float(),
            "clipped_seq": clipped,
        }
    return loss.to(logprobs.dtype), stats


def _sequence_ratio_per_token(s: torch.Tensor, log_ratio: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    r"""``[M, T]``: a sequence ratio ``s`` ``[M]`` (``exp`` of the clamped ``log_ratio``, ``[M]``) as one factor per
    token, :math:`\mathrm{sg}(s)\,e^{\ell_t - \mathrm{sg}(\ell_t)}` (GSPO-token, Eq. 10): its value is ``s`` on
    every token, and each token carries the gradient of its own log-prob ``\ell_t`` times ``s / |o|`` once
    averaged over the response, so a per-token weight can scale one token's gradient. A ratio clamped
    at :data:`MAX_LOG_RATIO` carries no gradient, as its sequence form does."""
    inside = (log_ratio.abs() < MAX_LOG_RATIO).to(logprobs.dtype)[:, None]
    return s.detach()[:, None] * torch.exp((logprobs - logprobs.detach()) * inside)


# --------------------------------------------------------------------------- pooled groups
def pooled_advantages(
    rewards_recv: torch.Tensor, rewards_src: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GRPO advantages over the pooled group (Appendix G, "Pooled groups").

    .. math:: \mathcal G_{pool}(q) = \mathcal G_B(q) \| \mathcal G_A(q),\quad
              \hat a_i = \frac{r_i - \mathrm{mean}(\mathcal G_{pool})}{\mathrm{std}(\mathcal G_{pool}) + \epsilon_{adv}}

    Unbiased std over the ``n_recv + n_src`` pooled rewards (docs/fidelity.md).

    Args:
        rewards_recv: ``[G, n]`` receiver rewards. rewards_src: ``[G, n']`` source rewards.

    Returns:
        ``(adv_recv [G, n], adv_src [G, n'])``.

    Examples:
        >>> pooled_advantages(torch.tensor([[0., 0.]]), torch.tensor([[1., 0.]]))
        (tensor([[-0.5000, -0.5000]]), tensor([[ 1.5000, -0.5000]]))
    """
    if rewards_recv.dim() != 2 or rewards_src.dim() != 2 or rewards_recv.shape[0] != rewards_src.shape[0]:
        raise ValueError(
            "pooled_advantages: rewards must be [G, n] and [G, n'] with the same G, got "
            f"{tuple(rewards_recv.shape)} and {tuple(rewards_src.shape)}"
        )
    n = rewards_recv.shape[1]
    wd = _work_dtype(rewards_recv)
    pooled = torch.cat([rewards_recv.to(wd), rewards_src.to(wd)], dim=1)
    adv = grpo_advantages(pooled, eps).to(_out_dtype(rewards_recv))
    return adv[:, :n], adv[:, n:]


# --------------------------------------------------------------------------- success-only
def success_only_mask(mask: torch.Tensor, rewards: torch.Tensor, is_peer: torch.Tensor) -> torch.Tensor:
    r"""Token mask for success-only transfer (Appendix G, "Success-only transfer").

    Unsuccessful *peer* responses are removed from both the policy-gradient numerator and
    the token-mean denominator by zeroing their mask rows; their source advantages were
    computed on the full peer group before filtering, so the caller keeps those. Own
    responses are untouched.

    Args:
        mask: ``[M, T]``; rewards: ``[M]`` (success means ``reward > 0``); is_peer: ``[M]`` bool.

    Examples:
        >>> success_only_mask(torch.ones(3, 2), torch.tensor([1., 0., 0.]), torch.tensor([True, True, False]))
        tensor([[1., 1.],
                [0., 0.],
                [1., 1.]])
    """
    if mask.dim() != 2 or rewards.shape != (mask.shape[0],) or is_peer.shape != (mask.shape[0],):
        raise ValueError("success_only_mask: expected mask [M, T], rewards [M], is_peer [M]")
    drop = is_peer.to(torch.bool) & ~(rewards > 0)
    return mask * (~drop).to(mask.dtype).unsqueeze(1)


# --------------------------------------------------------------------------- count-matched random
def count_matched_random_prompts(
    a_to_b: torch.Tensor, b_to_a: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Count-matched random prompt selection (Appendix G, "Count-matched random selection").

    GRAFT's rule fixes how many prompts move in each direction; this control instead picks
    the same number of prompts uniformly from the whole prompt batch, irrespective of either
    model's rewards. Each direction is drawn independently.

    Args:
        a_to_b: ``[G]`` bool mask chosen by :func:`~graft_rl.algo.balanced_exchange`, A to B.
        b_to_a: ``[G]`` the same, B to A.

    Returns:
        ``(rand_a_to_b, rand_b_to_a)`` bool masks with the same counts.
    """
    out = []
    for sel in (a_to_b, b_to_a):
        if sel.dim() != 1:
            raise ValueError(f"count_matched_random_prompts: masks must be [G], got {tuple(sel.shape)}")
        count = int(sel.sum().item())
        picked = torch.randperm(sel.shape[0], generator=generator)[:count].to(sel.device)
        new = torch.zeros_like(sel, dtype=torch.bool)
        new[picked] = True
        out.append(new)
    return out[0], out[1]


def random_admission_weight(
    score: torch.Tensor, delta: float = 0.8, generator: torch.Generator | None = None
) -> torch.Tensor:
    r"""Count-matched random admission (Appendix G).

    .. math:: w_{random}(o) = \mathbf 1[o \in \mathcal A_{rand}] \min\{s(o\mid q), 1\}

    :math:`\mathcal A_{rand}` holds as many responses as the gate ``s > delta`` would admit
    among these (one direction's transferred responses), chosen uniformly at random.

    Args:
        score: ``[M]`` compatibility scores of one direction's transferred responses.

    Returns:
        ``[M]`` weights.
    """
    if score.dim() != 1:
        raise ValueError(f"random_admission_weight: score must be [M], got {tuple(score.shape)}")
    s = score.detach()
    count = int((s > delta).sum().item())
    picked = torch.randperm(s.shape[0], generator=generator)[:count].to(s.device)
    admitted = torch.zeros_like(s, dtype=torch.bool)
    admitted[picked] = True
    capped = torch.nan_to_num(s, nan=0.0).clamp(0.0, 1.0)
    return torch.where(admitted, capped, torch.zeros_like(capped))


# --------------------------------------------------------------------------- LUFFY-style
def luffy_shaping(prob: torch.Tensor, gamma: float = 0.1) -> torch.Tensor:
    r"""LUFFY's regularised importance-sampling shaping :math:`f(x) = x / (x + \gamma)` (Appendix G).

    Examples:
        >>> luffy_shaping(torch.tensor([0.0, 0.1, 0.9]))
        tensor([0.0000, 0.5000, 0.9000])
    """
    return prob / (prob + gamma)


def luffy_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_peer: torch.Tensor,
    gamma: float = 0.1,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""LUFFY-style peer updates (Appendix G, "LUFFY-style peer updates").

    Peer tokens contribute :math:`f(\pi_\theta(o_t\mid q,o_{<t}))\,\hat a` with
    :math:`f(x)=x/(x+\gamma)`: behaviour probability 1, no clipping, no compatibility
    weight. Own tokens use the standard clipped surrogate. One token-mean over all response
    tokens of the minibatch, as in :func:`~graft_rl.algo.policy_loss`.

    Args:
        logprobs: ``[M, T]`` current log-probs.
        old_logprobs: ``[M, T]`` log-probs before the step's first update.
        advantages: ``[M]`` or ``[M, T]``.
        mask: ``[M, T]`` response-token mask.
        is_peer: ``[M]`` bool, True for a peer (off-policy) response.
        token_weights: ``[M, T]`` factors of each token's term (a correction's weights of own tokens), or None.

    Returns:
        ``(loss, stats)`` with ``clip_frac`` over own tokens, ``peer_shaping_mean`` over peer tokens.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError("luffy_policy_loss: logprobs, old_logprobs and mask must all be [M, T]")
    if is_peer.shape != (logprobs.shape[0],):
        raise ValueError(f"luffy_policy_loss: is_peer must be [M]={logprobs.shape[0]}, got {tuple(is_peer.shape)}")
    wd = _work_dtype(logprobs)
    m = mask.to(wd)
    lp = logprobs.to(wd)
    a = _per_token(advantages.detach().to(wd), m, "advantages")
    log_ratio = (lp - old_logprobs.detach().to(wd)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    rho = torch.exp(log_ratio)
    surr, surr_clipped = rho * a, rho.clamp(1 - eps_low, 1 + eps_high) * a
    own_obj = torch.minimum(surr, surr_clipped)
    shaped = luffy_shaping(torch.exp(lp), gamma)
    peer = is_peer.to(torch.bool).unsqueeze(1).expand_as(m)
    objective = torch.where(peer, shaped * a, own_obj)
    if token_weights is not None:
        objective = objective * _per_token(token_weights.detach().to(wd), m, "token_weights")
    loss = -(objective * m).sum() / m.sum().clamp_min(1.0)
    with torch.no_grad():
        own_m = m * (~peer).to(wd)
        peer_m = m * peer.to(wd)
        stats = {
            "clip_frac": ((surr_clipped < surr).to(wd) * own_m).sum().div(own_m.sum().clamp_min(1)).float(),
            "peer_shaping_mean": (shaped * peer_m).sum().div(peer_m.sum().clamp_min(1)).float(),
            "num_tokens": m.sum().float(),
        }
    return loss.to(logprobs.dtype), stats


# --------------------------------------------------------------------------- SGT
def sgt_eligible(k_recv: torch.Tensor, k_peer: torch.Tensor) -> torch.Tensor:
    r"""SGT's prompt rule (Appendix B): the receiver has no correct rollout and the peer has
    at least one, :math:`k_B(q)=0 \wedge k_A(q)\ge 1` (no upper bound, unlike GRAFT).

    Examples:
        >>> sgt_eligible(torch.tensor([0, 0, 1]), torch.tensor([8, 0, 3]))
        tensor([ True, False, False])
    """
    return (k_recv == 0) & (k_peer >= 1)


def sgt_select(
    peer_rewards: torch.Tensor, selected: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    r"""Uniformly sample one correct peer response per selected prompt (Appendix B, SGT).

    Vectorised: each correct response gets an i.i.d. uniform key, failures get -1, and the
    arg-max per row is a uniform choice among the correct ones.

    Args:
        peer_rewards: ``[G, n]`` the peer's rewards. selected: ``[G]`` bool prompts to use.

    Returns:
        ``[G]`` int64 index into the peer group, ``-1`` where no response is taken
        (not selected, or the peer has no success).
    """
    if peer_rewards.dim() != 2 or selected.shape != (peer_rewards.shape[0],):
        raise ValueError("sgt_select: expected peer_rewards [G, n] and selected [G]")
    ok = peer_rewards > 0
    keys = torch.rand(peer_rewards.shape, generator=generator).to(peer_rewards.device)
    keys = torch.where(ok, keys, torch.full_like(keys, -1.0))
    idx = keys.argmax(dim=1)
    take = selected.to(torch.bool) & ok.any(dim=1)
    return torch.where(take, idx, torch.full_like(idx, -1))


def sgt_nll(logprobs: torch.Tensor, mask: torch.Tensor, coef: float = 0.1) -> torch.Tensor:
    r"""SGT's auxiliary supervised term, :math:`\lambda \cdot \mathrm{NLL}` (Appendix B, :math:`\lambda=0.1`).

    Token-mean negative log-likelihood of the sampled correct peer responses under the
    receiver's own tokenisation, added to the GRPO loss. An empty batch gives 0 (with the
    graph kept, so ``backward`` is always safe).

    Examples:
        >>> sgt_nll(torch.tensor([[-1.0, -3.0]]), torch.ones(1, 2))
        tensor(0.2000)
    """
    if logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError("sgt_nll: logprobs and mask must both be [M, T]")
    wd = _work_dtype(logprobs)
    m = mask.to(wd)
    nll = -(logprobs.to(wd) * m).sum() / m.sum().clamp_min(1.0)
    return (coef * nll).to(logprobs.dtype)


# --------------------------------------------------------------------------- HACPO
def hacpo_peer_clip_lower(update_index: int, start: float = 0.8, increment: float = 0.025) -> float:
    """HACPO's rising lower clip bound for peer rollouts: ``min(1, start + increment * m)`` (Appendix B).

    ``m`` is the index of the minibatch update *within the current training step*; it restarts at 0
    every step. This is what HACPO's released recipe does (``zzx-peter/HACRL-code``,
    ``recipe/hacpo/hacpo_core_algos.py``: ``HacpoLossConfig.cross_clip_lower(minibatch_update_index)``
    with ``cross_clip_delta`` 0.2 and ``cross_clip_step`` 0.025 in ``config/hacpo_trainer.yaml``; the
    index comes from ``MinibatchUpdateCounter`` in ``hacpo_workers.py``, reset for each new update).
    Indexing by the global step would pin the bound at 1 from step 8 on and silence peer rollouts.

    Examples:
        >>> hacpo_peer_clip_lower(0), hacpo_peer_clip_lower(3)
        (0.8, 0.875)
    """
    if update_index < 0:
        raise ValueError(f"hacpo_peer_clip_lower: update_index must be >= 0, got {update_index}")
    return min(1.0, start + increment * update_index)


def hacpo_capability_ratio(
    capability_src: float, capability_recv: float, ratio_min: float = 0.1, ratio_max: float = 10.0
) -> float:
    r"""HACPO's capability ratio :math:`P_{src}/P_{recv}`, bounded to ``[ratio_min, ratio_max]``.

    Capabilities are the models' recent success rates (the trainer keeps a rolling window).
    Used as the peer-loss multiplier; its inverse :math:`P_{recv}/P_{src}` weights peer
    rewards in the capability-aware baseline (:func:`hacpo_advantages`).
    """
    if not (capability_src > 0 and capability_recv > 0):
        raise ValueError("hacpo_capability_ratio: capabilities must be > 0")
    return min(max(capability_src / capability_recv, ratio_min), ratio_max)


def hacpo_advantages(
    rewards_self: torch.Tensor,
    rewards_peer: torch.Tensor,
    capability_self: float,
    capability_peer: float,
    eps: float = 1e-6,
    ratio_min: float = 0.1,
    ratio_max: float = 10.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""HACPO's capability-aware advantage over the pooled group (Appendix B; HACPO Eqs. 5-6).

    Each pooled reward is weighted by :math:`\omega = \mathrm{clip}(P_{self}/P_{src}, 0.1, 10)`
    (1 for own rollouts; the recipe's ``1 / CapabilityTracker.ratio(source, target)`` with
    ``ratio_min`` 0.1, ``ratio_max`` 10) in the baseline :math:`b = \mathrm{mean}_i(\omega_i r_i)`; a group whose rewards are all
    equal uses the plain mean (weights must not create a signal), and a baseline above 1
    (impossible for binary rewards) falls back to the learner's own mean. The scale is the
    unbiased std of the pooled rewards plus ``eps``.

    Returns:
        ``(adv_self [G, n], adv_peer [G, n'])``.
    """
    if rewards_self.dim() != 2 or rewards_peer.dim() != 2 or rewards_self.shape[0] != rewards_peer.shape[0]:
        raise ValueError("hacpo_advantages: rewards must be [G, n] and [G, n'] with the same G")
    if not (capability_self > 0 and capability_peer > 0):
        raise ValueError("hacpo_advantages: capabilities must be > 0")
    wd = _work_dtype(rewards_self)
    rs, rp = rewards_self.to(wd), rewards_peer.to(wd)
    n = rs.shape[1]
    pooled = torch.cat([rs, rp], dim=1)
    omega = min(max(capability_self / capability_peer, ratio_min), ratio_max)
    weighted = torch.cat([rs, rp * omega], dim=1).mean(dim=1, keepdim=True)
    uniform = (pooled == pooled[:, :1]).all(dim=1, keepdim=True)
    baseline = torch.where(uniform, pooled.mean(dim=1, keepdim=True), weighted)
    baseline = torch.where(baseline > 1.0, rs.mean(dim=1, keepdim=True), baseline)
    std = pooled.std(dim=1, keepdim=True, correction=1) if pooled.shape[1] > 1 else torch.zeros_like(baseline)
    adv = ((pooled - baseline) / (std + eps)).to(_out_dtype(rewards_self))
    return adv[:, :n], adv[:, n:]


def hacpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    src_mean_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_peer: torch.Tensor,
    update_index: int,
    capability_ratio: torch.Tensor | float = 1.0,
    self_clip_low: float = 3e-4,
    self_clip_high: float = 4e-4,
    peer_clip_start: float = 0.8,
    peer_clip_increment: float = 0.025,
    alpha: float = 1.0,
    max_abs_log_ratio: float = 10.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""HACPO's sequence-level clipped objective (Appendix B, as in HACPO's released recipe).

    Sequence ratio :math:`r_j = \exp(\bar\ell(\pi_\theta, o_j) - \bar\ell_{ref,j})`: for own
    rollouts the reference is the mean old log-prob; for peer rollouts the source's mean
    generation log-prob (``src_mean_logprob``). Own: PPO clip with the tiny deltas
    ``[1-3e-4, 1+4e-4]``. Peer: :math:`\bar r = \mathrm{clip}(r, \ell_{step}, 1)` with the
    rising lower bound :func:`hacpo_peer_clip_lower`, objective
    :math:`\bar r \cdot \mathrm{sg}(\bar r)^\alpha \cdot \kappa \cdot \hat a` with
    capability ratio :math:`\kappa`. Loss = minus the mean over responses (sequence-mean). The log
    ratio is clamped to ``±max_abs_log_ratio`` (10, the recipe's ``max_abs_log_ratio``), as in
    ``compute_hacpo_loss`` of ``recipe/hacpo/hacpo_core_algos.py``.

    Args:
        logprobs: ``[M, T]`` current log-probs.
        old_logprobs: ``[M, T]`` log-probs before the step's first update.
        mask: ``[M, T]`` response-token mask.
        src_mean_logprob: ``[M]`` the source's mean generation log-prob of each response.
        advantages: ``[M]``.
        is_peer: ``[M]`` bool, True for a peer response.
        update_index: minibatch update within the step (:func:`hacpo_peer_clip_lower`);
        capability_ratio: scalar or ``[M]``;
        weights: ``[M]`` factors of each response's term, or ``[M, T]`` factors of each token's (a
            correction's weight of own tokens, 1 on peer tokens): then each response's term is the mean over
            its tokens of ``w_t`` times the term of its ratio as one factor per token (value ``r``, the gradient
            of token t alone; as GSPO-token and verl's ``pg_losses * rollout_is_weights``), so a token
            weighted 0 gets no gradient; or None.

    Stats: ``clip_frac`` (own responses clipped), the peer bound and clipped fractions, and
    ``clipped_seq`` (``[M]`` bool: the response's sequence ratio was clipped, own or peer) so the
    trainer can log self/peer clipped-token fractions as it does for GRAFT.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError("hacpo_policy_loss: logprobs, old_logprobs and mask must all be [M, T]")
    M = logprobs.shape[0]
    for name, t in (("src_mean_logprob", src_mean_logprob), ("advantages", advantages), ("is_peer", is_peer)):
        if t.shape != (M,):
            raise ValueError(f"hacpo_policy_loss: {name} must be [M]={M}, got {tuple(t.shape)}")
    wd = _work_dtype(logprobs)
    cur = mean_token_logprob(logprobs.to(wd), mask)
    old = mean_token_logprob(old_logprobs.detach().to(wd), mask)
    peer = is_peer.to(torch.bool)
    ref = torch.where(peer, src_mean_logprob.detach().to(wd), old)
    log_r = cur - ref
    r = torch.exp(log_r.clamp(-max_abs_log_ratio, max_abs_log_ratio))
    a = advantages.detach().to(wd)
    lower = hacpo_peer_clip_lower(update_index, peer_clip_start, peer_clip_increment)
    kappa = torch.as_tensor(capability_ratio, dtype=wd, device=logprobs.device)

    def terms(r: torch.Tensor, a: torch.Tensor, kappa: torch.Tensor, peer: torch.Tensor) -> torch.Tensor:
        own_obj = torch.minimum(r * a, r.clamp(1 - self_clip_low, 1 + self_clip_high) * a)
        r_peer = r.clamp(lower, 1.0)
        return torch.where(peer, r_peer * r_peer.detach().pow(alpha) * kappa * a, own_obj)

    if weights is not None and weights.dim() == 2:  # each token's term times its own weight
        m = mask.to(wd)
        some = torch.isfinite(log_r)  # an empty response has no ratio (and no token to weight)
        inside = ((log_r.abs() < max_abs_log_ratio) & some).to(wd)[:, None]
        lp = logprobs.to(wd)
        r_tok = torch.where(some, r, torch.ones_like(r)).detach()[:, None] * torch.exp((lp - lp.detach()) * inside)
        k = kappa[:, None] if kappa.dim() == 1 else kappa
        per_tok = terms(r_tok, a[:, None], k, peer[:, None]) * weights.detach().to(wd)
        objective = (per_tok * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
    else:
        objective = terms(r, a, kappa, peer)
    if weights is not None and weights.dim() == 1:
        objective = objective * weights.detach().to(wd)
    valid = torch.isfinite(cur)  # empty responses contribute nothing
    objective = torch.where(valid, objective, torch.zeros_like(objective))
    loss = -objective.sum() / valid.sum().clamp_min(1)
    with torch.no_grad():
        own_v, peer_v = (~peer & valid).to(wd), (peer & valid).to(wd)
        own_clipped = ((r < 1 - self_clip_low) | (r > 1 + self_clip_high)).to(wd)
        stats = {
            "clip_frac": (own_clipped * own_v).sum().div(own_v.sum().clamp_min(1)).float(),
            "peer_clip_frac_low": ((r < lower).to(wd) * peer_v).sum().div(peer_v.sum().clamp_min(1)).float(),
            "peer_clip_frac_high": ((r > 1.0).to(wd) * peer_v).sum().div(peer_v.sum().clamp_min(1)).float(),
            "peer_clip_lower": torch.tensor(lower, dtype=torch.float32),
            "clipped_seq": torch.where(peer, (r < lower) | (r > 1.0), own_clipped.bool()) & valid,
        }
    return loss.to(logprobs.dtype), stats


# --------------------------------------------------------------------------- DAPO
def dynamic_sampling_mask(rewards: torch.Tensor) -> torch.Tensor:
    r"""DAPO's dynamic-sampling group filter: keep groups whose rewards vary (Appendix B).

    For binary rewards this is :math:`0 < k < n`; in general, not all rewards equal.

    Examples:
        >>> dynamic_sampling_mask(torch.tensor([[1., 0.], [1., 1.], [0., 0.]]))
        tensor([ True, False, False])
    """
    if rewards.dim() != 2:
        raise ValueError(f"dynamic_sampling_mask: rewards must be [G, n], got {tuple(rewards.shape)}")
    return ~(rewards == rewards[:, :1]).all(dim=1)


# --------------------------------------------------------------------------- KL to a reference
def sequence_reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Per-response token-mean ``low_var_kl`` to a frozen reference, ``[M]`` (HACPO's KL loss).

    verl's ``low_var_kl`` (``kl_penalty_forward`` in ``verl/trainer/ppo/core_algos.py``), which
    HACPO's recipe uses with ``loss_agg_mode: seq-mean-token-mean``: the log ratio
    :math:`r = \log\pi_{ref} - \log\pi_\theta` clamped to ±20, :math:`k_3 = e^{r} - r - 1`
    clamped to ±10, then the mean over each response's tokens. A response without tokens gives 0.
    The caller sums over responses and divides by the minibatch's responses (the recipe's
    ``global_batch_size``).
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"sequence_reference_kl: shapes differ: logprobs {tuple(logprobs.shape)}, "
            f"ref {tuple(ref_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    r = (ref_logprobs.detach().to(logprobs.dtype) - logprobs).clamp(-20.0, 20.0)
    k3 = (torch.exp(r) - r - 1).clamp(-10.0, 10.0)
    m = mask.to(logprobs.dtype)
    return (k3 * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Token-mean KL penalty to a frozen reference policy (k3 estimator; DeepSeek GRPO, HACPO's KL loss).

    .. math::
        \mathrm{KL} = \frac{1}{\sum m}\sum_{i,t} m_{i,t}\,\big(e^{r_{i,t}} - r_{i,t} - 1\big),
        \qquad r_{i,t} = \log \pi_{ref}(y_t) - \log \pi_\theta(y_t)

    Non-negative, unbiased for :math:`\mathrm{KL}(\pi_\theta \,\|\, \pi_{ref})` on samples from
    :math:`\pi_\theta`, zero where the two agree; the gradient flows through ``logprobs`` only.
    ``r`` is clamped to :data:`~graft_rl.algo.core.MAX_LOG_RATIO` before ``exp``. An all-zero mask gives 0.

    Examples:
        >>> lp = torch.tensor([[-1.0, -2.0]]); ref = torch.tensor([[-1.0, -1.0]])
        >>> round(float(reference_kl(lp, ref, torch.ones(1, 2))), 4)  # (0 + e - 1 - 1) / 2
        0.3591
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"reference_kl: shapes differ: logprobs {tuple(logprobs.shape)}, ref {tuple(ref_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    r = (ref_logprobs.detach().to(logprobs.dtype) - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    m = mask.to(logprobs.dtype)
    return ((torch.exp(r) - r - 1) * m).sum() / m.sum().clamp(min=1)
