"""SGT (Appendix B): GRPO on the receiver's own groups plus, on each prompt where it fails and its
peer succeeds, a supervised NLL term on one correct peer response (weight ``sgt_coef``).
"SGT + GRAFT which" is ``selection: graft``; "SGT + GRAFT how" is GRAFT with ``selection: sgt``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.methods.base import Method, check_range, register_method
from graft_rl.methods.exchange import Exchange, rows_of, successes
from graft_rl.methods.objectives import Minibatch, Objective, RowTensors

__all__ = ["SGT", "SGTExchange", "SGTObjective"]


class SGTExchange(Exchange):
    """The own group stays; one uniformly drawn correct peer response per selected prompt is an
    auxiliary NLL target."""

    def compose(self, q, own_group, peer, groups, adv, gen, gi):
        own_rows = rows_of(own_group, gi, False, adv[own_group.policy][q].tolist())
        if peer is None:
            yield own_rows, False
            return
        pg = groups[peer][q]
        idx = int(algo.sgt_select(torch.tensor([successes(pg)]), torch.tensor([True]), gen)[0])  # a correct one
        if idx < 0:
            yield own_rows, False
            return
        aux = rows_of(pg, gi, True, [0.0] * pg.n)[idx]
        aux.is_aux = True
        # the NLL target travels with its prompt's own group, in ordinary minibatch order: SGT is
        # "GRPO + a supervised NLL term", not GRAFT's peer-last packing (Appendix B)
        yield own_rows + [aux], False


@dataclass
class _SGTMinibatch(Minibatch):
    aux_tokens: float = 0.0  # the minibatch's auxiliary-target tokens (the NLL's token mean)


class SGTObjective(Objective):
    """The clipped token loss on own responses plus ``sgt_coef`` x the token-mean NLL of the targets."""

    def prepare(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int) -> Minibatch:
        mb = super().prepare(t, mb_rows, step, update_index)
        return _SGTMinibatch(**vars(mb), aux_tokens=float(t.aux_mask(mb_rows).sum()))

    def extra_loss(self, lp, mb, rows, total):
        aux_mask = mb.t.aux_mask(rows)[:, : lp.shape[1]].to(lp.device)
        if mb.aux_tokens > 0 and aux_mask.sum() > 0:
            total = total + algo.sgt_nll(lp, aux_mask, self.cfg.sgt_coef) * (float(aux_mask.sum()) / mb.aux_tokens)
        return total


@register_method("sgt")
class SGT(Method):
    @dataclass
    class Params:
        sgt_coef: float = 0.1  # SGT's lambda: weight of the auxiliary NLL term

    default_selection = "sgt"

    @classmethod
    def check(cls, cfg) -> None:
        check_range(cfg, {"sgt_coef": (0.0, math.inf, True)})

    def exchange(self):
        return SGTExchange(self.cfg)

    def objective(self):
        return SGTObjective(self.cfg)
