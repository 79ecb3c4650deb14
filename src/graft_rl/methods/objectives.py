"""The minibatch objective of a receiver (Section 4.2): the clipped, compatibility-weighted token
loss of GRPO and GRAFT, plus ``kl_coef`` x the KL to the initial policy. Methods with another loss
(LUFFY, HACPO, SGT's auxiliary NLL) subclass :class:`Objective` in their own file.

:meth:`Objective.minibatch` returns a closure that :meth:`Policy.update` calls once per forward pass
(a micro-batch of the minibatch's rows); each call returns the micro-batch's *contribution* to the
minibatch loss, so accumulating gradients over micro-batches reproduces the minibatch's token mean
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from graft_rl import algo
from graft_rl.methods.base import MethodConfig

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
    minibatch-wide normaliser of the loss (``rl_tokens``: its policy-gradient tokens)."""

    t: RowTensors
    rows: torch.Tensor
    step: int
    update_index: int
    rl_tokens: float


def _clip_counts(lp, old, adv, mask, eps_low, eps_high) -> tuple[float, float]:
    """(clipped tokens, tokens) of the token-clipped surrogate, for self/peer diagnostics (Table 9)."""
    with torch.no_grad():
        _, st = algo.policy_loss(lp.detach(), old, adv, mask, None, eps_low, eps_high)
        return float(st["clip_frac"] * st["num_active_tokens"]), float(st["num_active_tokens"])


class Objective:
    """GRPO/GRAFT's loss (Section 4.2; docs/fidelity.md): ``policy_loss`` over the minibatch's token
    mean (every response token counted, gated ones included), plus ``kl_coef`` x the k3 KL."""

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    def minibatch(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int = 0):
        """A ``loss_fn(lp, mask, micro_rows)`` closure for :meth:`Policy.update`; ``micro_rows`` index ``mb_rows``.

        ``update_index``: this minibatch's position among the step's updates (0, 1, ...)."""
        mb = self.prepare(t, mb_rows, step, update_index)

        def fn(lp, mask, micro):
            return self.micro(lp, mb, mb.rows[torch.tensor(micro)])

        return fn

    def prepare(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int) -> Minibatch:
        """The minibatch-wide quantities (computed once, before its micro-batches)."""
        return Minibatch(t, torch.tensor(mb_rows), step, update_index, float(t.rl_mask(mb_rows).sum()))

    def micro(self, lp: torch.Tensor, mb: Minibatch, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One micro-batch's ``(loss contribution, stats)``; ``lp``: its current log-probs ``[m, T]``."""
        t = mb.t
        T = lp.shape[1]
        old = t.old_for(rows, lp)
        rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
        loss, stats = self.rl_loss(lp, old, rl_mask, t, rows, mb.step)
        total = loss * (float(rl_mask.sum()) / mb.rl_tokens) if mb.rl_tokens > 0 else lp.sum() * 0.0
        total = self.with_kl(lp, mb, rows, rl_mask, total, stats)
        total = self.extra_loss(lp, mb, rows, total)
        # self vs peer clipping (paper Appendix H, Table 9): counts, summed by the worker
        adv = t.adv[rows].to(lp.device)
        peer = t.is_peer[rows].to(lp.device)
        for name, sel in (("self", ~peer), ("peer", peer)):
            m = rl_mask * sel.float()[:, None]
            c, n = _clip_counts(lp, old, adv, m, self.cfg.eps_low, self.cfg.eps_high)
            stats[f"clipped_tokens_{name}"] = c
            stats[f"tokens_{name}"] = n
        return total, stats

    def rl_loss(self, lp, old, mask, t: RowTensors, rows, step):
        """The policy-gradient term over ``mask``'s tokens (their mean): ``(loss, stats)``."""
        c = self.cfg
        ratio: Literal["token", "sequence"] = "sequence" if c.ratio == "sequence" else "token"
        return algo.policy_loss(
            lp, old, t.adv[rows].to(lp.device), mask, t.weight[rows].to(lp.device), c.eps_low, c.eps_high, ratio
        )

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

    def extra_loss(self, lp, mb: Minibatch, rows, total):
        """``total`` plus a method's further terms (SGT's auxiliary NLL); none here."""
        return total
