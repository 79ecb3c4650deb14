"""The minibatch objective of a receiver (Section 4.2): the method's loss part (``method.loss``,
:mod:`graft_rl.methods.losses`) aggregated over the minibatch as it declares, plus ``kl_coef`` x the KL
to the initial policy and the auxiliary loss part (``method.aux_loss``, SGT's NLL). Each micro-batch
also measures the engine-trainer gap of its own tokens and applies the correction part
(``method.correction``, :mod:`graft_rl.methods.corrections`).

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
from graft_rl.methods.corrections import gap
from graft_rl.methods.losses import LossContext
from graft_rl.methods.registry import AUX_LOSSES, CORRECTIONS, LOSSES, CorrectionPart, LossPart, Part

__all__ = ["Minibatch", "Objective", "RowTensors"]


class RowTensors:
    """Per-row tensors of a receiver batch (``M`` rows, ``T`` tokens), indexed by row.

    ``old``: the receiver's log-probs before the step's first update (pi_old of the ratio). Rows
    flagged in ``old_is_current`` had no pi_old computed beforehand: they are trained in the step's first
    update, where pi_old *is* the current policy, so their pi_old is the forward pass's own
    log-probs, detached (ratio exactly 1, as verl and TRL do on-policy); see :meth:`old_for`.
    ``src_mean``: the source's mean generation log-prob of each row; ``extras``: per-row numbers a
    method's objective reads, by name (``Row.extras``, e.g. HACPO's ``kappa``). ``mu``: the engine's
    log-prob of each own token (``[M, T]``), where ``has_mu`` (``[M]``) says a row has them; both None
    where the engine's distribution is not the trainer's (top-p sampling).
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
        mu: torch.Tensor | None = None,
        has_mu=None,
    ):
        self.old, self.mask, self.ref, self.mu = old, mask, ref, mu
        self.has_mu = (
            torch.zeros(len(mask), dtype=torch.bool) if has_mu is None else torch.as_tensor(has_mu, dtype=torch.bool)
        )
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

    def mu_mask(self, rows) -> torch.Tensor:
        """Own tokens of the policy-gradient term with an engine log-prob (where the gap is measured; a
        peer row's log-probs, kept for a loss with ``peer_tokens``, are another policy's)."""
        return self.rl_mask(rows) * (self.has_mu & ~self.is_peer)[rows].float()[:, None]

    def rl_mask(self, rows) -> torch.Tensor:
        """Tokens of the policy-gradient term: included rows that are not auxiliary targets."""
        keep = (self.include & ~self.is_aux)[rows].float()
        return self.mask[rows] * keep[:, None]

    def aux_mask(self, rows) -> torch.Tensor:
        """Tokens of auxiliary targets (SGT's NLL) that are included: a peer response cut at the
        receiver's budget leaves the auxiliary loss as it leaves the policy-gradient term."""
        keep = (self.include & self.is_aux)[rows].float()
        return self.mask[rows] * keep[:, None]


