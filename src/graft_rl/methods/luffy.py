"""LUFFY-style off-policy guidance (Appendix B): GRAFT's selection and replacement, but peer
responses enter through LUFFY's shaped importance weight ``f(x) = x / (x + gamma)`` (behaviour
probability 1, no clipping) instead of the compatibility gate: the ``luffy`` loss
(:mod:`graft_rl.methods.losses`, key ``luffy_gamma``) with ``weighting: none``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from graft_rl import algo
from graft_rl.errors import removed_names
from graft_rl.methods.base import Method, register_method
from graft_rl.methods.config import check_range
from graft_rl.methods.losses import LossContext, register_loss

__all__ = ["LUFFY", "luffy"]


@dataclass
class LuffyParams:
    luffy_gamma: float = 0.1  # gamma of LUFFY's policy shaping f(x) = x / (x + gamma)


@register_loss(
    "luffy",
    weighted=False,
    Params=LuffyParams,
    check=lambda cfg: check_range(cfg, {"luffy_gamma": (0.0, math.inf, False)}),
    corrects=True,
)
def luffy(lp, old, mask, ctx: LossContext):
    """LUFFY (Appendix B): own tokens the clipped surrogate, peer tokens the shaped, unclipped one
    ``f(x) = x / (x + gamma)`` (:func:`graft_rl.algo.luffy_policy_loss`). A correction weighs the own
    tokens' term only (peer tokens carry weight 1)."""
    c = ctx.cfg
    loss, stats = algo.luffy_policy_loss(
        lp, old, ctx.adv, mask, ctx.is_peer, c.luffy_gamma, c.eps_low, c.eps_high, token_weights=ctx.correction
    )
    # own tokens: the clipped surrogate; peer tokens are never clipped
    own = algo.clipped_token_mask(lp, old, ctx.adv, mask, None, c.eps_low, c.eps_high)
    stats["clipped"] = own & ~ctx.is_peer.bool().unsqueeze(1)
    return loss, stats


@register_method("luffy")
class LUFFY(Method):
    preset = {**Method.preset, "weighting": "none", "loss": "luffy"}
    source = "LUFFY-style guidance as the GRAFT paper specifies it (Appendix B)"


__getattr__ = removed_names(
    __name__,
    {
        "LuffyObjective": "removed in 0.1.0 (methods are presets of parts): loss luffy with weighting none",
    },
)
