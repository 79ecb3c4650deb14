"""Methods from parts (docs/design.md, "Methods from parts"): registries of advantages, selections,
compositions, weightings, losses, auxiliary losses and corrections, and methods as presets of them.

- :mod:`~graft_rl.methods.registry`: the registries and the user's plugins (``plugins:`` in a config,
  or ``module:NAME`` / ``file.py:NAME`` for any part key);
- :mod:`~graft_rl.methods.config`: ``method`` in a config (:class:`MethodConfig`);
- :mod:`~graft_rl.methods.advantages`, :mod:`~graft_rl.methods.losses`: the estimators and losses;
  :mod:`~graft_rl.methods.corrections`: the engine-trainer gap of own responses, measured and corrected;
- :mod:`~graft_rl.methods.exchange` (the driver's side): selections, compositions and the exchange
  that builds each receiver's batch; :mod:`~graft_rl.methods.receiver`,
  :mod:`~graft_rl.methods.weighting` and :mod:`~graft_rl.methods.objectives` (the receiver's side):
  inclusion, weights, tensors, minibatches and their loss; :mod:`~graft_rl.methods.reporting`: what
  both put in the metric lines;
- :mod:`~graft_rl.methods.base`: :class:`Method` (a preset of parts plus its state) and its registry.

Importing this package registers the shipped parts and methods: the paper's ``grpo``, ``dr_grpo``,
``graft``, ``sgt``, ``luffy``, ``hacpo``, and those published after it: ``sapo``, ``prp``, ``xgrpo``,
``ftis`` (docs/fidelity.md, "Methods after the paper").
"""

from graft_rl.methods import advantages, corrections, losses, weighting  # noqa: F401  (register the shipped parts)
from graft_rl.methods.advantages import AdvantageContext, register_advantage
from graft_rl.methods.base import (
    Method,
    RolloutFilter,
    build_method,
    method_class,
    method_names,
    register_method,
)
from graft_rl.methods.config import EXCHANGE_KEYS, PART_NAMES, MethodConfig, check_range
from graft_rl.methods.corrections import register_correction
from graft_rl.methods.exchange import (
    ComposeContext,
    Selection,
    SwarmContext,
    register_composition,
    register_selection,
)
from graft_rl.methods.losses import LossContext, register_aux_loss, register_loss
from graft_rl.methods.registry import load_plugins
from graft_rl.methods.weighting import register_weighting

# the shipped methods register on import, in this order (the paper's; error messages list them so)
# isort: off
from graft_rl.methods import grpo, graft, sgt, luffy, hacpo, dr_grpo  # noqa: E402,F401
from graft_rl.methods import sapo, mutual, ftis  # noqa: E402,F401  (after the paper)
# isort: on

__all__ = [
    "EXCHANGE_KEYS",
    "PART_NAMES",
    "AdvantageContext",
    "ComposeContext",
    "LossContext",
    "Method",
    "MethodConfig",
    "RolloutFilter",
    "Selection",
    "SwarmContext",
    "build_exchange",
    "build_method",
    "build_objective",
    "check_range",
    "load_plugins",
    "method_class",
    "method_names",
    "register_advantage",
    "register_aux_loss",
    "register_composition",
    "register_correction",
    "register_loss",
    "register_method",
    "register_selection",
    "register_weighting",
]


def build_exchange(cfg: MethodConfig):
    """The exchange of a config's method (``build_method(cfg).exchange``)."""
    return build_method(cfg).exchange


def build_objective(cfg: MethodConfig):
    """The minibatch objective of a config's method (``build_method(cfg).receiver().objective``)."""
    return build_method(cfg).receiver().objective
