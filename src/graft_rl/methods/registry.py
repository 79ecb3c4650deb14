"""The registries a method is composed from, and the user's plugins that add to them (docs/design.md,
"Methods from parts").

A method is a preset of parts, each chosen by a key of ``method`` in the config and each found here
by name: ``advantage`` (:data:`ADVANTAGES`), ``selection`` (:data:`SELECTIONS`), ``composition``
(:data:`COMPOSITIONS`), ``weighting`` (:data:`WEIGHTINGS`), ``loss`` (:data:`LOSSES`), ``aux_loss``
(:data:`AUX_LOSSES`), ``correction`` (:data:`CORRECTIONS`, the engine-trainer gap of own rows), and
the method names themselves (:data:`METHODS`). A key is a registered
name, or ``module:NAME`` / ``path/to/file.py:NAME``: the module is imported (in this process; a Ray
actor imports it too) and ``NAME`` is the name it registered or an attribute of it.

``plugins: [module, path/to/file.py]`` at the top of a config imports each listed module first, so
that what it registers can be named as plainly as a shipped part (:func:`load_plugins`).

This module imports nothing else of graft-rl but its errors: every other module of ``methods``
imports it, and it imports none of them back.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from graft_rl.errors import ConfigError, MissingSourceError

__all__ = [
    "ADVANTAGES",
    "AdvantagePart",
    "CORRECTIONS",
    "CompositionPart",
    "CorrectionPart",
    "LossPart",
    "Part",
    "AUX_LOSSES",
    "COMPOSITIONS",
    "LOSSES",
    "METHODS",
    "PART_DEFAULTS",
    "PART_KEYS",
    "SELECTIONS",
    "WEIGHTINGS",
    "WeightingPart",
    "Registry",
    "import_plugin",
    "load_plugins",
    "normalise",
    "part_modules",
    "plugin_file",
    "plugin_sources",
]


@dataclass(frozen=True)
class Part:
    """A registered part: ``fn`` (a function, or a class whose instances do the work) and what it
    declares, each declaration a typed field whose default is written here once. Calling the part calls
    ``fn``. ``Params``: its own ``method.KEY`` keys (a dataclass); ``check``: bounds them."""

    name: str
    fn: Any
    Params: type | None = None
    check: Callable[[Any], None] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class AdvantagePart(Part):
    """``needs_pool``: it compares a receiver's group with a peer's (only a pooling composition can use
    it); ``needs_capability``: it reads each policy's capability (a method that tracks it)."""

    needs_pool: bool = False
    needs_capability: bool = False


@dataclass(frozen=True)
class CompositionPart(Part):
    """``pools``: its groups mix own and peer responses; ``aux``: it adds auxiliary targets (an
    ``aux_loss`` is needed); ``every_prompt``: it receives a peer group on every prompt; ``keeps_cut``: a
    peer response longer than the receiver's budget stays in the loss, cut; ``unpaired``: the contract
    of an exchange that does not pair groups by prompt (below)."""

    pools: bool = False
    aux: bool = False
    every_prompt: bool = False
    keeps_cut: bool = False
    #: it is not paired by prompt: ``fn(own groups, external groups, SwarmContext) -> [(rows, is_peer_group)]``
    #: builds the receiver's whole batch from its own groups and the other policies' groups of *their*
    #: prompts (SAPO); each policy may then draw its own prompts (``rollout.prompts: own``)
    unpaired: bool = False


@dataclass(frozen=True)
class LossPart(Part):
    """``aggregation``: ``token_mean`` or ``response_mean``; ``kl``: ``token_mean`` or
    ``own_response_mean``; ``weighted``: it applies the compatibility weight; ``loss_mask``: edits the
    tokens it trains (HACPO's final EOS); ``clips``: it clips, and says what (:mod:`~graft_rl.methods.losses`);
    ``corrects``: it applies a correction's per-token weights (``LossContext.correction``), so it can be
    combined with a ``method.correction`` other than ``none``; ``peer_tokens``: it trains peer responses
    in their source's token ids against the source's per-token log-probs (one shared vocabulary)."""

    aggregation: Literal["token_mean", "response_mean"] = "token_mean"
    kl: Literal["token_mean", "own_response_mean"] = "token_mean"
    weighted: bool = True
    loss_mask: Callable[..., None] | None = None
    clips: bool = True
    corrects: bool = False
    #: it reads a peer response as its source sampled it: the source's token ids and per-token log-probs
    #: (``LossContext.mu``), not re-tokenised text; only for policies of one vocabulary (F-TIS)
    peer_tokens: bool = False

    def __post_init__(self) -> None:
        if self.aggregation not in ("token_mean", "response_mean") or self.kl not in (
            "token_mean",
            "own_response_mean",
        ):
            raise ValueError(
                f"loss {self.name!r}: aggregation token_mean|response_mean, kl token_mean|own_response_mean"
            )


