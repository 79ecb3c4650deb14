"""The built-in default run of ``graft train`` (no config file): a CPU demo on two tiny models."""

from __future__ import annotations

from pathlib import Path

from graft_rl.config import TrainConfig, load_config

__all__ = ["default_config", "cache_dir"]


def cache_dir() -> Path:
    import os

    return Path(os.environ.get("GRAFT_RL_CACHE", Path.home() / ".cache" / "graft_rl"))


def default_config(overrides: list[str] | None = None) -> TrainConfig:
    """Two tiny heterogeneous models (built once, cached) co-trained with GRAFT on procedural arithmetic."""
    from graft_rl.testbed import ensure_testbed

    tb = ensure_testbed(cache_dir() / "testbed")
    base = tb.train_config()
    return load_config(base, overrides or [])
