"""Per-minibatch objectives for a receiver (SPEC §4 layer 4): the clipped, compatibility-weighted
token loss (GRAFT/GRPO, Section 4.2), LUFFY-style peer updates, HACPO's sequence-level loss,
and SGT's auxiliary NLL. Each returns a micro-batch's *contribution* to the minibatch loss, so
gradient accumulation over micro-batches reproduces the minibatch's token mean exactly.
"""

from __future__ import annotations

import torch

from graft_rl import algo
from graft_rl.config import MethodConfig

__all__ = ["RowTensors", "Objective", "build_objective"]


class RowTensors:
    """Per-row tensors of a receiver batch (``M`` rows, ``T`` tokens), indexed by row.

    ``old``: the receiver's log-probs before the step's first update (pi_old of the ratio). Rows
    flagged in ``old_is_current`` were not scored beforehand: they are trained in the step's first
    update, where pi_old *is* the current policy, so their pi_old is the forward pass's own
    log-probs, detached (ratio exactly 1, as verl and TRL do on-policy); see :meth:`old_for`.
    """

    def __init__(self, old: torch.Tensor, mask: torch.Tensor, adv, weight, is_peer, include, is_aux, src_mean, kappa,
                 ref: torch.Tensor | None = None, old_is_current=None):
        self.old, self.mask, self.ref = old, mask, ref
        self.old_is_current = (torch.zeros(len(mask), dtype=torch.bool) if old_is_current is None
                               else torch.as_tensor(old_is_current, dtype=torch.bool))
        self.adv = torch.as_tensor(adv, dtype=torch.float32)
        self.weight = torch.as_tensor(weight, dtype=torch.float32)
        self.is_peer = torch.as_tensor(is_peer, dtype=torch.bool)
        self.include = torch.as_tensor(include, dtype=torch.bool)
        self.is_aux = torch.as_tensor(is_aux, dtype=torch.bool)
        self.src_mean = torch.as_tensor(src_mean, dtype=torch.float32)
        self.kappa = torch.as_tensor(kappa, dtype=torch.float32)

    def old_for(self, rows: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """pi_old log-probs ``[m, T_m]`` of ``rows`` for a micro-batch whose current log-probs are ``lp``."""
        old = self.old[rows, : lp.shape[1]].to(lp.device)
        current = self.old_is_current[rows].to(lp.device)
        return torch.where(current[:, None], lp.detach(), old) if bool(current.any()) else old

    def rl_mask(self, rows) -> torch.Tensor:
        keep = (self.include & ~self.is_aux)[rows].float()
        return self.mask[rows] * keep[:, None]

    def aux_mask(self, rows) -> torch.Tensor:
        return self.mask[rows] * self.is_aux[rows].float()[:, None]


def _clip_counts(lp, old, adv, mask, eps_low, eps_high) -> tuple[float, float]:
    """(clipped tokens, tokens) of the token-clipped surrogate, for self/peer diagnostics (Table 9)."""
    with torch.no_grad():
        _, st = algo.policy_loss(lp.detach(), old, adv, mask, None, eps_low, eps_high)
        return float(st["clip_frac"] * st["num_active_tokens"]), float(st["num_active_tokens"])


def _with_kl(cfg: MethodConfig, t: RowTensors, lp, rows, rl_mask, rl_tokens: float, total, stats: dict):
    """Add ``kl_coef`` x token-mean k3 KL to the reference over the minibatch's RL tokens (micro-batch share)."""
    if cfg.kl_coef <= 0 or t.ref is None or rl_tokens <= 0 or float(rl_mask.sum()) == 0:
        return total
    ref = t.ref[rows, : lp.shape[1]].to(lp.device)
    kl = algo.reference_kl(lp, ref, rl_mask)
    stats["kl_ref"] = float(kl.detach())
    return total + cfg.kl_coef * kl * (float(rl_mask.sum()) / rl_tokens)


class Objective:
    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    def minibatch(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int = 0):
        """A ``loss_fn(lp, mask, micro_rows)`` closure for :meth:`Policy.update`; ``micro_rows`` index ``mb_rows``.

        ``update_index``: this minibatch's position among the step's updates (0, 1, ...)."""
        rl_tokens = float(t.rl_mask(mb_rows).sum())
        aux_tokens = float(t.aux_mask(mb_rows).sum())
        mb = torch.tensor(mb_rows)

        def fn(lp, mask, micro):
            rows = mb[torch.tensor(micro)]
            T = lp.shape[1]
            old = t.old_for(rows, lp)
            rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
            loss, stats = self.rl_loss(lp, old, rl_mask, t, rows, step)
            total = loss * (float(rl_mask.sum()) / rl_tokens) if rl_tokens > 0 else lp.sum() * 0.0
            total = _with_kl(self.cfg, t, lp, rows, rl_mask, rl_tokens, total, stats)
            aux_mask = t.aux_mask(rows)[:, :T].to(lp.device)
            if aux_tokens > 0 and aux_mask.sum() > 0:
                total = total + algo.sgt_nll(lp, aux_mask, self.cfg.sgt_coef) * (float(aux_mask.sum()) / aux_tokens)
            # self vs peer clipping (paper Appendix H, Table 9): counts, summed by the trainer
            adv = t.adv[rows].to(lp.device)
            peer = t.is_peer[rows].to(lp.device)
            for name, sel in (("self", ~peer), ("peer", peer)):
                m = rl_mask * sel.float()[:, None]
                c, n = _clip_counts(lp, old, adv, m, self.cfg.eps_low, self.cfg.eps_high)
                stats[f"clipped_tokens_{name}"] = c
                stats[f"tokens_{name}"] = n
            return total, stats

        return fn

    def rl_loss(self, lp, old, mask, t: RowTensors, rows, step):
        c = self.cfg
        return algo.policy_loss(
            lp, old, t.adv[rows].to(lp.device), mask, t.weight[rows].to(lp.device), c.eps_low, c.eps_high, c.ratio
        )


class LuffyObjective(Objective):
    def rl_loss(self, lp, old, mask, t, rows, step):
        c = self.cfg
        return algo.luffy_policy_loss(
            lp, old, t.adv[rows].to(lp.device), mask, t.is_peer[rows].to(lp.device), c.luffy_gamma, c.eps_low, c.eps_high
        )


class HacpoObjective(Objective):
    """HACPO's loss is a mean over responses: a micro-batch contributes ``rows_in_micro / rows_in_minibatch``.

    As in its released recipe (``recipe/hacpo/hacpo_workers.py``, ``hacpo_ppo_loss``): the peer
    clip bound follows the minibatch update index within the step, and the KL loss covers the
    learner's *own* responses only: ``low_var_kl`` per response (token mean, clamped to ±10), summed
    over own responses and divided by the minibatch's responses (``seq-mean-token-mean``).
    """

    def minibatch(self, t, mb_rows, step, update_index=0):
        n_rows = float(sum(1 for r in mb_rows if bool(t.include[r]) and not bool(t.is_aux[r])))
        mb = torch.tensor(mb_rows)
        c = self.cfg

        def fn(lp, mask, micro):
            rows = mb[torch.tensor(micro)]
            T = lp.shape[1]
            rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
            valid = rl_mask.sum(dim=1) > 0
            if not bool(valid.any()):
                return lp.sum() * 0.0, {}
            peer = t.is_peer[rows].to(lp.device)
            loss, st = algo.hacpo_policy_loss(
                lp[valid],
                t.old_for(rows, lp)[valid],
                t.src_mean[rows].to(lp.device)[valid],
                t.adv[rows].to(lp.device)[valid],
                rl_mask[valid],
                peer[valid],
                update_index,
                t.kappa[rows].to(lp.device)[valid],
                c.hacpo_self_clip_low,
                c.hacpo_self_clip_high,
                c.hacpo_peer_clip_start,
                c.hacpo_peer_clip_increment,
            )
            # self / peer clipped-token fractions (Table 9 diagnostics): a clipped sequence ratio clips all its tokens
            tokens = rl_mask[valid].sum(1)
            clipped = st.pop("clipped_seq").to(tokens.dtype)
            stats = {k: float(v) for k, v in st.items()}
            for name, sel in (("self", ~peer[valid]), ("peer", peer[valid])):
                stats[f"clipped_tokens_{name}"] = float((clipped * tokens * sel.to(tokens.dtype)).sum())
                stats[f"tokens_{name}"] = float((tokens * sel.to(tokens.dtype)).sum())
            total = loss * (float(valid.sum()) / max(n_rows, 1.0))
            own = valid & ~peer
            if c.kl_coef > 0 and t.ref is not None and bool(own.any()):
                # the recipe's KL: low_var_kl, seq-mean-token-mean over own responses, summed and divided
                # by the minibatch's responses (verl's agg_loss with global_batch_size)
                ref = t.ref[rows, :T].to(lp.device)
                seq_kl = algo.sequence_reference_kl(lp[own], ref[own], rl_mask[own])
                stats["kl_ref"] = float(seq_kl.detach().mean())
                total = total + c.kl_coef * seq_kl.sum() / max(n_rows, 1.0)
            return total, stats

        return fn


def build_objective(cfg: MethodConfig) -> Objective:
    return {"luffy": LuffyObjective, "hacpo": HacpoObjective}.get(cfg.name, Objective)(cfg)
