"""LUFFY-style off-policy guidance (Appendix B): GRAFT's selection and replacement, but peer
responses enter through LUFFY's shaped importance weight ``f(x) = x / (x + gamma)`` (behaviour
probability 1, no clipping) instead of the compatibility gate."""

from __future__ import annotations

from dataclasses import dataclass

from graft_rl import algo
from graft_rl.methods.base import Method, check_range, register_method
from graft_rl.methods.exchange import NoWeighting
from graft_rl.methods.objectives import Objective

__all__ = ["LUFFY", "LuffyObjective"]


class LuffyObjective(Objective):
    """Own tokens: the clipped surrogate; peer tokens: the shaped, unclipped one (``luffy_policy_loss``)."""

    def rl_loss(self, lp, old, mask, t, rows, step):
        c = self.cfg
        return algo.luffy_policy_loss(
            lp,
            old,
            t.adv[rows].to(lp.device),
            mask,
            t.is_peer[rows].to(lp.device),
            c.luffy_gamma,
            c.eps_low,
            c.eps_high,
        )


@register_method("luffy")
class LUFFY(Method):
    @dataclass
    class Params:
        luffy_gamma: float = 0.1  # gamma of LUFFY's policy shaping f(x) = x / (x + gamma)

    @classmethod
    def check(cls, cfg) -> None:
        import math

        check_range(cfg, {"luffy_gamma": (0.0, math.inf, False)})

    def weighting(self):
        return NoWeighting(self.cfg)  # its own off-policy correction: every peer response counts fully

    def objective(self):
        return LuffyObjective(self.cfg)
