"""The minibatch objective of a receiver (Section 4.2): the method's loss part (``method.loss``,
:mod:`graft_rl.methods.losses`) aggregated over the minibatch as it declares, plus ``kl_coef`` x the KL
to the initial policy and the auxiliary loss part (``method.aux_loss``, SGT's NLL).

:meth:`Objective.minibatch` returns a closure that :meth:`Policy.update` calls once per forward pass
(a micro-batch of the minibatch's rows); each call returns the micro-batch's *contribution* to the
minibatch loss, so accumulating gradients over micro-batches reproduces the minibatch's token mean
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.methods.config import MethodConfig
from graft_rl.methods.losses import LossContext
from graft_rl.methods.registry import AUX_LOSSES, LOSSES

__all__ = ["Minibatch", "Objective", "RowTensors"]


class RowTensors:
    """Per-row tensors of a receiver batch (``M`` rows, ``T`` tokens), indexed by row.

    ``old``: the receiver's log-probs before the step's first update (pi_old of the ratio). Rows
    flagged in ``old_is_current`` were not scored beforehand: they are trained in the step's first
    update, where pi_old *is* the current policy, so their pi_old is the forward pass's own
    log-probs, detached (ratio exactly 1, as verl and TRL do on-policy); see :meth:`old_for`.
    ``src_mean``: the source's mean generation log-prob of each row; ``extras``: per-row numbers a
    method's objective reads, by name (``Row.extras``, e.g. HACPO's ``kappa``).
    """

    def __init__(
        self,
        old: torch.Tensor,
        mask: torch.Tensor,
        adv,
        weight,
        is_peer,
        include,
        is_aux,
        src_mean,
        ref: torch.Tensor | None = None,
        old_is_current=None,
        extras: dict | None = None,
    ):
        self.old, self.mask, self.ref = old, mask, ref
        self.old_is_current = (
            torch.zeros(len(mask), dtype=torch.bool)
            if old_is_current is None
            else torch.as_tensor(old_is_current, dtype=torch.bool)
        )
        self.adv = torch.as_tensor(adv, dtype=torch.float32)
        self.weight = torch.as_tensor(weight, dtype=torch.float32)
        self.is_peer = torch.as_tensor(is_peer, dtype=torch.bool)
        self.include = torch.as_tensor(include, dtype=torch.bool)
        self.is_aux = torch.as_tensor(is_aux, dtype=torch.bool)
        self.src_mean = torch.as_tensor(src_mean, dtype=torch.float32)
        self.extras = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in (extras or {}).items()}

    def old_for(self, rows: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """pi_old log-probs ``[m, T_m]`` of ``rows`` for a micro-batch whose current log-probs are ``lp``."""
        old = self.old[rows, : lp.shape[1]].to(lp.device)
        current = self.old_is_current[rows].to(lp.device)
        return torch.where(current[:, None], lp.detach(), old) if bool(current.any()) else old

    def rl_mask(self, rows) -> torch.Tensor:
        """Tokens of the policy-gradient term: included rows that are not auxiliary targets."""
        keep = (self.include & ~self.is_aux)[rows].float()
        return self.mask[rows] * keep[:, None]

    def aux_mask(self, rows) -> torch.Tensor:
        """Tokens of auxiliary targets (SGT's NLL) that are included: a peer response cut at the
        receiver's budget leaves the auxiliary loss as it leaves the policy-gradient term."""
        keep = (self.include & self.is_aux)[rows].float()
        return self.mask[rows] * keep[:, None]


@dataclass
class Minibatch:
    """What every micro-batch of one minibatch shares: its rows, the step and update index, and the
    minibatch-wide normalisers: ``rl_tokens`` (its policy-gradient tokens), ``responses`` (its included,
    non-auxiliary responses) and ``aux_tokens`` (its auxiliary targets' tokens)."""

    t: RowTensors
    rows: torch.Tensor
    step: int
    update_index: int
    rl_tokens: float
    responses: float = 0.0
    aux_tokens: float = 0.0


def _clip_counts(lp, old, adv, mask, eps_low, eps_high) -> tuple[float, float]:
    """(clipped tokens, tokens) of the token-clipped surrogate, for self/peer diagnostics (Table 9)."""
    with torch.no_grad():
        _, st = algo.policy_loss(lp.detach(), old, adv, mask, None, eps_low, eps_high)
        return float(st["clip_frac"] * st["num_active_tokens"]), float(st["num_active_tokens"])


class Objective:
    """A receiver's minibatch loss from its parts: ``loss`` (a :func:`~graft_rl.methods.losses.register_loss`
    entry; default ``cfg.loss``) and ``aux_loss`` (default ``cfg.aux_loss``)."""

    def __init__(self, cfg: MethodConfig, loss=None, aux_loss=None):
        self.cfg = cfg
        self.loss = loss if loss is not None else LOSSES.get(cfg.part_name("loss"))
        self.aux_loss = aux_loss if aux_loss is not None else AUX_LOSSES.get(cfg.part_name("aux_loss"))

    def minibatch(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int = 0):
        """A ``loss_fn(lp, mask, micro_rows)`` closure for :meth:`Policy.update`; ``micro_rows`` index ``mb_rows``.

        ``update_index``: this minibatch's position among the step's updates (0, 1, ...)."""
        mb = self.prepare(t, mb_rows, step, update_index)

        def fn(lp, mask, micro):
            return self.micro(lp, mb, mb.rows[torch.tensor(micro)])

        return fn

    def prepare(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int) -> Minibatch:
        """The minibatch-wide quantities (computed once, before its micro-batches)."""
        responses = float(sum(1 for r in mb_rows if bool(t.include[r]) and not bool(t.is_aux[r])))
        return Minibatch(
            t,
            torch.tensor(mb_rows),
            step,
            update_index,
            float(t.rl_mask(mb_rows).sum()),
            responses,
            float(t.aux_mask(mb_rows).sum()),
        )

    def context(self, mb: Minibatch, rows: torch.Tensor, device) -> LossContext:
        """The loss's per-row inputs for ``rows``."""
        t = mb.t
        return LossContext(
            self.cfg,
            t.adv[rows].to(device),
            t.weight[rows].to(device),
            t.is_peer[rows].to(device),
            t.src_mean[rows].to(device),
            {k: v[rows].to(device) for k, v in t.extras.items()},
            mb.step,
            mb.update_index,
        )

    def micro(self, lp: torch.Tensor, mb: Minibatch, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One micro-batch's ``(loss contribution, stats)``; ``lp``: its current log-probs ``[m, T]``."""
        if getattr(self.loss, "aggregation", "token_mean") == "response_mean":
            return self._per_response(lp, mb, rows)
        t = mb.t
        T = lp.shape[1]
        old = t.old_for(rows, lp)
        rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
        loss, stats = self.loss(lp, old, rl_mask, self.context(mb, rows, lp.device))
        total = loss * (float(rl_mask.sum()) / mb.rl_tokens) if mb.rl_tokens > 0 else lp.sum() * 0.0
        total = self.with_kl(lp, mb, rows, rl_mask, total, stats)
        total = self.with_aux(lp, mb, rows, total)
        # self vs peer clipping (paper Appendix H, Table 9): counts, summed by the worker
        adv = t.adv[rows].to(lp.device)
        peer = t.is_peer[rows].to(lp.device)
        for name, sel in (("self", ~peer), ("peer", peer)):
            m = rl_mask * sel.float()[:, None]
            c, n = _clip_counts(lp, old, adv, m, self.cfg.eps_low, self.cfg.eps_high)
            stats[f"clipped_tokens_{name}"] = c
            stats[f"tokens_{name}"] = n
        return total, stats

    def _per_response(self, lp, mb: Minibatch, rows) -> tuple[torch.Tensor, dict]:
        """A ``response_mean`` loss: a micro-batch contributes ``its responses / the minibatch's``
        (rows without policy-gradient tokens left out)."""
        t = mb.t
        T = lp.shape[1]
        rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
        valid = rl_mask.sum(dim=1) > 0
        if not bool(valid.any()):
            return lp.sum() * 0.0, {}
        ctx = self.context(mb, rows, lp.device)
        own = valid & ~ctx.is_peer
        for key in ("adv", "weight", "is_peer", "src_mean"):
            setattr(ctx, key, getattr(ctx, key)[valid])
        ctx.extras = {k: v[valid] for k, v in ctx.extras.items()}
        loss, st = self.loss(lp[valid], t.old_for(rows, lp)[valid], rl_mask[valid], ctx)
        # self / peer clipped-token fractions (Table 9 diagnostics): a clipped sequence ratio clips all its tokens
        tokens = rl_mask[valid].sum(1)
        clipped = st.pop("clipped_seq").to(tokens.dtype)
        stats = {k: float(v) for k, v in st.items()}
        for name, sel in (("self", ~ctx.is_peer), ("peer", ctx.is_peer)):
            stats[f"clipped_tokens_{name}"] = float((clipped * tokens * sel.to(tokens.dtype)).sum())
            stats[f"tokens_{name}"] = float((tokens * sel.to(tokens.dtype)).sum())
        total = loss * (float(valid.sum()) / max(mb.responses, 1.0))
        if getattr(self.loss, "kl", "token_mean") == "own_response_mean":
            total = self._own_response_kl(lp, mb, rows, rl_mask, own, total, stats)
        else:
            total = self.with_kl(lp, mb, rows, rl_mask, total, stats)
        return self.with_aux(lp, mb, rows, total), stats

    def with_kl(self, lp, mb: Minibatch, rows, rl_mask, total, stats: dict):
        """``total`` plus ``kl_coef`` x the token-mean k3 KL to the reference over the minibatch's
        policy-gradient tokens (this micro-batch's share)."""
        t = mb.t
        if self.cfg.kl_coef <= 0 or t.ref is None or mb.rl_tokens <= 0 or float(rl_mask.sum()) == 0:
            return total
        ref = t.ref[rows, : lp.shape[1]].to(lp.device)
        kl = algo.reference_kl(lp, ref, rl_mask)
        stats["kl_ref"] = float(kl.detach())
        return total + self.cfg.kl_coef * kl * (float(rl_mask.sum()) / mb.rl_tokens)

    def _own_response_kl(self, lp, mb: Minibatch, rows, rl_mask, own, total, stats: dict):
        """HACPO's recipe's KL: ``low_var_kl`` per own response (token mean), summed and divided by the
        minibatch's responses (verl's ``seq-mean-token-mean`` with ``global_batch_size``)."""
        t = mb.t
        if self.cfg.kl_coef <= 0 or t.ref is None or not bool(own.any()):
            return total
        ref = t.ref[rows, : lp.shape[1]].to(lp.device)
        seq_kl = algo.sequence_reference_kl(lp[own], ref[own], rl_mask[own])
        stats["kl_ref"] = float(seq_kl.detach().mean())
        return total + self.cfg.kl_coef * seq_kl.sum() / max(mb.responses, 1.0)

    def with_aux(self, lp, mb: Minibatch, rows, total):
        """``total`` plus the auxiliary loss over this micro-batch's auxiliary targets (its token share)."""
        if mb.aux_tokens <= 0:
            return total
        aux_mask = mb.t.aux_mask(rows)[:, : lp.shape[1]].to(lp.device)
        if aux_mask.sum() <= 0:
            return total
        aux = self.aux_loss(lp, aux_mask, self.cfg)
        return total if aux is None else total + aux * (float(aux_mask.sum()) / mb.aux_tokens)
