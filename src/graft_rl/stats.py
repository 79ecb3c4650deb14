"""Step statistics, right by construction (docs/metrics.md, "How a step's numbers are formed").

Every number a receiver's update measures is a **sum**, a **count** (a sum of ones) or a **maximum**,
held in one :class:`StepStats` and reduced one way: micro-batch -> minibatch -> update -> the ranks
of a sharded policy -> the step. A fraction or a mean (a clip fraction, ``mismatch_kl``, ``kl_ref``)
is formed once, at the end, as the step's sum of its numerators over the step's sum of its
denominators (:meth:`StepStats.ratio`). So no metric depends on how the step's tokens were cut into
micro-batches or dealt over ranks, a cut that does not change training.

Sums over a step's updates are exact (``math.fsum``, correctly rounded whatever their order); sums over
a pass's micro-batches and over ranks are plain float64 additions (equal to rounding).

Examples:
    >>> a = StepStats({"clipped": 3.0, "tokens": 10.0}); b = StepStats({"clipped": 0.0, "tokens": 20.0})
    >>> StepStats.total([a, b]).ratio("clipped", "tokens")  # (3 + 0) / (10 + 20), not (0.3 + 0) / 2
    0.1
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """``sums``: sums and counts by name; ``peaks``: maxima by name. Nothing else: a mean is never stored."""

    sums: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        """Add ``value`` to the sum (or count) ``name``."""
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def peak(self, name: str, value: float) -> None:
        """Raise the maximum ``name`` to ``value`` if it is larger."""
        v = float(value)
        self.peaks[name] = max(self.peaks[name], v) if name in self.peaks else v

    def merge(self, other: StepStats) -> StepStats:
        """Add ``other`` into this one (sums add, maxima take the larger); returns ``self``."""
        for k, v in other.sums.items():
            self.add(k, v)
        for k, v in other.peaks.items():
            self.peak(k, v)
        return self

    @classmethod
    def total(cls, parts: Iterable[StepStats]) -> StepStats:
        """The step's statistics from its updates': each sum exact (``math.fsum``), each maximum the largest."""
        parts = list(parts)
        out = cls()
        for k in dict.fromkeys(k for p in parts for k in p.sums):
            out.sums[k] = math.fsum(p.sums[k] for p in parts if k in p.sums)
        for k in dict.fromkeys(k for p in parts for k in p.peaks):
            out.peaks[k] = max(p.peaks[k] for p in parts if k in p.peaks)
        return out

    def get(self, name: str, default: float = 0.0) -> float:
        return self.sums.get(name, default)

    def ratio(self, numerator: str, denominator: str) -> float | None:
        """``sum(numerator) / sum(denominator)`` over everything merged here; None where the denominator is 0."""
        den = self.sums.get(denominator, 0.0)
        return self.sums.get(numerator, 0.0) / den if den > 0 else None

    @classmethod
    def from_loss_stats(cls, stats: dict) -> StepStats:
        """A loss part's own numbers: ``X_total`` entries are sums ``X``, ``X_peak`` entries maxima ``X``
        (docs/contributing.md); any other entry is a per-pass mean, which no step metric may average, so
        it is not kept."""
        out = cls()
        for k, v in stats.items():
            if k.endswith("_total"):
                out.add(k.removesuffix("_total"), float(v))
            elif k.endswith("_peak"):
                out.peak(k.removesuffix("_peak"), float(v))
        return out
