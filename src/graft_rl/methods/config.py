"""``method`` in a config: the keys every method shares, the parts it is composed from, and the keys of
the chosen method and parts (docs/design.md, "Methods from parts").

A leaf of ``graft_rl.methods``: it reads the registries (:mod:`graft_rl.methods.registry`) and
nothing else of the package, so every other module of ``methods`` may import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from graft_rl.errors import ConfigError
from graft_rl.methods.registry import METHODS, PART_DEFAULTS, PART_KEYS

__all__ = ["EXCHANGE_KEYS", "PART_NAMES", "MethodConfig", "check_range", "method_params", "preset_part"]

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

#: the keys that choose a part (``auto``: the method's own, its preset)
PART_NAMES = tuple(PART_KEYS)


@dataclass(init=False)
class MethodConfig:
    """The training method: ``name`` (any registered method: ``graft_rl.methods.method_names()``),
    the parts it is composed of (each ``auto`` = the method's own, or any registered part), the keys
    every method shares, and the keys of the chosen method and parts (their ``Params``).

    Shipped: ``grpo`` | ``dr_grpo`` | ``graft`` | ``sgt`` | ``luffy`` | ``hacpo``. Hybrids: ``sgt`` with
    ``selection: graft`` is "SGT + GRAFT which"; ``graft`` with ``selection: sgt`` is "SGT + GRAFT how";
    ``hacpo`` with ``selection: graft`` is "HACPO + GRAFT which"; ``graft`` with ``advantage: rloo`` or
    ``loss: gspo`` swaps one part of GRAFT.
    """

    name: str = "graft"  # the method: any registered name (graft config show METHOD lists its own keys)
    # --- the parts (docs/design.md has the table of which combine); auto = the method's own
    advantage: str = "auto"  # grpo | dr_grpo | rloo | hacpo | module:NAME
    composition: str = "auto"  # replace | pool | aux_target | hacpo_pool | module:NAME
    weighting: str = "auto"  # gate | none | module:NAME
    loss: str = "auto"  # token_mean_clip | gspo | luffy | hacpo | module:NAME
    aux_loss: str = "auto"  # none | sgt_nll | module:NAME
    # the engine-trainer gap of own responses (docs/design.md, "Engine and trainer"): none | tis |
    # tis_sequence | icepop | mask_sequence | module:NAME
    correction: str = "auto"
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
    pooled: bool = False  # pooled-group advantages instead of source-computed ones (= composition: pool)
    success_only: bool = False  # only successful peer responses (Appendix G)
    compatibility: str = "token_mean"  # token_mean (paper) | per_char (tokenisation-invariant, beyond the paper)
    eps_low: float = 0.2  # token ratio clipped below at 1 - eps_low (Section 4.2)
    eps_high: float = 0.28  # ... and above at 1 + eps_high (clip-higher, as DAPO)
    adv_eps: float = 1e-6  # GRPO's advantage divides by std + adv_eps
    # KL penalty to the initial policy (k3, token mean; 0 = off as in the paper's GRPO/GRAFT;
    # HACPO's recipe uses 1e-3). Keeps a frozen copy of each model in memory.
    kl_coef: float = 0.0
    # the chosen method's and parts' own keys (their Params, as a mapping), read as attributes
    params: dict = field(default_factory=dict)
    # keys of another method's or part's Params that were given (an error unless a saved config is read)
    _foreign: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __init__(self, name: str = "graft", params: dict | None = None, **keys: Any):
        common = {f.name: f for f in dataclasses.fields(MethodConfig) if f.name not in ("params", "_foreign")}
        self.name = name
        for key, f in common.items():
            if key != "name":
                setattr(self, key, keys.pop(key, f.default))
        given = {**(params or {}), **keys}
        own = _param_fields(self)
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

    def part_name(self, kind: str) -> str:
        """The part of ``kind`` this config uses: its key, or the method's preset for ``auto``."""
        key = getattr(self, kind)
        return preset_part(self.name, kind, self) if key == "auto" else key

    def validate(self, unused_keys: bool = True) -> None:
        """Names, parts, ranges, and (``unused_keys``) no key the method does not read set away from its default."""
        cls = METHODS.get(self.name, "method.name")
        choices = {
            "admission": ("gate", "random"),
            "ratio": ("token", "sequence"),
            "position": ("last", "first", "uniform"),
            "compatibility": ("token_mean", "per_char"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"method.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        for kind, registry in PART_KEYS.items():
            if getattr(self, kind) != "auto":
                registry.get(getattr(self, kind))
        if self.selection == "auto":  # resolved once, so the saved config says which rule ran
            self.selection = cls.preset["selection"]
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
        self._check_types()
        cls.check(self)
        cls.check_parts(self)
        for kind, registry in PART_KEYS.items():
            check = registry.get(self.part_name(kind)).check
            if check is not None:
                check(self)
        if not unused_keys:
            self._foreign = {}
            return
        self._check_unused(cls)

    def check_policies(self, count: int, stored_peers: bool = False) -> None:
        """The run's policies (``count``, peers replayed from records included) suit the method: one with a
        peer needs two; a peer replayed from records adjusts the config (one direction only)."""
        cls = METHODS.get(self.name, "method.name")
        if cls.uses_peers and count < 2:
            raise ConfigError(f"method.name {self.name!r} needs at least two policies (or a peer from records)")
        if stored_peers:
            cls.with_stored_peers(self)

    def check_rollout(self, prompts: str, top_p: float, stored_peers: bool = False) -> str:
        """The rollouts suit the method's parts; returns ``rollout.prompts`` resolved (``auto``: ``own`` for
        an unpaired composition such as SAPO's, else ``shared``). An exchange that pairs groups by prompt
        needs every policy to answer the same prompts, and so does a peer replayed from records; a loss
        reading peers' sampled tokens needs their log-probs of the untruncated distribution."""
        cls = METHODS.get(self.name, "method.name")
        composition = self.part_name("composition")
        unpaired = PART_KEYS["composition"].get(composition).unpaired and cls.uses_peers
        if prompts == "auto":
            prompts = "own" if unpaired else "shared"
        if prompts == "own" and cls.uses_peers and not unpaired:
            raise ConfigError(
                f"rollout.prompts own: method {self.name!r} exchanges groups of the same prompt (composition "
                f"{composition!r}), so every policy must answer the same prompts; set rollout.prompts: shared "
                "(own streams are for an unpaired exchange such as sapo's)"
            )
        if prompts == "own" and stored_peers:
            raise ConfigError(
                "rollout.prompts own with peers from records: a replayed peer's groups are looked up by the "
                "receiver's prompts; set rollout.prompts: shared"
            )
        loss = self.part_name("loss")
        if self.reads_peer_tokens():
            if top_p < 1:
                raise ConfigError(
                    f"method.loss {loss!r} weighs peer tokens by the source's per-token log-probs, which are of the "
                    f"top-p truncated distribution at top_p {top_p}; set top_p: 1"
                )
            if stored_peers:
                raise ConfigError(
                    f"method.loss {loss!r} reads peers' token ids, and a peer replayed from records has no "
                    "tokenizer to check against; use live policies"
                )
        return prompts

    def reads_peer_tokens(self) -> bool:
        """The loss trains peers' sampled token ids (``peer_tokens``, F-TIS): the policies need one vocabulary."""
        return bool(PART_KEYS["loss"].get(self.part_name("loss")).peer_tokens)

    def _check_unused(self, cls) -> None:
        """A key the chosen method and parts never read is an error (it would be silently ignored)."""
        if self._foreign:
            key = next(iter(self._foreign))
            users = [n for n in METHODS.names() if key in _param_fields(MethodConfig(name=n))]
            parts = [
                f"method.{kind}: {n}"
                for kind, reg in PART_KEYS.items()
                for n in reg.names()
                if key in _fields_of(reg.get(n))
            ]
            owner = f"it belongs to {' / '.join(parts)}" if parts else ""
            used = f"it is used by: {', '.join(users)}" if users else ""
            raise ConfigError(
                f"method.{key} is not used by method {self.name!r} ({used or owner})"
                + (f"; {owner}" if used and owner else "")
            )
        if not cls.uses_peers:
            default = MethodConfig(name=self.name)
            for key in (*EXCHANGE_KEYS, "composition", "weighting"):
                unchanged = getattr(self, key) == getattr(default, key) or (
                    key == "selection" and self.selection == "complementary"
                )
                if not unchanged:
                    users = [n for n in METHODS.names() if METHODS.get(n).uses_peers]
                    raise ConfigError(
                        f"method.{key} is not used by method {self.name!r} (it is used by: {', '.join(users)})"
                    )

    def _check_types(self) -> None:
        hints: dict = {}
        for params in _params_classes(self):
            hints.update(typing.get_type_hints(params))
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


def preset_part(method: str, kind: str, cfg: MethodConfig | None = None) -> str:
    """The part of ``kind`` a method uses unless its key overrides it (its class's ``preset``; the
    pooled-groups switch turns GRAFT's replacement into pooling)."""
    cls = METHODS.get(method, "method.name")
    name = cls.preset.get(kind, PART_DEFAULTS.get(kind))
    if name is None:
        raise ConfigError(f"method {method!r}: its preset names no {kind} part")
    if kind == "composition" and cfg is not None and cfg.pooled and name == "replace":
        return "pool"
    return name


def check_range(cfg: MethodConfig, ranges: dict[str, tuple[float, float, bool]]) -> None:
    """``key: (low, high, low inclusive)``, high exclusive; NaN fails every comparison."""
    for key, (lo, hi, closed) in ranges.items():
        v = getattr(cfg, key)
        if not ((lo <= v if closed else lo < v) and v < hi):
            raise ConfigError(f"method.{key} must be in {'[' if closed else '('}{lo:g}, {hi:g}), got {v}")


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"


def _fields_of(obj) -> dict[str, dataclasses.Field]:
    """``obj``: a method class or a :class:`~graft_rl.methods.registry.Part`; its ``Params``' fields."""
    params = obj.Params
    return {f.name: f for f in dataclasses.fields(params)} if dataclasses.is_dataclass(params) else {}


def _params_classes(cfg: MethodConfig) -> list[type]:
    """The ``Params`` of the method and of each part it uses (none for a name not registered yet)."""
    if cfg.name not in METHODS and ":" not in str(cfg.name):
        return []
    try:
        owners = [METHODS.get(cfg.name)]
        for kind, registry in PART_KEYS.items():
            key = cfg.__dict__.get(kind, "auto")
            owners.append(registry.get(preset_part(cfg.name, kind) if key == "auto" else key))
    except ConfigError:  # an unknown name: validate() says so
        return []
    return [o.Params for o in owners if isinstance(o.Params, type) and dataclasses.is_dataclass(o.Params)]


def method_params(name: str) -> list[type]:
    """The ``Params`` dataclasses of a method as its preset composes it: its own, then its parts'."""
    return _params_classes(MethodConfig(name=name))


def _param_fields(cfg: MethodConfig) -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for params in _params_classes(cfg):
        out.update({f.name: f for f in dataclasses.fields(params)})
    return out


def _all_param_keys() -> dict[str, None]:
    out = {k: None for n in METHODS.names() for k in _fields_of(METHODS.get(n))}
    for registry in PART_KEYS.values():
        for n in registry.names():
            out.update({k: None for k in _fields_of(registry.get(n))})
    return out
