"""Named phases of a step and their wall time (docs/design.md, layer 5), as verl's ``marked_timer``:
every timed span of the engine goes through one :class:`PhaseTimer`, so a phase's metric is always
``time_<phase>`` and its seconds are summed over every span of that phase.

Examples:
    >>> timer = PhaseTimer()
    >>> with timer("logprobs"):
    ...     pass
    >>> sorted(timer.metrics())
    ['time_logprobs']
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Wall seconds per named phase, summed over its spans (``with timer("update"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        """Seconds of ``phase`` measured elsewhere (a worker's generation, timed where it ran)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        """``{"time_<phase>": seconds}`` for every phase timed (the metric lines' names)."""
        return {f"time_{phase}": s for phase, s in self.seconds.items()}
