"""Advantage estimators (``method.advantage``): one function each, ``(rewards [G, n], ctx) -> advantages``.

``rewards`` are one policy's groups (the source's own, for GRAFT's source-computed advantages), or a
pooled group (the receiver's responses first, then the peer's: ``ctx.sources`` names each column's
policy). The equations are pure functions in :mod:`graft_rl.algo`, each with its doctest; an entry here
only picks its inputs from the context. Register your own with :func:`register_advantage`::

    @register_advantage("rloo")
    def rloo(rewards, ctx):
        return algo.rloo_advantages(rewards)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graft_rl import algo
from graft_rl.methods.config import MethodConfig
from graft_rl.methods.registry import ADVANTAGES

__all__ = ["CAPABILITY_FLOOR", "AdvantageContext", "register_advantage"]

#: HACPO's capability floor (``CapabilityTracker`` ``minimum`` in its recipe's hacpo_trainer.yaml)
CAPABILITY_FLOOR = 1e-8


@dataclass
class AdvantageContext:
    """What an estimator may read beside the rewards.

    ``policy``: whose responses the rows are (the receiver, for a pooled group); ``sources``: for a
    pooled group, the policy of each column (None: every column is ``policy``'s); ``cfg``: the method
    config (``adv_eps``, a part's own keys); ``capability``: each policy's recent success rate, for
    methods that track it (HACPO), else empty; ``state``: the method's other per-step state.
    """

    policy: str
    cfg: MethodConfig
    sources: list[str] | None = None
    capability: dict[str, float] = field(default_factory=dict)
    state: dict = field(default_factory=dict)

    @property
    def own_columns(self) -> int | None:
        """How many leading columns are ``policy``'s own (None: all of them)."""
        return None if self.sources is None else sum(1 for s in self.sources if s == self.policy)

    def capability_of(self, name: str) -> float:
        """A policy's capability, floored; 0.5 before it has one (the recipe's start)."""
        return max(self.capability.get(name, 0.5), CAPABILITY_FLOOR)


def register_advantage(name: str, **attrs) -> Callable:
    """Decorator: make ``fn(rewards [G, n], ctx: AdvantageContext) -> [G, n]`` available as
    ``method.advantage: NAME``. ``needs_pool=True``: it compares a receiver's group with a peer's,
    so only a composition that pools groups can use it."""
    return ADVANTAGES.register(name, **attrs)


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, ctx: AdvantageContext) -> torch.Tensor:
    """GRPO's group-normalised advantage (Section 3): :func:`graft_rl.algo.grpo_advantages`."""
    return algo.grpo_advantages(rewards, ctx.cfg.adv_eps)


@register_advantage("dr_grpo")
def dr_grpo(rewards: torch.Tensor, ctx: AdvantageContext) -> torch.Tensor:
    """Dr. GRPO's: the group mean subtracted, not divided by the std (:func:`graft_rl.algo.dr_grpo_advantages`)."""
    return algo.dr_grpo_advantages(rewards)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, ctx: AdvantageContext) -> torch.Tensor:
    """RLOO's leave-one-out baseline (:func:`graft_rl.algo.rloo_advantages`)."""
    return algo.rloo_advantages(rewards)
