"""Methods as plugins (docs/design.md, "Methods"): one file per method, each registered by name.

``graft_rl.methods.base`` defines what a method is (:class:`Method`) and the registry
(:func:`register_method`, :func:`build_method`); ``exchange`` and ``objectives`` the generic
batch building (selection, replacement, weighting) and loss that methods specialise. Importing this
package registers the shipped methods: ``grpo``, ``dr_grpo``, ``graft``, ``sgt``, ``luffy``, ``hacpo``.
"""

from graft_rl.methods.base import (
    EXCHANGE_KEYS,
    Method,
    MethodConfig,
    RolloutFilter,
    build_method,
    method_class,
    method_names,
    register_method,
)

# the shipped methods register on import, in this order (the paper's; error messages list them so)
# isort: off
from graft_rl.methods import grpo, graft, sgt, luffy, hacpo, dr_grpo  # noqa: E402,F401
# isort: on

__all__ = [
    "EXCHANGE_KEYS",
    "Method",
    "MethodConfig",
    "RolloutFilter",
    "build_exchange",
    "build_method",
    "build_objective",
    "method_class",
    "method_names",
    "register_method",
]


def build_exchange(cfg: MethodConfig):
    """The exchange of a config's method (``build_method(cfg).exchange()``)."""
    return build_method(cfg).exchange()


def build_objective(cfg: MethodConfig):
    """The objective of a config's method (``build_method(cfg).objective()``)."""
    return build_method(cfg).objective()
