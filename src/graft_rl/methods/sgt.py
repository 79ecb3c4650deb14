"""SGT (Appendix B): GRPO on the receiver's own groups plus, on each prompt where it fails and its
peer succeeds, a supervised NLL term on one correct peer response (weight ``sgt_coef``). Its parts:
the ``sgt`` selection and ``aux_target`` composition (here) and the ``sgt_nll`` auxiliary loss
(:mod:`graft_rl.methods.losses`). "SGT + GRAFT which" is ``selection: graft``; "SGT + GRAFT how" is
GRAFT with ``selection: sgt``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.errors import removed_names
from graft_rl.methods.base import Method, register_method
from graft_rl.methods.config import check_range
from graft_rl.methods.exchange import (
    ComposeContext,
    Selection,
    register_composition,
    register_selection,
    rows_of,
    successes,
)
from graft_rl.methods.losses import register_aux_loss

__all__ = ["SGT", "SGTRule", "sgt_nll"]


@register_selection("sgt")
class SGTRule(Selection):
    """SGT's eligibility: receiver has no success, peer has at least one (no balancing, k_peer = n allowed)."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        return algo.sgt_eligible(k_recv, k_peer)


@register_composition("aux_target", aux=True)
def aux_target(own, peer, ctx: ComposeContext):
    """The own group stays; one uniformly drawn correct peer response per selected prompt is an
    auxiliary NLL target (``Row.is_aux``), outside the policy-gradient term."""
    own_rows = rows_of(own, ctx.gi, False, ctx.own_advantages(own))
    if peer is None:
        return [(own_rows, False)]
    idx = int(algo.sgt_select(torch.tensor([successes(peer)]), torch.tensor([True]), ctx.gen)[0])  # a correct one
    if idx < 0:
        return [(own_rows, False)]
    aux = rows_of(peer, ctx.gi, True, [0.0] * peer.n)[idx]
    aux.is_aux = True
    # the NLL target travels with its prompt's own group, in ordinary minibatch order: SGT is
    # "GRPO + a supervised NLL term", not GRAFT's peer-last packing (Appendix B)
    return [(own_rows + [aux], False)]


@dataclass
class SGTParams:
    sgt_coef: float = 0.1  # SGT's lambda: weight of the auxiliary NLL term


@register_aux_loss("sgt_nll", Params=SGTParams, check=lambda cfg: check_range(cfg, {"sgt_coef": (0.0, math.inf, True)}))
def sgt_nll(lp, aux_mask, cfg):
    """SGT (Appendix B): ``sgt_coef`` x the token-mean NLL of the auxiliary targets (:func:`graft_rl.algo.sgt_nll`)."""
    return algo.sgt_nll(lp, aux_mask, cfg.sgt_coef)


@register_method("sgt")
class SGT(Method):
    preset = {**Method.preset, "selection": "sgt", "composition": "aux_target", "aux_loss": "sgt_nll"}
    source = "SGT as the GRAFT paper specifies it (Appendix B); Mutual RL's third probe (arXiv 2605.07244)"


__getattr__ = removed_names(
    __name__,
    {
        "SGTExchange": "removed in 0.1.0 (methods are presets of parts): selection sgt, composition aux_target",
        "SGTObjective": "removed in 0.1.0 (methods are presets of parts): aux_loss sgt_nll",
    },
)
