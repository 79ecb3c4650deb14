"""Policy losses (``method.loss``) and auxiliary losses (``method.aux_loss``): one function each.

A loss is ``fn(lp, old, mask, ctx) -> (loss, stats)`` over one forward pass's rows: ``loss`` its mean over
the pass's ``mask`` tokens (or responses, ``response_mean``), which the objective turns into the pass's share
of the minibatch's mean in one place (:meth:`~graft_rl.methods.objectives.Objective.contribution`); ``stats``
its own sums ``X_total`` and maxima ``X_peak`` (a plain entry is a per-pass mean, which no step metric
may average: it is not logged), plus ``clipped`` / ``trained`` (below). ``lp``/``old`` the
current and pi_old log-probs ``[m, T]``, ``mask`` the policy-gradient tokens, ``ctx`` a
:class:`LossContext` (per-row advantage, compatibility weight, whether the row is a peer's, the
source's mean log-prob, method numbers such as HACPO's ``kappa``, the update index). It declares:

- ``aggregation``: ``token_mean`` (its loss is the mean over ``mask``'s tokens; the objective
  weighs each micro-batch by its share of the minibatch's tokens) or ``response_mean`` (the mean over
  responses; rows without tokens are left out, each micro-batch weighed by its share of responses);
- ``kl``: how ``kl_coef`` x the KL to the initial policy is added: ``token_mean`` (k3, token mean over
  the minibatch) or ``own_response_mean`` (HACPO's recipe: per own response, mean over responses);
- ``loss_mask`` (optional): tokens left out of the loss, e.g. HACPO's final EOS;
- ``Params`` (optional): its own ``method.KEY`` keys; ``check`` (optional): bounds them.

- ``clips`` (default True): whether it clips. Each loss reports what it clipped: ``clipped`` in its
  stats, a bool ``[m, T]`` (the tokens it clipped) or ``[m]`` (whole responses, e.g. GSPO's sequence
  ratio; all their tokens count as clipped). The objective only adds these up for the self/peer
  clipped-token fractions of the paper's Table 9, over the tokens the loss trains (weight non-zero).
  A loss declared ``clips=False`` reports 0; one that clips but returns no ``clipped`` has no such
  diagnostics (none is computed on its behalf). ``clipped_seq`` is read as ``clipped`` ``[m]`` (its
  name before 0.x; deprecated).
- ``corrects`` (default False): it multiplies each token's term by ``ctx.correction`` (a
  ``method.correction``'s weight of each own token, :mod:`graft_rl.methods.corrections`), a per-response
  loss too (its term written per token, as GSPO-token: verl's ``pg_losses * rollout_is_weights``), so a
  token weighted 0 gets exactly no gradient; a loss that does not is refused with a correction other
  than ``none``.
- ``peer_tokens`` (default False): it reads peer responses as their source sampled them, in its token
  ids with its per-token log-probs (``ctx.mu``), instead of re-tokenised text (F-TIS); the run checks
  that every policy has one vocabulary.

An auxiliary loss is ``fn(lp, aux_mask, cfg) -> loss``: the token mean over auxiliary targets' tokens
(SGT's NLL), added with the minibatch's token-mean weighting. The equations are in :mod:`graft_rl.algo`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from graft_rl import algo
from graft_rl.methods.config import MethodConfig, check_range
from graft_rl.methods.registry import AUX_LOSSES, LOSSES

__all__ = ["LossContext", "register_aux_loss", "register_loss"]


@dataclass
class LossContext:
    """Per-row inputs of a loss (``[m]`` each, on the log-probs' device) and the minibatch's place in the step."""

    cfg: MethodConfig
    adv: torch.Tensor
    weight: torch.Tensor
    is_peer: torch.Tensor
    src_mean: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0
    update_index: int = 0
    # the correction's weight of each token [m, T] (1 on peer tokens), or None: method.correction none
    correction: torch.Tensor | None = None
    # a loss with peer_tokens: each row's sampler log-probs of its tokens [m, T] (log mu; own rows and peer
    # rows kept in their source's token ids), 0 where unknown; None for any other loss
    mu: torch.Tensor | None = None

    def rows(self, keep: torch.Tensor) -> LossContext:
        """The same context for the rows ``keep`` selects (``[m]`` bool or indices)."""
        return replace(
            self,
            adv=self.adv[keep],
            weight=self.weight[keep],
            is_peer=self.is_peer[keep],
            src_mean=self.src_mean[keep],
            extras={k: v[keep] for k, v in self.extras.items()},
            correction=None if self.correction is None else self.correction[keep],
            mu=None if self.mu is None else self.mu[keep],
        )

    def token_weight(self) -> torch.Tensor:
        """The compatibility weight, ``[m]``; times the correction's token weights, ``[m, T]``, with one."""
        return self.weight if self.correction is None else self.weight[:, None] * self.correction

    def response_correction(self, mask: torch.Tensor) -> torch.Tensor | None:
        """``[m]``: each response's mean correction weight over its ``mask`` tokens (1 without tokens); None
        without one. Not for a loss's gradient: scaling a response by its mean weight gives a token the
        correction weights 0 the gradient of its response's other tokens; a per-response loss multiplies
        each token's term by ``correction`` itself (``gspo``, ``hacpo``; verl's ``pg_losses *
        rollout_is_weights``). Kept for plugins that log it."""
        if self.correction is None:
            return None
        m = mask.to(self.correction.dtype)
        tokens = m.sum(dim=1)
        mean = (self.correction * m).sum(dim=1) / tokens.clamp_min(1.0)
        return torch.where(tokens > 0, mean, torch.ones_like(mean))


def register_loss(
    name: str,
    aggregation: str = "token_mean",
    kl: str = "token_mean",
    weighted: bool = True,
    loss_mask=None,
    Params=None,
    check=None,
    clips: bool = True,
    corrects: bool = False,
    peer_tokens: bool = False,
) -> Callable:
    """Decorator: make ``fn(lp, old, mask, ctx) -> (loss, stats)`` available as ``method.loss: NAME``.
    ``weighted``: it applies ``ctx.weight`` (the compatibility weighting); a loss that does not must be
    used with ``method.weighting: none``. ``clips``: it clips, and says what in ``stats["clipped"]``.
    ``corrects``: it applies ``ctx.correction`` (see the module docstring). ``peer_tokens``: peer rows keep
    their source's token ids and carry its per-token log-probs in ``ctx.mu`` (one shared vocabulary)."""
    return LOSSES.register(
        name,
        aggregation=aggregation,
        kl=kl,
        weighted=weighted,
        loss_mask=loss_mask,
        Params=Params,
        check=check,
        clips=clips,
        corrects=corrects,
        peer_tokens=peer_tokens,
    )


def register_aux_loss(name: str, Params=None, check=None) -> Callable:
    """Decorator: make ``fn(lp, aux_mask, cfg) -> loss`` available as ``method.aux_loss: NAME``."""
    return AUX_LOSSES.register(name, Params=Params, check=check)


# --------------------------------------------------------------------------- the paper's
@register_loss("token_mean_clip", corrects=True)
def token_mean_clip(lp, old, mask, ctx: LossContext):
    """GRPO/GRAFT's loss (Section 4.2): the token-clipped, compatibility-weighted surrogate, token mean
    (:func:`graft_rl.algo.policy_loss`); ``ratio: sequence`` is the paper's sequence-ratio ablation. A
    correction's weight multiplies each own token's term (as verl's ``pg_losses * rollout_is_weights``)."""
    c = ctx.cfg
    ratio: Literal["token", "sequence"] = "sequence" if c.ratio == "sequence" else "token"
    w = ctx.token_weight()
    loss, stats = algo.policy_loss(lp, old, ctx.adv, mask, w, c.eps_low, c.eps_high, ratio)
    stats["clipped"] = algo.clipped_token_mask(lp, old, ctx.adv, mask, w, c.eps_low, c.eps_high, ratio)
    return loss, stats


# --------------------------------------------------------------------------- GSPO
@dataclass
class GSPOParams:
    gspo_clip_low: float = 3e-4  # GSPO's sequence-ratio clip: [1 - low, 1 + high] (its paper's 3e-4 / 4e-4)
    gspo_clip_high: float = 4e-4  # upper side of GSPO's clip


def _check_gspo(cfg) -> None:
    check_range(cfg, {"gspo_clip_low": (0.0, 1.0, True), "gspo_clip_high": (0.0, math.inf, True)})


@register_loss("gspo", aggregation="response_mean", Params=GSPOParams, check=_check_gspo, corrects=True)
def gspo(lp, old, mask, ctx: LossContext):
    """GSPO (Zheng et al., 2025): length-normalised sequence ratio, one clip per response with its own
    range, mean over responses (:func:`graft_rl.algo.gspo_policy_loss`). The compatibility weight scales
    each peer response's term, as in GRAFT's token loss. A correction's weight multiplies each own
    token's term (GSPO-token's per-token form, whose value is the sequence ratio's), as verl's
    ``compute_policy_loss_gspo`` multiplies ``pg_losses`` by ``rollout_is_weights``: a token the
    correction weights 0 gets no gradient (docs/design.md, "Engine and trainer")."""
    c = ctx.cfg
    w = ctx.token_weight()  # [m] without a correction, [m, T] with one
    loss, stats = algo.gspo_policy_loss(lp, old, ctx.adv, mask, w, c.gspo_clip_low, c.gspo_clip_high)
    stats["clipped"] = stats.pop("clipped_seq")  # whole responses
    return loss, stats


# --------------------------------------------------------------------------- auxiliary losses
@register_aux_loss("none")
def no_aux_loss(lp, aux_mask, cfg):
    """No auxiliary term."""
    return None