@dataclass(frozen=True)
class CorrectionPart(Part):
    """A correction of the gap between the engine that sampled a policy's own responses (mu) and the
    trainer's pi_old (:mod:`~graft_rl.methods.corrections`). ``level``: ``token`` (a weight per token)
    or ``sequence`` (one weight per response, from the product of its token ratios); ``bounds``:
    ``cfg -> (low, high)``, the ratios pi_old/mu it leaves as they are (the ``mismatch_out`` metric
    counts tokens outside them)."""

    level: Literal["token", "sequence"] = "token"
    bounds: Callable[[Any], tuple[float, float]] | None = None

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence"):
            raise ValueError(f"correction {self.name!r}: level token|sequence")


@dataclass(frozen=True)
class WeightingPart(Part):
    """A weighting: ``fn(score [M], cfg, gen) -> weight [M]`` of each peer response. ``score``: what it
    is given, ``compatibility`` (GRAFT's s, Section 4.2: per token or per character as
    ``method.compatibility`` says) or ``sequence_ratio`` (the density ratio of the whole response,
    ``exp(sum log pi_old - sum log mu_source)``: an importance weight, PRP's)."""

    score: Literal["compatibility", "sequence_ratio"] = "compatibility"

    def __post_init__(self) -> None:
        if self.score not in ("compatibility", "sequence_ratio"):
            raise ValueError(f"weighting {self.name!r}: score compatibility|sequence_ratio")


