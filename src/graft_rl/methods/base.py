"""What a method is, and the registry that finds one by name (docs/design.md, "Methods").

A method decides how each receiver's training batch is built from every policy's rollouts and
which objective trains it. It is one class, registered under its config name::

    @register_method("dr_grpo")
    class DrGRPO(GRPO):
        '''Dr. GRPO: advantages r - mean(r), no division by the group's std.'''
        def exchange(self):
            return DrGRPOExchange(self.cfg)

The class brings everything the engine asks of a method, so the engine (trainer, worker,
exchange) never names one:

- ``Params``: a dataclass of the method's own config keys (``method.KEY`` in YAML, flat beside the
  common ones), each with its default and a comment; :meth:`Method.check` bounds their values;
- ``uses_peers``: whether it reads other policies' groups (and so the exchange switches
  :data:`EXCHANGE_KEYS`); ``default_selection``: what ``selection: auto`` means for it;
- on the driver: :meth:`Method.exchange` (selection, composition, advantages; Section 4.1),
  :meth:`Method.observe` (per-step state, e.g. HACPO's capability window, checkpointed through
  :meth:`Method.state_dict`), :meth:`Method.rollout_filter` (DAPO's dynamic sampling);
- on the receiver's worker: :meth:`Method.weighting` (compatibility score -> weight; Section 4.2),
  :meth:`Method.objective` (the minibatch loss), :meth:`Method.loss_mask` (tokens left out of the
  loss, e.g. HACPO's final EOS).

:class:`MethodConfig` holds the common keys as fields and the chosen method's ``Params`` values in
``params`` (read as attributes: ``cfg.sgt_coef``); which names and keys are valid comes from the
registry, so nothing is listed twice.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from graft_rl.errors import ConfigError

__all__ = [
    "EXCHANGE_KEYS",
    "Method",
    "MethodConfig",
    "RolloutFilter",
    "build_method",
    "method_class",
    "method_names",
    "register_method",
]

#: name -> method class, filled by :func:`register_method`
_REGISTRY: dict[str, type[Method]] = {}

#: the exchange switches (Sections 4.1-4.2, Table 2, Appendix G): read by every method with a peer
EXCHANGE_KEYS = (
    "selection",
    "balance",
    "gate",
    "floor",
    "admission",
    "delta",
    "ratio",
    "position",
    "pooled",
    "success_only",
    "compatibility",
)


@dataclass(init=False)
class MethodConfig:
    """The training method: ``name`` (any registered method: ``graft_rl.methods.method_names()``),
    the keys every method shares, and the chosen method's own keys (its ``Params``).

    Shipped: ``grpo`` | ``dr_grpo`` | ``graft`` | ``sgt`` | ``luffy`` | ``hacpo``. Hybrids: ``sgt`` with
    ``selection: graft`` is "SGT + GRAFT which"; ``graft`` with ``selection: sgt`` is "SGT + GRAFT how";
    ``hacpo`` with ``selection: graft`` is "HACPO + GRAFT which".
    """

    name: str = "graft"  # the method: any registered name (graft config show METHOD lists its own keys)
    # --- which peer groups (Section 4.1, Appendix G)
    # auto = the method's own rule (graft/luffy: complementary, sgt: sgt, hacpo: all);
    # complementary (= graft) | random (count-matched) | sgt (k_recv=0, k_peer>=1) | all
    selection: str = "auto"
    balance: bool = True  # balanced exchange (Table 2: "w/o balancing" sets false)
    # --- how to learn from them (Section 4.2)
    gate: bool = True  # compatibility weighting at all ("w/o compatibility gate": false, w = 1)
    floor: bool = True  # the delta threshold ("no floor": false, w = min(s, 1))
    admission: str = "gate"  # gate | random (count-matched random admission)
    delta: float = 0.8  # the gate's threshold: a peer response is admitted iff s > delta (Section 4.2)
    ratio: str = "token"  # token | sequence ("token ratio" ablation)
    position: str = "last"  # peer minibatch position: last | first | uniform
    pooled: bool = False  # pooled-group advantages instead of source-computed ones
    success_only: bool = False  # only successful peer responses (Appendix G)
    compatibility: str = "token_mean"  # token_mean (paper) | per_char (tokenisation-invariant, beyond the paper)
    eps_low: float = 0.2  # token ratio clipped below at 1 - eps_low (Section 4.2)
    eps_high: float = 0.28  # ... and above at 1 + eps_high (clip-higher, as DAPO)
    adv_eps: float = 1e-6  # GRPO's advantage divides by std + adv_eps
    # KL penalty to the initial policy (k3, token mean; 0 = off as in the paper's GRPO/GRAFT;
    # HACPO's recipe uses 1e-3). Keeps a frozen copy of each model in memory.
    kl_coef: float = 0.0
    # the chosen method's own keys (its Params, as a mapping), read as attributes
    params: dict = field(default_factory=dict)
    # keys of another method's Params that were given (an error unless a saved config is read)
    _foreign: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __init__(self, name: str = "graft", params: dict | None = None, **keys: Any):
        common = {f.name: f for f in dataclasses.fields(MethodConfig) if f.name not in ("params", "_foreign")}
        self.name = name
        for key, f in common.items():
            if key != "name":
                setattr(self, key, keys.pop(key, f.default))
        given = {**(params or {}), **keys}
        own = _param_fields(name)
        self.params = {k: f.default for k, f in own.items()}
        self._foreign = {}
        for key, value in given.items():
            if key in own:
                self.params[key] = value
            elif key in _all_param_keys():
                self._foreign[key] = value
            else:
                raise ConfigError(f"unknown key method.{key}{_suggest(key, [*common, *_all_param_keys()])}")

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_") or key == "params":  # unpickling: no params yet
            raise AttributeError(key)
        params = self.__dict__.get("params", {})
        if key in params:
            return params[key]
        raise AttributeError(f"method {self.__dict__.get('name')!r} has no key {key!r}")

    def __setattr__(self, key: str, value: Any) -> None:
        if key in self.__dict__.get("params", {}) and key not in _COMMON:
            self.params[key] = value
        else:
            object.__setattr__(self, key, value)

    def to_flat(self) -> dict:
        """The keys as one YAML mapping (common keys, then the method's own), as a config file writes them."""
        out = {k: getattr(self, k) for k in _COMMON}
        out.update(self.params)
        return out

    def validate(self, unused_keys: bool = True) -> None:
        """Names, ranges, and (``unused_keys``) no key the method does not read set away from its default."""
        from graft_rl.methods.exchange import SELECTIONS

        if self.name not in _REGISTRY:
            raise ConfigError(f"method.name: {self.name!r} is not one of {', '.join(method_names())}")
        cls = _REGISTRY[self.name]
        choices = {
            "selection": ("auto", *SELECTIONS),
            "admission": ("gate", "random"),
            "ratio": ("token", "sequence"),
            "position": ("last", "first", "uniform"),
            "compatibility": ("token_mean", "per_char"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"method.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.selection == "auto":
            self.selection = cls.default_selection
        check_range(
            self,
            {
                "delta": (0.0, math.inf, True),
                "eps_low": (0.0, 1.0, True),
                "eps_high": (0.0, math.inf, True),
                "adv_eps": (0.0, math.inf, False),
                "kl_coef": (0.0, math.inf, True),
            },
        )
        self._check_types(cls)
        cls.check(self)
        if not unused_keys:
            self._foreign = {}
            return
        # a key the chosen method never reads is an error (it would be silently ignored)
        if self._foreign:
            key = next(iter(self._foreign))
            users = [n for n, c in _REGISTRY.items() if c.Params is not None and key in _param_fields(n)]
            raise ConfigError(f"method.{key} is not used by method {self.name!r} (it is used by: {', '.join(users)})")
        if not cls.uses_peers:
            default = MethodConfig(name=self.name)
            for key in EXCHANGE_KEYS:
                unchanged = getattr(self, key) == getattr(default, key) or (
                    key == "selection" and self.selection == "complementary"
                )
                if not unchanged:
                    users = [n for n, c in _REGISTRY.items() if c.uses_peers]
                    raise ConfigError(
                        f"method.{key} is not used by method {self.name!r} (it is used by: {', '.join(users)})"
                    )

    def _check_types(self, cls: type[Method]) -> None:
        hints = typing.get_type_hints(cls.Params) if cls.Params is not None else {}
        for key, value in self.params.items():
            want = hints.get(key)
            if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.params[key] = float(value)
            elif want is float and isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
                try:
                    self.params[key] = float(value)
                except ValueError:
                    raise ConfigError(f"method.{key}: expected a number, got {value!r}") from None
            elif want in (int, bool, str) and (
                not isinstance(value, want) or (want is int and isinstance(value, bool))
            ):
                raise ConfigError(f"method.{key}: expected {want.__name__}, got {value!r}")


_COMMON = tuple(f.name for f in dataclasses.fields(MethodConfig) if f.name not in ("params", "_foreign"))


def check_range(cfg: MethodConfig, ranges: dict[str, tuple[float, float, bool]]) -> None:
    """``key: (low, high, low inclusive)``, high exclusive; NaN fails every comparison."""
    for key, (lo, hi, closed) in ranges.items():
        v = getattr(cfg, key)
        if not ((lo <= v if closed else lo < v) and v < hi):
            raise ConfigError(f"method.{key} must be in {'[' if closed else '('}{lo:g}, {hi:g}), got {v}")


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"


def _param_fields(name: str) -> dict[str, dataclasses.Field]:
    cls = _REGISTRY.get(name)
    if cls is None or cls.Params is None:
        return {}
    return {f.name: f for f in dataclasses.fields(cls.Params)}


def _all_param_keys() -> dict[str, None]:
    return {k: None for n in _REGISTRY for k in _param_fields(n)}


@dataclass(frozen=True)
class RolloutFilter:
    """Groups a method keeps of a generation batch, refilled up to ``max_batches`` batches a step
    (DAPO's dynamic sampling: Appendix B; ``<= 0``: no limit)."""

    keep: Callable[[Any], bool]  # RolloutGroup -> keep it
    max_batches: int
    refill_factor: int = 1  # a refill batch has this many times prompt_batch prompts (DAPO's scripts: 3)


class Method:
    """Base class of a registered method (see the module docstring). The default is GRPO's
    on-policy update with no peer: subclasses override what they change."""

    name: ClassVar[str] = ""
    Params: ClassVar[type | None] = None
    uses_peers: ClassVar[bool] = True
    default_selection: ClassVar[str] = "complementary"
    #: a peer response longer than the receiver's budget (``TokenBatch.cut``) stays in the loss, cut
    #: (HACPO's recipe); by default it leaves the loss (docs/fidelity.md, re-tokenisation)
    keeps_cut_peer_responses: ClassVar[bool] = False

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    # ------------------------------------------------------------------ config
    @classmethod
    def check(cls, cfg: MethodConfig) -> None:
        """Bound the method's own keys (one :class:`~graft_rl.errors.ConfigError` line naming the key)."""

    @classmethod
    def with_stored_peers(cls, cfg: MethodConfig) -> None:
        """Adjust the config when a peer is replayed from records (one direction only)."""

    # ------------------------------------------------------------------ driver side
    def exchange(self):
        """The :class:`~graft_rl.methods.exchange.Exchange` building each receiver's batch."""
        from graft_rl.methods.exchange import Exchange

        return Exchange(self.cfg)

    def rollout_filter(self) -> RolloutFilter | None:
        """Which generated groups a step keeps (None: all of them)."""
        return None

    def observe(self, groups: dict) -> None:
        """Called once per step with every policy's verified groups, before the batches are built."""

    def state_dict(self) -> dict:
        """What :meth:`observe` accumulated, for checkpoints (JSON-able)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` on resume."""

    # ------------------------------------------------------------------ receiver side (its worker)
    def weighting(self):
        """Compatibility score -> weight of a peer response (Section 4.2)."""
        from graft_rl.methods.exchange import Weighting

        return Weighting(self.cfg)

    def objective(self):
        """The minibatch objective (:class:`~graft_rl.methods.objectives.Objective`)."""
        from graft_rl.methods.objectives import Objective

        return Objective(self.cfg)

    def loss_mask(self, response_ids: list[list[int]], mask, eos_token_ids) -> None:
        """Zero (in place) the loss-mask positions the method leaves out of the loss; default none."""


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator: make a :class:`Method` available as ``method.name: NAME``."""

    def deco(cls: type[Method]) -> type[Method]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} is registered twice ({_REGISTRY[name].__module__}, {cls.__module__})")
        if cls.Params is not None:
            clash = set(_COMMON) & {f.name for f in dataclasses.fields(cls.Params)}
            if clash:
                raise ValueError(f"method {name!r}: Params key(s) {sorted(clash)} shadow common method keys")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def method_names() -> list[str]:
    """Every registered method's name, in registration order."""
    return list(_REGISTRY)


def method_class(name: str) -> type[Method]:
    if name not in _REGISTRY:
        raise ConfigError(f"method.name: {name!r} is not one of {', '.join(method_names())}")
    return _REGISTRY[name]


def build_method(cfg: MethodConfig) -> Method:
    """The registered method of a (validated) config."""
    return method_class(cfg.name)(cfg)
