"""Errors every layer may raise (layer 0: imports nothing of the package)."""

from __future__ import annotations

__all__ = ["ConfigError", "MissingSourceError"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the key or value at fault."""


class MissingSourceError(ConfigError):
    """A source file a config names (a plugin, a reward's ``file.py``) is not there. ``path``: the file
    looked for, resolved; a resume turns this into a line with what the run recorded of it."""

    def __init__(self, message: str, path):
        super().__init__(message)
        self.path = path
