"""Seeds derived from integers (docs/design.md, layer 1): every random draw of a run comes from
``derive_seed(run seed, purpose, step, policy, ...)``, never from global RNG state, so a resumed
run reproduces an uninterrupted one."""

from __future__ import annotations

__all__ = ["derive_seed", "rank_seed"]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix-style), stable across runs and platforms."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x ^= (p + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2)) & 0xFFFFFFFFFFFFFFFF
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return x & 0x7FFFFFFFFFFFFFFF


def rank_seed(seed: int, rank: int, world: int) -> int:
    """The sampling seed of one rank's share of a generation call: ``seed`` itself in one process,
    a seed of the rank's own when ``world > 1`` (so the ranks' samples are independent)."""
    return seed if world == 1 else derive_seed(seed, rank)
