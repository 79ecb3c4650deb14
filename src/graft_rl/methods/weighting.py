"""Weightings (``method.weighting``): how a receiver turns the compatibility *s* of a peer response
into its weight in the loss (paper Section 4.2), on the receiver's worker. Own responses keep 1.

- ``gate``: GRAFT's compatibility gate, :func:`graft_rl.algo.compatibility_weight` (Eq. 8), with the
  Table 2 / Appendix G switches ``gate: false``, ``floor: false``, ``admission: random``;
- ``none``: every peer response counts fully (LUFFY, HACPO correct off-policy data in their loss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graft_rl import algo
from graft_rl.methods.registry import WEIGHTINGS

__all__ = ["gate", "no_weighting", "register_weighting"]


def register_weighting(name: str, **attrs) -> Callable:
    """Decorator: make ``fn(compatibility [M], cfg, gen) -> weight [M]`` (compatibility scores of one source's peer
    responses -> their weights; own responses keep 1) available as ``method.weighting: NAME``. Declared:
    ``score="sequence_ratio"``: it is given each response's sequence density ratio instead
    (:class:`~graft_rl.methods.registry.WeightingPart`)."""
    return WEIGHTINGS.register(name, **attrs)


@register_weighting("gate")
def gate(compatibility: torch.Tensor, cfg, gen) -> torch.Tensor:
    """GRAFT's compatibility gate (Section 4.2, :func:`graft_rl.algo.compatibility_weight`) with its
    Table 2 / Appendix G switches: ``gate: false`` (w = 1), ``floor: false``, ``admission: random``."""
    if not cfg.gate:
        return torch.ones_like(compatibility)  # "w/o compatibility gate": w = 1
    if cfg.admission == "random":
        return algo.random_admission_weight(compatibility, cfg.delta, gen)
    return algo.compatibility_weight(compatibility, cfg.delta, floor=cfg.floor)


@register_weighting("none")
def no_weighting(compatibility: torch.Tensor, cfg, gen) -> torch.Tensor:
    """Every peer response counts fully: for losses with their own off-policy correction (LUFFY, HACPO)."""
    return torch.ones_like(compatibility)
