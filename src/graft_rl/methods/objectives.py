"""The minibatch objective of a receiver (Section 4.2): the method's loss part (``method.loss``,
:mod:`graft_rl.methods.losses`) aggregated over the minibatch as it declares, plus ``kl_coef`` x the KL
to the initial policy and the auxiliary loss part (``method.aux_loss``, SGT's NLL); the engine-trainer
gap of own tokens and the correction part's weights of them (``method.correction``,
:mod:`graft_rl.methods.corrections`).

The receiver's update (:func:`graft_rl.engine.update.receiver_update`) calls, for each forward pass of a
minibatch, :meth:`Objective.engine_gap` and then :meth:`Objective.contribution`: the pass's share of the
minibatch loss (so accumulating gradients over passes gives the minibatch's mean exactly) and its
:class:`~graft_rl.stats.StepStats` (sums and counts only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.errors import removed_names
from graft_rl.methods.config import MethodConfig
from graft_rl.methods.corrections import gap
from graft_rl.methods.losses import LossContext
from graft_rl.methods.registry import AUX_LOSSES, CORRECTIONS, LOSSES, CorrectionPart, LossPart, Part
from graft_rl.stats import StepStats

__all__ = ["Normalisers", "Objective", "RowTensors"]


class RowTensors:
    """Per-row tensors of a receiver batch (``M`` rows, ``T`` tokens), indexed by row.

    ``old``: the receiver's log-probs before the step's first update (pi_old of the ratio). Rows
    flagged in ``old_is_current`` had no pi_old computed beforehand: they are trained in the step's first
    update, where pi_old *is* the current policy, so their pi_old is the forward pass's own
    log-probs, detached (ratio exactly 1, as verl and TRL do on-policy: TRL's ``old or logps.detach()``).
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


@dataclass(frozen=True)
class Normalisers:
    """A minibatch's denominators, counted over the whole minibatch before its passes: ``rl_tokens`` (its
    policy-gradient tokens: J's 1 / sum_j |o_j|, gated responses included, Section 4.2), ``responses`` (its
    included, non-auxiliary responses: a ``response_mean`` loss's) and ``aux_tokens`` (its auxiliary
    targets' tokens)."""

    rl_tokens: float
    responses: float
    aux_tokens: float


class Objective:
    """A receiver's minibatch loss from its parts: ``loss`` (a :func:`~graft_rl.methods.losses.register_loss`
    entry; default ``cfg.loss``), ``aux_loss`` (default ``cfg.aux_loss``) and ``correction``."""

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

    @staticmethod
    def normalisers(t: RowTensors, mb_rows: list[int]) -> Normalisers:
        """The :class:`Normalisers` of the minibatch of batch rows ``mb_rows``."""
        responses = float(sum(1 for r in mb_rows if bool(t.include[r]) and not bool(t.is_aux[r])))
        return Normalisers(float(t.rl_mask(mb_rows).sum()), responses, float(t.aux_mask(mb_rows).sum()))

    def context(
        self,
        t: RowTensors,
        rows: torch.Tensor,
        device,
        correction: torch.Tensor | None = None,
        T: int | None = None,
        step: int = 0,
        update_index: int = 0,
    ) -> LossContext:
        """The loss's per-row inputs for ``rows``; ``correction``: the correction's token weights, if any;
        ``T``: the pass's token width (the sampler's log-probs are cut to it)."""
        return LossContext(
            self.cfg,
            t.adv[rows].to(device),
            t.weight[rows].to(device),
            t.is_peer[rows].to(device),
            t.src_mean[rows].to(device),
            {k: v[rows].to(device) for k, v in t.extras.items()},
            step,
            update_index,
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

    def engine_gap(self, t: RowTensors, rows: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor | None, StepStats]:
        """The gap between the engine's log-probs of these rows' own tokens and ``old`` (pi_old), and the
        correction's weights of them (:func:`~graft_rl.methods.corrections.gap`): the tokens of
        :meth:`RowTensors.mu_mask`. Nothing where mu is not comparable (top-p sampling)."""
        if t.mu is None:
            return None, StepStats()
        T = old.shape[1]
        mask = t.mu_mask(rows)[:, :T].to(old.device)
        weight, sums = gap(old, t.mu[rows, :T].to(old.device), mask, self.correction, self.cfg)
        return (None if weight is None else weight.to(old.device)), sums

    def contribution(
        self,
        lp: torch.Tensor,
        old: torch.Tensor,
        t: RowTensors,
        rows: torch.Tensor,
        norm: Normalisers,
        correction: torch.Tensor | None = None,
        step: int = 0,
        update_index: int = 0,
    ) -> tuple[torch.Tensor, StepStats]:
        """One pass's ``(share of the minibatch loss, stats)``; ``lp``: its current log-probs ``[m, T]``,
        ``old``: their pi_old, ``correction``: the correction's token weights (:meth:`engine_gap`).

        Each term is its mean over this pass (the loss part's over its tokens, or over its responses for a
        ``response_mean`` loss, rows without tokens left out; the KL's; the auxiliary loss's) and enters
        times this pass's share of the minibatch's count (:class:`Normalisers`): the one place the
        minibatch normaliser is applied. The stats are sums and counts: the loss's self/peer clipped and
        trained tokens (:meth:`clip_counts`), the KL's sum and count, the loss part's own sums."""
        T = lp.shape[1]
        rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
        ctx = self.context(t, rows, lp.device, correction, T, step, update_index)
        stats = StepStats()
        own = ~ctx.is_peer
        if self.loss.aggregation == "response_mean":  # a mean over responses: rows without tokens left out
            valid = rl_mask.sum(dim=1) > 0
            own = valid & own
            lp_, old_, mask_, ctx_ = lp[valid], old[valid], rl_mask[valid], ctx.rows(valid)
            n, of = float(valid.sum()), max(norm.responses, 1.0)
        else:  # a mean over tokens
            lp_, old_, mask_, ctx_ = lp, old, rl_mask, ctx
            n, of = float(rl_mask.sum()), norm.rl_tokens
        total = lp.sum() * 0.0
        if n > 0:
            mean, st = self.loss(lp_, old_, mask_, ctx_)
            stats.merge(self.clip_counts(st, mask_, ctx_))
            # the minibatch normaliser, here and nowhere else: this pass's mean times its share of the count
            total = mean * (n / of)
        total = self._with_kl(total, lp, t, rows, rl_mask, own, norm, stats)
        aux_mask = t.aux_mask(rows)[:, :T].to(lp.device)
        if norm.aux_tokens > 0 and aux_mask.sum() > 0:
            aux = self.aux_loss(lp, aux_mask, self.cfg)
            total = total if aux is None else total + aux * (float(aux_mask.sum()) / norm.aux_tokens)
        return total, stats

    def _with_kl(self, total, lp, t: RowTensors, rows, rl_mask, own, norm: Normalisers, stats: StepStats):
        """``total`` plus ``kl_coef`` x the KL to the reference, as the loss declares: ``token_mean`` (k3 over the
        minibatch's policy-gradient tokens; this pass's token share) or ``own_response_mean`` (HACPO's recipe:
        ``low_var_kl`` per own response, summed and divided by the minibatch's responses, verl's
        ``seq-mean-token-mean`` with ``global_batch_size``). Stats: ``kl_ref`` (sum) and ``kl_ref_count``."""
        if self.cfg.kl_coef <= 0 or t.ref is None:
            return total
        ref = t.ref[rows, : lp.shape[1]].to(lp.device)
        if self.loss.kl == "own_response_mean":
            if not bool(own.any()):
                return total
            seq_kl = algo.sequence_reference_kl(lp[own], ref[own], rl_mask[own])
            stats.add("kl_ref", float(seq_kl.detach().sum()))
            stats.add("kl_ref_count", float(own.sum()))
            return total + self.cfg.kl_coef * seq_kl.sum() / max(norm.responses, 1.0)
        tokens = float(rl_mask.sum())
        if norm.rl_tokens <= 0 or tokens == 0:
            return total
        kl = algo.reference_kl(lp, ref, rl_mask)
        stats.add("kl_ref", float(kl.detach()) * tokens)
        stats.add("kl_ref_count", tokens)
        return total + self.cfg.kl_coef * kl * (tokens / norm.rl_tokens)

    def clip_counts(self, st: dict, mask: torch.Tensor, ctx: LossContext) -> StepStats:
        """The loss's own sums (its ``X_total`` / ``X_peak`` entries) and its self/peer clipped and trained
        token counts (paper Appendix H, Table 9) from what it says it clipped (``clipped``: ``[m, T]`` tokens
        or ``[m]`` responses), over the tokens it trains: ``mask``'s, of rows whose weight is non-zero where
        the loss applies the weight (a gate-rejected peer response is not trained, so neither clipped nor
        counted), of tokens its correction does not weight 0, and of tokens the loss says it trains
        (``trained``: ``[m, T]``, optional; F-TIS leaves out the responses it filters). A loss declared
        ``clips=False`` clipped nothing; one that clips and says nothing gets no counts."""
        st = dict(st)
        own_trained = st.pop("trained", None)
        clipped = st.pop("clipped", None)
        if clipped is None:
            clipped = st.pop("clipped_seq", None)  # deprecated name of a [m] mask
        stats = StepStats.from_loss_stats(st)
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
            stats.add(f"clipped_tokens_{name}", float((hit * sel).sum()))
            stats.add(f"tokens_{name}", float((trained * sel).sum()))
        return stats


__getattr__ = removed_names(
    __name__,
    {
        "Minibatch": "removed in 0.3.0: graft_rl.engine.update.receiver_update holds the minibatch loop "
        "(Objective.normalisers, Objective.engine_gap, Objective.contribution per forward pass)",
    },
)
