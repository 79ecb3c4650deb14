"""The receiver's update (Section 4.2, objective J), in one function: one optimiser step per minibatch in
the method's order (peer groups last), each over the forward passes its tokens are cut into, and the
step's statistics as sums, counts and maxima (:mod:`graft_rl.stats`); the metrics they make are formed
once, at the end (:func:`step_metrics`; docs/metrics.md). docs/design.md walks one peer response
through it."""

from __future__ import annotations

import torch

from graft_rl.methods.objectives import Objective, RowTensors
from graft_rl.policy import TokenBatch
from graft_rl.stats import StepStats

__all__ = ["receiver_update", "step_metrics"]


def receiver_update(
    policy,
    objective: Objective,
    tokens: TokenBatch,
    t: RowTensors,
    order: list[list[int]],
    step: int,
    stop_on_nonfinite: bool = False,
) -> StepStats:
    """Train ``policy`` on its receiver batch: ``tokens`` (the rows in the policy's own tokens), ``t`` (their
    advantages, weights, pi_old where scored before the step, engine log-probs), ``order`` (minibatches of
    batch rows). Returns the step's :class:`StepStats`, summed over the ranks of a sharded policy.

    Per pass, in this order: pi_old (scored before the step's first update, or for a row of that first
    update this pass's own log-probs, detached: the same weights, so one forward pass fewer, as TRL's
    ``old or logps.detach()``); the engine-trainer gap and the correction's weights; the pass's share of the
    minibatch loss and its backward. The gap is counted for every pass, even of an update that is then
    skipped (a measurement of the engine, not of the update); everything of the loss only for updates
    that were applied. ``stop_on_nonfinite``: stop after the first skipped update (``nonfinite_loss: stop``).
    """
    local: list[StepStats] = []  # per update: this rank's sums
    done: list[StepStats] = []  # per update: numbers already over the ranks (loss, gradient norm, counts)
    for u, mb_rows in enumerate(order):
        norm = objective.normalisers(t, mb_rows)  # the minibatch's tokens and responses, before its passes
        gap, terms = StepStats(), StepStats()
        with policy.optimiser_step() as opt:
            for micro in policy.passes(tokens.select(mb_rows)):  # positions in the minibatch; None: padding
                batch_rows = [mb_rows[i] for i in micro or [0]]
                lp = policy.pass_logprobs(tokens.select(batch_rows))
                rows = torch.tensor(batch_rows)
                if micro is None:  # a sharded rank with no row in this pass: its collectives still run
                    opt.backward(None, lp)
                    continue
                scored = ~t.old_is_current[rows].to(lp.device)
                old = torch.where(scored[:, None], t.old[rows, : lp.shape[1]].to(lp.device), lp.detach())
                correction, measured = objective.engine_gap(t, rows, old)
                gap.merge(measured)
                loss, stats = objective.contribution(lp, old, t, rows, norm, correction, step, u)
                if opt.backward(loss, lp):
                    terms.merge(stats)
            loss, grad_norm, skipped = opt.finish()
        if skipped:
            local.append(gap)
            done.append(StepStats({"minibatches": 1.0, "skipped_updates": 1.0}))
        else:
            local.append(gap.merge(terms))
            done.append(StepStats({"minibatches": 1.0, "updates": 1.0, "loss": loss, "grad_norm": grad_norm}))
        if skipped and stop_on_nonfinite:
            done[-1].add("nonfinite_stop", 1)
            break
    return policy.reduce_stats(StepStats.total(local)).merge(StepStats.total(done))


#: sums the metrics below are formed from; any other sum or maximum is a loss part's own, logged by its name
_FORMED = (
    "clipped_tokens_self",
    "tokens_self",
    "clipped_tokens_peer",
    "tokens_peer",
    "kl_ref",
    "kl_ref_count",
    "loss",
    "grad_norm",
    "updates",
    "skipped_updates",
    "minibatches",
    "nonfinite_stop",
)
_GAP = ("mismatch_", "correction_")


def step_metrics(s: StepStats, with_kl: bool) -> dict:
    """A receiver's metric-line entries from its step's sums: each fraction or mean formed here, once, as
    the step's sum of numerators over its sum of denominators (docs/metrics.md).

    ``clip_frac_self`` / ``clip_frac_peer``: clipped over trained tokens of own / peer responses (Table 9);
    ``kl_ref`` (``with_kl``): the KL to the reference per token (or per own response, HACPO's); ``loss``
    and ``grad_norm``: means over the applied updates; the engine-trainer gap (:func:`gap_metrics`); and a
    loss part's own sums and maxima by name (e.g. F-TIS's ``ftis_filtered``)."""
    updates = s.get("updates")
    out: dict = {
        "clip_frac_self": s.ratio("clipped_tokens_self", "tokens_self") or 0.0,
        "clip_frac_peer": s.ratio("clipped_tokens_peer", "tokens_peer"),
    }
    if with_kl:
        out["kl_ref"] = s.ratio("kl_ref", "kl_ref_count")
    out["loss"] = s.get("loss") / updates if updates else None
    out["grad_norm"] = s.get("grad_norm") / updates if updates else None
    out["skipped_updates"] = int(s.get("skipped_updates"))
    out["minibatches"] = int(s.get("minibatches"))
    out.update(gap_metrics(s))
    out.update({k: v for k, v in s.sums.items() if k not in _FORMED and not k.startswith(_GAP)})
    out.update({k: v for k, v in s.peaks.items() if not k.startswith(_GAP)})
    return out


def gap_metrics(s: StepStats) -> dict:
    """The engine-trainer gap of the step's measured own tokens (:func:`graft_rl.methods.corrections.gap`;
    which tokens: docs/metrics.md): ``mismatch_kl`` (k3 per token), ``mismatch_abs`` (mean |log mu - log
    pi_old|), ``mismatch_max``, ``mismatch_out`` (fraction outside the correction's bounds); with a
    correction, ``correction_weight`` (mean weight) and ``correction_masked`` (fraction weighted 0). None
    where nothing was measured (no own token, or top-p sampling)."""
    if s.get("mismatch_tokens") <= 0:
        return {k: None for k in ("mismatch_kl", "mismatch_abs", "mismatch_max", "mismatch_out")}
    out = {
        "mismatch_kl": s.ratio("mismatch_k3", "mismatch_tokens"),
        "mismatch_abs": s.ratio("mismatch_abs", "mismatch_tokens"),
        "mismatch_max": s.peaks.get("mismatch_abs", 0.0),
        "mismatch_out": s.ratio("mismatch_out", "mismatch_tokens"),
    }
    if "correction_weight" in s.sums:
        out["correction_weight"] = s.ratio("correction_weight", "mismatch_tokens")
        out["correction_masked"] = s.ratio("correction_masked", "mismatch_tokens")
    return out
