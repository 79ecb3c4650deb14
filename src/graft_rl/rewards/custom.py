"""A user's reward function, called inside a verifier worker (see :mod:`graft_rl.rewards.pool`).

The worker calls :func:`user_score` once per response, so the pool's per-answer timeout, batch
budget and crash isolation hold for a user's function exactly as for the built-in checks.
``target`` is ``module:function``, ``path/to/file.py:function``, or ``pickle:FILE`` (a callable
given through the Python API, pickled by value with cloudpickle).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["ContractError", "PICKLE_PREFIX", "load_target", "user_score", "check_scores"]

_CACHE: dict[str, Callable] = {}

#: The prefix of an error message that breaks the reward contract (wrong count, not a number): a bug
#: in the function, never a property of one response. The trainer stops on it with one line.
CONTRACT = "reward contract"


class ContractError(TypeError):
    """A reward function that returned something other than one finite number per response."""

    def __init__(self, message: str):
        super().__init__(f"{CONTRACT}: {message}")


#: A reward target that is a pickled callable the trainer wrote for its verifier workers.
PICKLE_PREFIX = "pickle:"


def _private_payload(path: Path) -> bytes:
    """The bytes of a pickled callable, only from where :func:`graft_rl.rewards.functions._payload_target`
    writes them: a folder this user owns that nobody else can enter or write (mode 0700), a file this
    user owns, named by the sha256 of its content. Anything else is refused: unpickling runs code."""
    import hashlib
    import os
    import stat

    folder = path.parent
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{folder}: not a private folder of this user (owner {st.st_uid}, mode {oct(st.st_mode)})"
        )
    fst = path.lstat()
    if not stat.S_ISREG(fst.st_mode) or fst.st_uid != os.getuid():
        raise PermissionError(f"{path}: not a regular file of this user")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest()[:24] != path.stem:
        raise PermissionError(f"{path}: its content is not what was written (sha256 differs from its name)")
    return data


def load_target(target: str) -> Callable:
    """The callable a reward target names (imported once per process)."""
    if target in _CACHE:
        return _CACHE[target]
    if target.startswith(PICKLE_PREFIX):
        fn = pickle.loads(_private_payload(Path(target.removeprefix(PICKLE_PREFIX))))  # cloudpickle's output
    else:
        mod_name, _, attr = target.rpartition(":")
        if mod_name.endswith(".py"):
            path = Path(mod_name).expanduser().resolve()
            spec = importlib.util.spec_from_file_location(f"graft_reward_{abs(hash(str(path)))}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
        fn = module
        for part in attr.split("."):
            fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{target} is not callable")
    _CACHE[target] = fn
    return fn


def check_scores(out, count: int) -> list[float]:
    """``out`` as ``count`` finite floats, or :class:`ContractError` saying what it is instead."""
    if isinstance(out, (int, float)) and not isinstance(out, bool) and count == 1:
        out = [out]  # a bare number for one response is accepted
    try:
        values = list(out)
    except TypeError:
        raise ContractError(f"returned {type(out).__name__}, not a list of {count} numbers") from None
    if len(values) != count:
        raise ContractError(f"returned {len(values)} scores for {count} response{'s' if count != 1 else ''}")
    scores = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ContractError(f"returned {type(v).__name__} {str(v)[:40]!r}, not a number") from None
        if not math.isfinite(x):
            raise ContractError(f"returned {x}, not a finite number")
        scores.append(x)
    return scores


def user_score(target: str, root: str, response: str, problem: dict) -> float:
    """``fn([response], [problem])[0]`` for the function ``target`` names, held to the contract.
    ``root``: the folder its module is imported from (a worker started before the caller's
    ``sys.path`` changed does not have it), or ``""``."""
    if root and root not in sys.path:
        sys.path.insert(0, root)
    return check_scores(load_target(target)([response], [problem]), 1)[0]
