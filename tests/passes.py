"""One forward pass of a minibatch through a receiver's objective, as
:func:`graft_rl.engine.update.receiver_update` runs each pass: pi_old, the gap and its correction, the
pass's share of the minibatch loss; for tests of the objective without a model."""

from __future__ import annotations

import torch

from graft_rl.methods.objectives import Objective, RowTensors


def one_pass(obj: Objective, t: RowTensors, rows: list[int], lp: torch.Tensor, step: int = 1, update_index: int = 0):
    """``(loss, stats)`` of a minibatch of batch ``rows`` taken in one pass; ``stats``: the step statistics
    flat (a sum by its name, a maximum as ``NAME_peak``)."""
    idx = torch.tensor(rows)
    scored = ~t.old_is_current[idx]
    old = torch.where(scored[:, None], t.old[idx, : lp.shape[1]], lp.detach())
    correction, gap = obj.engine_gap(t, idx, old)
    loss, stats = obj.contribution(lp, old, t, idx, obj.normalisers(t, rows), correction, step, update_index)
    stats.merge(gap)
    return loss, {**stats.sums, **{f"{k}_peak": v for k, v in stats.peaks.items()}}
