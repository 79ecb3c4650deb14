"""Errors every layer may raise (layer 0: imports nothing of the package)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the key or value at fault."""
