"""What a method is: a preset of parts, and the registry that finds one by name (docs/design.md,
"Methods from parts").

A method names the parts it is made of (:attr:`Method.preset`), each one a registered function or small
class (:mod:`graft_rl.methods.registry`), and keeps whatever state its parts need across steps::

    @register_method("dr_grpo")
    class DrGRPO(GRPO):
        '''Dr. GRPO: advantages r - mean(r), no division by the group's std.'''
        preset = {**GRPO.preset, "advantage": "dr_grpo"}

Any part can be swapped from the config (``method.advantage: rloo``, ``method.loss: gspo``); a
combination that cannot work is refused when the config is read (:meth:`Method.check_parts`).

The class brings everything the engine asks of a method, so the engine (trainer, worker) never
names one or reads a method's attribute:

- ``Params``: a dataclass of the method's own config keys (``method.KEY`` in YAML, flat beside the
  common ones and its parts' keys), each with its default and a comment; :meth:`Method.check`
  bounds their values;
- ``uses_peers``: whether it reads other policies' groups (and so the exchange switches
  :data:`~graft_rl.methods.config.EXCHANGE_KEYS`);
- on the driver: :meth:`Method.build` (a receiver's batch: advantage, selection, composition;
  Section 4.1), :meth:`Method.observe` (per-step state, e.g. HACPO's capability window, checkpointed
  through :meth:`Method.state_dict`), :meth:`Method.rollout_filter` (DAPO's dynamic sampling);
- on the receiver's worker: :meth:`Method.receiver` (weighting, loss mask, minibatch order and
  objective; Section 4.2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from graft_rl.errors import ConfigError
from graft_rl.methods.config import PART_NAMES, MethodConfig
from graft_rl.methods.exchange import Exchange, ReceiverBatch
from graft_rl.methods.receiver import Receiver
from graft_rl.methods.registry import ADVANTAGES, COMPOSITIONS, LOSSES, METHODS, PART_DEFAULTS

__all__ = [
    "Method",
    "RolloutFilter",
    "build_method",
    "method_class",
    "method_names",
    "register_method",
]


@dataclass(frozen=True)
class RolloutFilter:
    """Groups a method keeps of a generation batch, refilled up to ``max_batches`` batches a step
    (DAPO's dynamic sampling: Appendix B; ``<= 0``: no limit)."""

    keep: Callable[[Any], bool]  # RolloutGroup -> keep it
    max_batches: int
    refill_factor: int = 1  # a refill batch has this many times prompt_batch prompts (DAPO's scripts: 3)


class Method:
    """Base class of a registered method (see the module docstring). Its :attr:`preset` is GRAFT's
    parts (Sections 4.1-4.2: ``grpo`` advantages computed by each source, ``complementary``
    selection, ``replace`` composition, ``gate`` weighting, ``token_mean_clip`` loss), the exchange
    every other method is a variation of: a subclass spreads it and names the parts it changes
    (``{**Method.preset, "loss": "luffy"}``). GRPO is this preset with ``uses_peers = False``: with no
    peer the selection, composition and weighting never act. (A neutral base would change the
    resolved parts every run writes to ``config.yaml``.)"""

    name: ClassVar[str] = ""
    Params: ClassVar[type | None] = None
    uses_peers: ClassVar[bool] = True
    #: the parts the method is made of; each ``method.<kind>`` key other than ``auto`` replaces one
    preset: ClassVar[dict[str, str]] = {
        "advantage": "grpo",
        "selection": "complementary",
        "composition": "replace",
        "weighting": "gate",
        "loss": "token_mean_clip",
        "aux_loss": "none",
        "correction": "none",
    }
    #: per-step state the method keeps for its parts (HACPO: ``capability``, each policy's success rate)
    keeps: ClassVar[tuple[str, ...]] = ()
    #: where the method comes from and what of it could be read (``graft config show`` lists it)
    source: ClassVar[str] = "a method of your own"

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg
        self.exchange = Exchange(cfg, uses_peers=self.uses_peers)

    # ------------------------------------------------------------------ config
    @classmethod
    def check(cls, cfg: MethodConfig) -> None:
        """Bound the method's own keys (one :class:`~graft_rl.errors.ConfigError` line naming the key)."""

    @classmethod
    def check_parts(cls, cfg: MethodConfig) -> None:
        """Refuse parts that cannot work together (docs/design.md has the table), in one line."""
        names = {kind: cfg.part_name(kind) for kind in PART_NAMES}
        advantage = ADVANTAGES.get(names["advantage"])
        composition = COMPOSITIONS.get(names["composition"])
        if advantage.needs_pool and not composition.pools:
            raise ConfigError(
                f"method.advantage {names['advantage']!r} compares a receiver's group with a peer's and needs a "
                f"composition that pools them (pool, hacpo_pool), not {names['composition']!r}"
            )
        if advantage.needs_capability and "capability" not in cls.keeps:
            raise ConfigError(
                f"method.advantage {names['advantage']!r} reads each policy's capability, which method {cfg.name!r} "
                f"does not track (method hacpo does)"
            )
        aux = composition.aux
        if aux != (names["aux_loss"] != "none"):
            need = "an aux_loss (sgt_nll)" if aux else "composition aux_target"
            raise ConfigError(
                f"method.composition {names['composition']!r} with aux_loss {names['aux_loss']!r}: "
                f"auxiliary targets and their loss come together; set {need}"
            )
        if cls.uses_peers and names["weighting"] != "none" and not LOSSES.get(names["loss"]).weighted:
            raise ConfigError(
                f"method.weighting {names['weighting']!r} weighs peer responses, but loss {names['loss']!r} takes no "
                "weight (it has its own off-policy correction); set method.weighting: none"
            )
        if names["correction"] != "none" and not LOSSES.get(names["loss"]).corrects:
            raise ConfigError(
                f"method.correction {names['correction']!r} weights own tokens, but loss {names['loss']!r} does not "
                "apply a correction's weights (token_mean_clip, gspo, luffy and hacpo do; a loss of your own "
                "declares corrects=True); set method.correction: none"
            )
        if cfg.pooled and names["composition"] != "pool":
            raise ConfigError(
                f"method.pooled: true is composition 'pool'; method {cfg.name!r} uses {names['composition']!r}"
            )

    @classmethod
    def with_stored_peers(cls, cfg: MethodConfig) -> None:
        """Adjust the config when a peer is replayed from records (one direction only)."""

    # ------------------------------------------------------------------ driver side
    def build(self, receiver: str, groups: dict, live: set[str], n: int, gen, swarm_gen=None) -> ReceiverBatch:
        """A receiver's batch for this step (after :meth:`observe`); ``swarm_gen``: the draws of an unpaired
        composition (SAPO's external data points), seeded apart from the exchange's ``gen``."""
        return self.exchange.build(receiver, groups, live, n, gen, self.capability(), self.state(), swarm_gen)

    def capability(self) -> dict[str, float]:
        """Each policy's capability, for a method that keeps it (else empty)."""
        return {}

    def state(self) -> dict:
        """The per-step state the method's parts read (``AdvantageContext.state``, ``ComposeContext.state``)."""
        return {}

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
    def receiver(self) -> Receiver:
        """The receiver-side parts: weighting, loss mask, minibatch order, objective (Section 4.2)."""
        return Receiver(self.cfg)


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator: make a :class:`Method` available as ``method.name: NAME``."""
    from graft_rl.methods.config import _COMMON

    def deco(cls: type[Method]) -> type[Method]:
        if cls.Params is not None:
            import dataclasses

            clash = set(_COMMON) & {f.name for f in dataclasses.fields(cls.Params)}
            if clash:
                raise ValueError(f"method {name!r}: Params key(s) {sorted(clash)} shadow common method keys")
        legacy = [h for h in ("exchange", "objective", "weighting", "loss_mask") if callable(cls.__dict__.get(h))]
        if legacy:
            raise ValueError(
                f"method {name!r} overrides {', '.join(legacy)}(): a method now names its parts in `preset` "
                "(register the rule as an advantage, composition, weighting or loss: docs/contributing.md)"
            )
        missing = set(PART_NAMES) - set(cls.preset) - set(PART_DEFAULTS)  # a newer key has its default
        if missing:
            raise ValueError(f"method {name!r}: its preset names no {', '.join(sorted(missing))} part")
        cls.name = name
        return METHODS.register(name)(cls)

    return deco


def method_names() -> list[str]:
    """Every registered method's name, in registration order."""
    return METHODS.names()


def method_class(name: str) -> type[Method]:
    return METHODS.get(name, "method.name")


def build_method(cfg: MethodConfig) -> Method:
    """The registered method of a (validated) config."""
    return method_class(cfg.name)(cfg)
