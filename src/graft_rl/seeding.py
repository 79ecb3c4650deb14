"""Seeds derived from integers (docs/design.md, layer 1): every random draw of a run comes from
``derive_seed(run seed, purpose, step, policy, ...)``, never from global RNG state, so a resumed
run reproduces an uninterrupted one."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Purpose", "derive_seed", "rank_seed"]


class Purpose(IntEnum):
    """What a run's seed is derived for: ``derive_seed(run seed, Purpose.X, step, policy index, ...)``.
    The values are the integers runs have always used (changing one changes every run's draws)."""

    EPOCH_ORDER = 1  # the order of the training prompts in an epoch (per epoch)
    GENERATE = 2  # a policy's rollouts of a step
    REFILL_ORDER = 3  # dynamic sampling: the order of the prompts drawn to refill a step
    REFILL_GENERATE = 4  # dynamic sampling: the rollouts of a refill batch
    UPDATE = 5  # a receiver's update: random admission, uniform peer position (graft probe reproduces it)
    EXCHANGE = 6  # the exchange's draws: count-matched random prompts, SGT's target (graft probe too)
    VALIDATION = 7  # a policy's validation samples
    PROMPT_STREAM = 8  # rollout.prompts own: the order of one policy's training prompts in an epoch
    SWARM = 9  # an unpaired exchange's draws (SAPO: which external data points a receiver takes)


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