class Objective:
    """A receiver's minibatch loss from its parts: ``loss`` (a :func:`~graft_rl.methods.losses.register_loss`
    entry; default ``cfg.loss``) and ``aux_loss`` (default ``cfg.aux_loss``)."""

    def __init__(
        self,
        cfg: MethodConfig,
        loss: LossPart | None = None,
        aux_loss: Part | None = None,
        correction: CorrectionPart | None = None,
    ):
        self.cfg = cfg
        self.loss: LossPart = loss if loss is not None else LOSSES.get(cfg.part_name("loss"))
        self.aux_loss: Part = aux_loss if aux_loss is not None else AUX_LOSSES.get(cfg.part_name("aux_loss"))
        self.correction: CorrectionPart = (
            correction if correction is not None else CORRECTIONS.get(cfg.part_name("correction"))
        )

    def minibatch(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int = 0) -> Minibatch:
        """The :class:`Minibatch` of batch rows ``mb_rows``, its minibatch-wide quantities computed once,
        before its micro-batches; ``update_index``: its position among the step's updates (0, 1, ...)."""
        responses = float(sum(1 for r in mb_rows if bool(t.include[r]) and not bool(t.is_aux[r])))
        return Minibatch(
            self,
            t,
            list(mb_rows),
            step,
            update_index,
            float(t.rl_mask(mb_rows).sum()),
            responses,
            float(t.aux_mask(mb_rows).sum()),
        )

    def context(
        self, mb: Minibatch, rows: torch.Tensor, device, correction: torch.Tensor | None = None, T: int | None = None
    ) -> LossContext:
        """The loss's per-row inputs for ``rows``; ``correction``: the correction's token weights, if any;
        ``T``: the micro-batch's token width (the sampler's log-probs are cut to it)."""
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
            correction,
            self._mu(t, rows, device, T) if self.loss.peer_tokens else None,
        )

    @staticmethod
    def _mu(t: RowTensors, rows: torch.Tensor, device, T: int | None) -> torch.Tensor | None:
        """The sampler's log-probs of these rows' tokens ``[m, T]`` (0 where a row has none)."""
        if t.mu is None:
            return None
        mu = t.mu[rows] * t.has_mu[rows].float()[:, None]
        return (mu if T is None else mu[:, :T]).to(device)

    def engine_gap(self, mb: Minibatch, rows: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
        """The gap between the engine's log-probs of these rows' own tokens and ``old`` (pi_old, from this
        very forward pass for rows of the first update), and the correction's weights of them
        (:func:`~graft_rl.methods.corrections.gap`); nothing where mu is not comparable (top-p sampling)."""
        t = mb.t
        if t.mu is None:
            return None, {}
        T = old.shape[1]
        mask = t.mu_mask(rows)[:, :T].to(old.device)
        return gap(old, t.mu[rows, :T].to(old.device), mask, self.correction, self.cfg)

    def micro(self, lp: torch.Tensor, mb: Minibatch, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One micro-batch's ``(loss contribution, stats)``; ``lp``: its current log-probs ``[m, T]``.

        The loss is weighed by the micro-batch's share of the minibatch as it declares: a ``token_mean``
        loss by its policy-gradient tokens, a ``response_mean`` one by its responses (rows without
        tokens left out of it). Then the KL term and the auxiliary loss; the stats carry the loss's own
        self/peer clipped-token counts (:meth:`clip_counts`)."""
        t = mb.t
        T = lp.shape[1]
        rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
        old = t.old_for(rows, lp)
        correction, gap_totals = self.engine_gap(mb, rows, old)
        ctx = self.context(mb, rows, lp.device, None if correction is None else correction.to(lp.device), T)
        if self.loss.aggregation == "response_mean":
            valid = rl_mask.sum(dim=1) > 0
            if not bool(valid.any()):
                return lp.sum() * 0.0, gap_totals
            own = valid & ~ctx.is_peer
            ctx = ctx.rows(valid)
            loss, st = self.loss(lp[valid], old[valid], rl_mask[valid], ctx)
            stats = {**self.clip_counts(st, rl_mask[valid], ctx), **gap_totals}
            total = loss * (float(valid.sum()) / max(mb.responses, 1.0))
            if self.loss.kl == "own_response_mean":
                total = self._own_response_kl(lp, mb, rows, rl_mask, own, total, stats)
            else:
                total = self.with_kl(lp, mb, rows, rl_mask, total, stats)
            return self.with_aux(lp, mb, rows, total), stats
        loss, st = self.loss(lp, old, rl_mask, ctx)
        stats = {**self.clip_counts(st, rl_mask, ctx), **gap_totals}
        total = loss * (float(rl_mask.sum()) / mb.rl_tokens) if mb.rl_tokens > 0 else lp.sum() * 0.0
        total = self.with_kl(lp, mb, rows, rl_mask, total, stats)
        return self.with_aux(lp, mb, rows, total), stats

    def clip_counts(self, st: dict, mask: torch.Tensor, ctx: LossContext) -> dict:
        """The loss's stats as floats, with its self/peer clipped-token counts (paper Appendix H, Table 9)
        from what it says it clipped (``clipped``: ``[m, T]`` tokens or ``[m]`` responses), over the
        tokens it trains: ``mask``'s, of rows whose weight is non-zero where the loss applies the weight
        (a gate-rejected peer response is not trained, so neither clipped nor counted), and of tokens the
        loss says it trains (``trained``: ``[m, T]``, optional; F-TIS leaves out the responses it filters).
        A loss declared ``clips=False`` clipped nothing; one that clips and says nothing gets no counts.
        The worker sums them over updates."""
        st = dict(st)
        own_trained = st.pop("trained", None)
        clipped = st.pop("clipped", None)
        if clipped is None:
            clipped = st.pop("clipped_seq", None)  # deprecated name of a [m] mask
        stats = {k: float(v) for k, v in st.items()}
        if clipped is None and self.loss.clips:
            return stats
        trained = mask
        if self.loss.weighted:  # a loss that ignores the weight trains every row
            trained = mask * (ctx.weight != 0).to(mask.dtype)[:, None]
        if ctx.correction is not None:  # nor does it train a token its correction masked out
            trained = trained * (ctx.correction[:, : trained.shape[1]] != 0).to(mask.dtype)
        if own_trained is not None:
            trained = trained * own_trained[:, : trained.shape[1]].to(mask.dtype)
        if clipped is None:
            hit = torch.zeros_like(trained)
        elif clipped.dim() == 1:
            hit = trained * clipped.to(trained.dtype)[:, None]
        else:
            hit = trained * clipped[:, : trained.shape[1]].to(trained.dtype)
        peer = ctx.is_peer.to(trained.dtype)[:, None]
        for name, sel in (("self", 1.0 - peer), ("peer", peer)):
            stats[f"clipped_tokens_{name}"] = float((hit * sel).sum())
            stats[f"tokens_{name}"] = float((trained * sel).sum())
        return stats

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


@dataclass
class Minibatch:
    """One minibatch of a receiver's step: its ``rows`` (batch row indices, in the order the update gets
    them), the step and update index, and the minibatch-wide normalisers: ``rl_tokens`` (its
    policy-gradient tokens), ``responses`` (its included, non-auxiliary responses) and ``aux_tokens``
    (its auxiliary targets' tokens). :meth:`loss` is the ``loss_fn`` of :meth:`Policy.update`."""

    objective: Objective
    t: RowTensors
    rows: list[int]
    step: int
    update_index: int
    rl_tokens: float
    responses: float = 0.0
    aux_tokens: float = 0.0

    def batch_rows(self, micro: list[int]) -> torch.Tensor:
        """The batch rows of a micro-batch; ``micro``: positions in this minibatch, as
        :meth:`Policy.update` passes them (its passes are cut from ``batch.select(rows)``)."""
        return torch.tensor([self.rows[i] for i in micro])

    def loss(self, lp: torch.Tensor, mask: torch.Tensor, micro: list[int]) -> tuple[torch.Tensor, dict]:
        """A micro-batch's contribution to this minibatch's loss, and its stats (:meth:`Objective.micro`)."""
        return self.objective.micro(lp, self, self.batch_rows(micro))

    __call__ = loss
