"""GRAFT (Sections 4.1-4.2): a receiver's all-fail group is replaced by its peer's mixed group, with
the source's advantages, a compatibility gate on each peer response, token-level ratio clipping,
balanced exchange and peer-last minibatches. Its parts: ``grpo`` advantage, ``complementary``
selection, ``replace`` composition, ``gate`` weighting, ``token_mean_clip`` loss. Every Table 2 /
Appendix G switch is a common method key (``graft_rl.methods.config.EXCHANGE_KEYS``); the
pooled-groups ablation (``pooled: true``) is the ``pool`` composition."""

from __future__ import annotations

from graft_rl.errors import removed_names
from graft_rl.methods.base import Method, register_method
from graft_rl.methods.config import MethodConfig
from graft_rl.methods.exchange import Complementary, register_selection

__all__ = ["GRAFT"]

register_selection("graft")(Complementary)  # the paper's name for its rule (SGT + GRAFT which: selection: graft)


@register_method("graft")
class GRAFT(Method):
    """Gated replacement of answer-failed groups with peer trajectories: the base preset as it is."""

    preset = Method.preset
    source = "the GRAFT paper (Sections 4.1-4.2, Table 2, Appendix G): paper text"

    @classmethod
    def with_stored_peers(cls, cfg: MethodConfig) -> None:
        cfg.balance = False  # one direction only: balancing is inactive (Section 6.2)


__getattr__ = removed_names(
    __name__,
    {
        "PooledExchange": "removed in 0.1.0 (methods are presets of parts): method.composition: pool (or pooled: true)",
    },
)
