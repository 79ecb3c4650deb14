"""GRAFT (Sections 4.1-4.2): a receiver's all-fail group is replaced by its peer's mixed group, with
the source's advantages, a compatibility gate on each peer response, token-level ratio clipping,
balanced exchange and peer-last minibatches. Every Table 2 / Appendix G switch is a common method
key (``graft_rl.methods.base.EXCHANGE_KEYS``); the pooled-groups ablation composes here."""

from __future__ import annotations

import torch

from graft_rl import algo
from graft_rl.methods.base import Method, MethodConfig, register_method
from graft_rl.methods.exchange import Exchange, rows_of

__all__ = ["GRAFT", "PooledExchange"]


class PooledExchange(Exchange):
    """Pooled groups (Appendix G): the selected prompt trains on G_B || G_A with pooled advantages."""

    def compose(self, q, own_group, peer, groups, adv, gen, gi):
        if peer is None:
            yield from super().compose(q, own_group, None, groups, adv, gen, gi)
            return
        pg = groups[peer][q]
        a_own, a_peer = algo.pooled_advantages(
            torch.tensor([own_group.rewards], dtype=torch.float64),
            torch.tensor([pg.rewards], dtype=torch.float64),
            self.cfg.adv_eps,
        )
        yield rows_of(own_group, gi, False, a_own[0].tolist()) + rows_of(pg, gi, True, a_peer[0].tolist()), True


@register_method("graft")
class GRAFT(Method):
    """Gated replacement of answer-failed groups with peer trajectories."""

    @classmethod
    def with_stored_peers(cls, cfg: MethodConfig) -> None:
        cfg.balance = False  # one direction only: balancing is inactive (Section 6.2)

    def exchange(self):
        return PooledExchange(self.cfg) if self.cfg.pooled else Exchange(self.cfg)
