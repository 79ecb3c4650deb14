"""Rewards as plugins: ``data.reward: NAME | module:function | path/to/file.py:function`` (docs/tasks.md).

A reward function takes the responses and their problems and returns one float per response::

    def reward(responses: list[str], problems: list[dict]) -> list[float]: ...

Each problem is a dict of every column of its row (``id``, ``problem``, ``answer`` and whatever
else the dataset has). It runs in the verifier pool, one response per call, under the run's
per-answer timeout (``data.verify_timeout``), batch budget (``data.verify_budget``) and crash
isolation, like the built-in ``math``, ``gsm8k`` and ``gym`` verifiers: a call that hangs or kills its
worker scores 0 and is counted. A response succeeds (what GRAFT's selection counts) when its reward
is ``>= data.success_threshold`` (default 1.0: a binary reward's 1).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from graft_rl.errors import MissingSourceError
from graft_rl.rewards.custom import CONTRACT, PICKLE_PREFIX, load_target
from graft_rl.rewards.pool import Outcome, VerifierPool, VerifyStats
from graft_rl.rewards.verifiers import _finish, score_responses

__all__ = ["BUILTIN_REWARDS", "Reward", "RewardError", "register_reward", "resolve_reward", "registered_rewards"]

#: The built-in verifiers (binary): math-verify on the last box, one number, reasoning-gym's own scoring.
BUILTIN_REWARDS = ("math", "gsm8k", "gym")

_REGISTRY: dict[str, Callable] = {}


class RewardError(ValueError):
    """A reward that cannot be used, or that broke its contract; the message names it."""


class RewardFileMissing(RewardError, MissingSourceError):
    """``data.reward: file.py:function`` names a file that is not there."""

    def __init__(self, message: str, path):
        MissingSourceError.__init__(self, message, path)


def register_reward(name: str):
    """Register a reward function under ``name`` (then ``data.reward: NAME``); the module that defines
    it must be imported before the config is loaded::

        @register_reward("exact")
        def exact(responses, problems):
            return [float(r.strip() == p["answer"]) for r, p in zip(responses, problems)]
    """

    def deco(fn: Callable) -> Callable:
        if name in BUILTIN_REWARDS:
            raise RewardError(f"register_reward: {name!r} is a built-in reward")
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_rewards() -> list[str]:
    return [*BUILTIN_REWARDS, *sorted(_REGISTRY)]


_PRIVATE: dict[int, Path] = {}  # pid -> this process's private folder of pickled callables


def _private_folder() -> Path:
    """This process's folder for pickled callables: made by ``mkdtemp`` (mode 0700, a fresh random
    name, so no other user can have made it first or write into it), removed at exit."""
    folder = _PRIVATE.get(os.getpid())
    if folder is None or not folder.is_dir():
        folder = Path(tempfile.mkdtemp(prefix="graft_rl_rewards_"))
        _PRIVATE[os.getpid()] = folder
        atexit.register(shutil.rmtree, folder, True)
    return folder


def _payload_target(payload: bytes) -> str:
    """A pickled callable as a file the verifier workers load (named by its sha256, written atomically,
    in :func:`_private_folder`; :func:`~graft_rl.rewards.custom.load_target` checks all three)."""
    folder = _private_folder()
    path = folder / f"{hashlib.sha256(payload).hexdigest()[:24]}.pkl"
    if not path.is_file():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(payload)
        os.replace(tmp, path)
    return f"{PICKLE_PREFIX}{path}"


@dataclass(frozen=True)
class Reward:
    """A resolved reward: a built-in verifier, a function by import path, or a pickled callable.

    ``name`` is how messages and metrics name it; ``threshold`` makes a reward a success
    (``reward >= threshold``). Plain data, so it travels to Ray actors (a callable as its bytes)."""

    name: str
    target: str  # a built-in name, "module:function" or "file.py:function"; "" when payload holds it
    threshold: float = 1.0
    payload: bytes | None = field(default=None, repr=False)
    root: str = ""  # the folder a module target is imported from (sys.path entry), for the workers
    source_sha256: str | None = None  # a Python function's: sha256 of its code (what a resume compares)

    @property
    def builtin(self) -> bool:
        return self.target in BUILTIN_REWARDS

    def successes(self, scores: Sequence[float]) -> list[bool]:
        return [s >= self.threshold for s in scores]

    def _worker_target(self) -> str:
        return _payload_target(self.payload) if self.payload is not None else self.target

    def score(
        self,
        responses: Sequence[str],
        problems: Sequence[Mapping],
        timeout: float = 5.0,
        budget: float | None = None,
        pool: VerifierPool | None = None,
    ) -> tuple[list[float], VerifyStats]:
        """One reward per response (``problems[i]`` is response ``i``'s row as a dict) and the counts;
        raises :class:`RewardError` when a user function breaks its contract or fails on every response."""
        if len(responses) != len(problems):
            raise RewardError(f"reward {self.name}: got {len(responses)} responses but {len(problems)} problems")
        if self.builtin:
            return score_responses(
                responses,
                [p["answer"] for p in problems],
                self.target,
                [p.get("source") for p in problems],
                [p["id"] for p in problems],
                timeout,
                budget,
            )
        t0 = time.monotonic()
        stats = VerifyStats()
        outcomes: list[Outcome | None] = [None] * len(responses)
        target = self._worker_target()
        args = [(target, self.root, r, dict(p)) for r, p in zip(responses, problems, strict=True)]
        _finish(
            outcomes,
            list(range(len(args))),
            "graft_rl.rewards.custom:user_score",
            args,
            timeout,
            pool,
            stats,
            t0,
            budget,
        )
        self._refuse_broken(outcomes, problems, timeout)
        return [o.score for o in outcomes], stats  # type: ignore[union-attr]

    def _refuse_broken(self, outcomes: list, problems: Sequence[Mapping], timeout: float) -> None:
        for o, p in zip(outcomes, problems, strict=True):
            if o.status == "error" and o.detail.split(": ", 1)[-1].startswith(CONTRACT):
                raise RewardError(f"reward {self.name} on problem {p.get('id')!r}: {o.detail.split(': ', 1)[-1]}")
        if outcomes and all(o.status in ("error", "timeout", "crash") for o in outcomes):
            o, p = outcomes[0], problems[0]
            what = {
                "timeout": f"did not return within {timeout:g}s (data.verify_timeout)",
                "crash": "killed its worker",
            }
            raise RewardError(
                f"reward {self.name} failed on every response of the batch (first, problem {p.get('id')!r}: "
                f"{what.get(o.status, 'raised ' + o.detail)})"
            )

    def check(self, problem: Mapping, timeout: float = 5.0) -> None:
        """Call a user function once before training (the reference answer as the response), so that an
        import error, an exception or a broken contract is one line at start, not at step 1's end."""
        if not self.builtin:
            self.score([str(problem.get("answer", ""))], [problem], timeout)


def _import_path(fn: Callable) -> str | None:
    """``module:qualname`` when a worker process could import ``fn`` by name; else None."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        return None
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{mod}:{qual}" if obj is fn else None


def _from_callable(fn: Callable, threshold: float, name: str | None = None) -> Reward:
    path = _import_path(fn)
    label = name or getattr(fn, "__qualname__", type(fn).__name__)
    if path is not None:
        return Reward(name or path, path, threshold, root=_module_root(path))
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - a dependency
        raise RewardError(f"reward {label}: a callable defined in a notebook or script needs cloudpickle") from None
    try:
        payload = cloudpickle.dumps(fn)
    except Exception as exc:
        raise RewardError(
            f"reward {label}: cannot be sent to the verifier workers ({type(exc).__name__}: {exc})"
        ) from None
    return Reward(label, "", threshold, payload, source_sha256=_code_sha256(fn))


def _code_sha256(fn: Callable) -> str | None:
    """sha256 of a Python function's code: its bytecode, constants (nested functions' code too), names and
    arguments; not where it sits (file, line, column), so a call edited around a lambda keeps it."""
    code = getattr(fn, "__code__", None) or getattr(type(fn).__dict__.get("__call__"), "__code__", None)
    if code is None:
        return None
    h = hashlib.sha256()

    def add(c) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_argcount, c.co_kwonlyargcount)).encode())
        for k in c.co_consts:
            add(k) if hasattr(k, "co_code") else h.update(repr(k).encode())

    add(code)
    return h.hexdigest()


def resolve_reward(spec: str | Callable | Reward, threshold: float = 1.0) -> Reward:
    """``data.reward`` as a :class:`Reward`: a built-in or registered name, ``module:function``,
    ``path/to/file.py:function``, or a Python callable; one line naming what is wrong otherwise."""
    if isinstance(spec, Reward):
        return spec
    if callable(spec):
        return _from_callable(spec, threshold)
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"data.reward: expected a name or module:function, got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return Reward(spec, spec, threshold)
    if spec.startswith(PICKLE_PREFIX):  # only ever made by this process for a Python callable
        raise RewardError(
            f"data.reward {spec!r}: a pickled callable is not a reward a config can name (loading it could run "
            "any code); name a module:function or file.py:function"
        )
    if spec.startswith("python:"):  # recorded for a function given to Trainer(reward=...) that no import path names
        raise RewardError(
            f"data.reward {spec}: the run was scored by a Python function given to Trainer(reward=...); "
            "give it again (Trainer(cfg, resume=True, reward=FUNCTION)), or name an importable module:function"
        )
    if spec in _REGISTRY:
        return _from_callable(_REGISTRY[spec], threshold, name=spec)
    if ":" not in spec:
        raise RewardError(
            f"data.reward {spec!r}: not a reward name ({', '.join(registered_rewards())}) nor module:function"
        )
    mod = spec.rpartition(":")[0]
    if not mod.endswith(".py") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `graft train` finds a module in the working directory, as `python -m` does
    target = spec
    if mod.endswith(".py"):
        path = Path(mod).expanduser()
        if not path.is_file():
            raise RewardFileMissing(f"data.reward {spec!r}: {path.resolve()}: no such file", path.resolve())
        target = f"{path.resolve()}:{spec.rpartition(':')[2]}"
    try:
        load_target(target)
    except Exception as exc:
        raise RewardError(f"data.reward {spec!r}: cannot load it ({type(exc).__name__}: {exc})") from None
    return Reward(spec, target, threshold, root="" if mod.endswith(".py") else _module_root(target))


def _module_root(target: str) -> str:
    """The ``sys.path`` folder the module of ``module:function`` is found under ("" if not a plain file)."""
    mod = target.rpartition(":")[0]
    spec = importlib.util.find_spec(mod.split(".")[0])
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return ""
    origin = Path(spec.origin)
    return str(origin.parent.parent if spec.submodule_search_locations else origin.parent)