T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry of one kind (``kind``: the config key that chooses it, e.g. ``"advantage"``). A
    part registry holds :class:`Part` records (``part``: which record, with which declarations); the
    method registry (``part=None``) holds the method classes themselves."""

    def __init__(self, kind: str, part: type | None = Part):
        self.kind = kind
        self._part = part
        self._entries: dict[str, T] = {}

    def _record(self, name: str, obj: Any, declared: dict[str, Any]) -> T:
        if self._part is None:
            return obj
        try:
            return self._part(name=name, fn=obj, **declared)
        except TypeError as exc:
            raise ValueError(f"{self.kind} {name!r}: {exc}") from None

    def _raw(self, entry: T) -> Any:
        return entry.fn if isinstance(entry, Part) else entry

    def register(self, name: str, **declared: Any) -> Callable[[Any], Any]:
        """Decorator: make the function or class available as ``method.<kind>: NAME`` with its
        declarations (e.g. a loss's ``aggregation``); the decorated object is returned as it is. A name
        registered twice by different objects is an error."""

        def deco(obj):
            old = self._entries.get(name)
            if old is not None:
                prev = self._raw(old)
                if prev is not obj and _origin(prev) != _origin(obj) and not _same_plugin(prev, obj):
                    raise ValueError(
                        f"{self.kind} {name!r} is registered twice, by two different sources "
                        f"({_where_defined(prev)} and {_where_defined(obj)})"
                    )
            self._entries[name] = self._record(name, obj, declared)
            return obj

        return deco

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str, where: str | None = None) -> T:
        """The entry a key names: a registered name, or ``module:NAME`` / ``file.py:NAME`` (imported now;
        an object the module registered keeps its declarations, another gets the defaults). A key that
        names nothing is one :class:`~graft_rl.errors.ConfigError` line."""
        where = where or f"method.{self.kind}"
        if key in self._entries:
            return self._entries[key]
        if isinstance(key, str) and ":" in key:  # resolved each time: the module as imported now
            module, _, attr = key.rpartition(":")
            mod = import_plugin(module, where)
            obj = vars(mod).get(attr)
            if obj is None:
                if attr in self._entries:  # a name the module registered under another
                    return self._entries[attr]
                raise ConfigError(
                    f"{where}: {key!r}: {module} has no {attr!r} (and registers no {self.kind} of that name)"
                )
            for entry in self._entries.values():
                if self._raw(entry) is obj:
                    return entry
            return self._record(attr, obj, {})
        close = difflib.get_close_matches(str(key), self.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{where}: {key!r} is not one of {', '.join(self.names())}{hint} (or module:NAME / file.py:NAME of your own)"
        )


def _source_file(obj) -> Path | None:
    """The file that defines ``obj`` (a function's code, a class's module), resolved: one source file is
    one plugin whether it was imported as a module (``mytask.parts``) or by path (``.../parts.py``)."""
    code = getattr(obj, "__code__", None)
    name = code.co_filename if code is not None else getattr(sys.modules.get(obj.__module__), "__file__", None)
    if not name or name.startswith("<"):
        return None
    return Path(name).resolve()


def _same_plugin(old, new) -> bool:
    """The same definition imported twice: from one source file named two ways (module and path) or
    imported again after an edit, or the same source from another path (a run's plugin copied or moved).
    The newer one is kept."""
    if getattr(old, "__qualname__", None) != getattr(new, "__qualname__", None):
        return False
    a, b = _source_file(old), _source_file(new)
    if a is not None and a == b:  # one file: named two ways, or edited and imported again (the newer wins)
        return True
    files = [str(getattr(sys.modules.get(getattr(o, "__module__", "")), "__file__", "")) for o in (old, new)]
    return all(f in _SOURCES for f in files) and _SOURCES[files[0]] == _SOURCES[files[1]]  # a copied file


def _where_defined(obj) -> str:
    """``file: qualname`` of a registered object (its module's name when it has no file)."""
    file = _source_file(obj)
    return f"{file}: {getattr(obj, '__qualname__', '?')}" if file else _origin(obj)


def _origin(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


METHODS: Registry[Any] = Registry("name", part=None)  # the method classes (graft_rl.methods.base.Method)
ADVANTAGES: Registry[AdvantagePart] = Registry("advantage", AdvantagePart)
SELECTIONS: Registry[Part] = Registry("selection")
COMPOSITIONS: Registry[CompositionPart] = Registry("composition", CompositionPart)
WEIGHTINGS: Registry[WeightingPart] = Registry("weighting", WeightingPart)
LOSSES: Registry[LossPart] = Registry("loss", LossPart)
AUX_LOSSES: Registry[Part] = Registry("aux_loss")
CORRECTIONS: Registry[CorrectionPart] = Registry("correction", CorrectionPart)

#: the ``method`` keys that choose a part, and the registry each reads
PART_KEYS: dict[str, Registry[Any]] = {
    "advantage": ADVANTAGES,
    "selection": SELECTIONS,
    "composition": COMPOSITIONS,
    "weighting": WEIGHTINGS,
    "loss": LOSSES,
    "aux_loss": AUX_LOSSES,
    "correction": CORRECTIONS,
}

#: the part a method uses for a key its preset does not name: a key added after a user wrote their
#: preset (``register_method`` accepts a preset without it, and such a method gets this part)
PART_DEFAULTS: dict[str, str] = {"correction": "none"}

_PLUGIN_PREFIX = "graft_rl_plugin_"  # the module names file plugins are imported under

#: plugin spec -> the file it was imported from (what a run's provenance hashes)
_PLUGIN_FILES: dict[str, Path | None] = {}
#: plugin spec -> its module (a file plugin shipped to a Ray actor is imported from its source)
_MODULES: dict[str, Any] = {}
#: file plugin spec -> the source this process imported (what a Ray actor is sent)
_SOURCES: dict[str, bytes] = {}
#: file plugins this process was sent (a Ray actor): kept as sent, never read from its own disk
_PINNED: set[str] = set()


def normalise(spec: str) -> str:
    """A plugin spec as a run records it: a ``.py`` path made absolute (relative to the current
    directory, as ``data.reward``'s file paths are), a module name as given."""
    spec = str(spec).strip()
    return str(Path(spec).expanduser().resolve()) if spec.endswith(".py") else spec


def _import_source(spec: str, source: bytes, where: str) -> Any:
    """A file plugin's module from its source (one module per spec and content), recorded as imported."""
    name = f"{_PLUGIN_PREFIX}{hashlib.sha1(spec.encode() + source).hexdigest()[:10]}_{Path(spec).stem}"
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__file__ = spec
        sys.modules[name] = mod
        try:
            exec(compile(source, spec, "exec"), mod.__dict__)
        except Exception as exc:
            del sys.modules[name]
            raise ConfigError(f"{where}: {spec}: importing it raised {type(exc).__name__}: {exc}") from None
    _MODULES[spec], _SOURCES[spec] = mod, source
    return mod


def import_plugin(spec: str, where: str = "plugins") -> Any:
    """Import a plugin: a module name (``my_lab.methods``; the current directory is searched too) or a
    Python file (``path/to/parts.py``). Its decorators register its parts. A module is imported once per
    process; a file again when its content changed (what a config names is what it reads now), unless
    it was sent by the driver (a Ray actor keeps the driver's copy)."""
    spec = str(spec).strip()
    cached = _MODULES.get(spec)
    if cached is not None and (spec in _PINNED or not spec.endswith(".py")):
        return cached
    if spec.endswith(".py"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            if cached is not None:  # read before (the driver sends this copy to its actors)
                return cached
            raise MissingSourceError(f"{where}: {spec}: no such file", path)
        source = path.read_bytes()
        if cached is not None and _SOURCES.get(spec) == source:
            return cached
        _PLUGIN_FILES[spec] = path
        named = _module_of_file(path)  # the same file imported as a module: one plugin, not two
        if named is not None:
            _MODULES[spec] = named
            return named
        return _import_source(spec, source, where)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.append(str(Path.cwd()))  # a module beside the config, as `python -m` would find it
        try:
            found = importlib.util.find_spec(spec)
        except (ImportError, ValueError):
            found = None
        origin = Path(found.origin).resolve() if found is not None and found.origin else None
        as_file = next((m for k, m in _MODULES.items() if k.endswith(".py") and _PLUGIN_FILES.get(k) == origin), None)
        if origin is not None and as_file is not None and spec not in sys.modules:
            _PLUGIN_FILES[spec], _MODULES[spec] = origin, as_file  # imported by path already: the same plugin
            return as_file
        try:
            mod = importlib.import_module(spec)
        except ImportError as exc:
            raise ConfigError(f"{where}: cannot import {spec!r} ({exc}); is it installed, or on PYTHONPATH?") from None
        file = getattr(mod, "__file__", None)
        _PLUGIN_FILES[spec] = Path(file).resolve() if file else None
    _MODULES[spec] = mod
    return mod


def _module_of_file(path: Path) -> Any:
    """A module plugin already imported from ``path`` (by its module name), if any."""
    for spec, mod in _MODULES.items():
        if not spec.endswith(".py") and _PLUGIN_FILES.get(spec) == path:
            return mod
    return None


def load_plugins(specs: Iterable[str] | dict[str, bytes | None]) -> None:
    """Import every plugin of a config's ``plugins`` list (the driver, each Ray actor, every command
    that reads a run's config do so before the method is built). A mapping ``{spec: source}`` (what
    :func:`plugin_sources` gives a Ray actor) imports each file plugin from its source, so a node
    without the file imports the driver's copy."""
    items = specs.items() if isinstance(specs, dict) else ((s, None) for s in specs or ())
    for i, (spec, source) in enumerate(items):
        if source is not None and spec not in _MODULES:
            _import_source(spec, source, f"plugins.{i}")
            _PINNED.add(spec)
            continue
        import_plugin(spec, f"plugins.{i}")


def plugin_sources(specs: Iterable[str]) -> dict[str, bytes | None]:
    """``{spec: source}`` for :func:`load_plugins` in another process: a file plugin's bytes as this
    process read them (a module plugin: None, imported by name there)."""
    out: dict[str, bytes | None] = {}
    for spec in specs:
        import_plugin(spec)
        out[spec] = _SOURCES.get(str(spec).strip())
    return out


def plugin_file(spec: str) -> Path | None:
    """The source file a plugin spec was imported from (imported now if it was not yet): what a run's
    provenance hashes, so that ``--resume`` knows when a plugin changed."""
    if str(spec).strip() not in _MODULES:
        import_plugin(spec)
    return _PLUGIN_FILES.get(str(spec).strip())


def part_modules(cfg) -> list[str]:
    """The modules a config's part keys name in the ``module:NAME`` / ``file.py:NAME`` form."""
    keys = [getattr(cfg, "name", "")] + [getattr(cfg, kind, "auto") for kind in PART_KEYS]
    return [str(k).rpartition(":")[0] for k in keys if ":" in str(k)]
