"""The built-in default run of ``graft train`` (no config file): a CPU demo on two tiny models."""

from __future__ import annotations

from graft_rl.engine.config import TrainConfig, load_config
from graft_rl.policy.zoo import cache_dir

__all__ = ["default_config", "cache_dir"]


def default_config(overrides: list[str] | None = None) -> TrainConfig:
    """The shipped capability-transfer testbed pair (two tiny heterogeneous models, each missing a
    prompt family the other has; :mod:`graft_rl.testbed`) co-trained with GRAFT on procedural
    arithmetic; nothing is built or downloaded."""
    from graft_rl.testbed import shipped_testbed

    return load_config(shipped_testbed("transfer").train_config(), overrides or [])
