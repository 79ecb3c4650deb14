"""Errors every layer may raise (layer 0: imports nothing of the package)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ConfigError", "MissingSourceError", "removed_names"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the key or value at fault."""


class MissingSourceError(ConfigError):
    """A source file a config names (a plugin, a reward's ``file.py``) is not there. ``path``: the file
    looked for, resolved; a resume turns this into a line with what the run recorded of it."""

    def __init__(self, message: str, path):
        super().__init__(message)
        self.path = path


#: the documentation site (mkdocs.yml's site_url, pyproject's Documentation URL); built from docs/
DOCS = "https://graft-rl.github.io/graft-rl/"

#: where a removed public name's user reads what to write instead
PORTING_GUIDE = f"{DOCS}porting/ (docs/porting.md in the source; CHANGELOG.md has every change by version)"


def removed_names(module: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for public names a version removed: importing one raises an
    ``ImportError`` that says when it went, what replaces it and where the porting guide is, instead of
    Python's bare "cannot import name". ``names``: removed name -> "removed in X: use Y"."""

    def __getattr__(name: str) -> object:
        if name in names:
            raise ImportError(f"{module}.{name} was {names[name]}; see the porting guide, {PORTING_GUIDE}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
