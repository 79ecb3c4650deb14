"""HACPO (Appendix B; its recipe ``recipe/hacpo`` in ``zzx-peter/HACRL-code``): every prompt pools
the receiver's group with its peer's, advantages use a capability-weighted baseline, peer responses
are trained with a sequence-level ratio against the source's mean log-prob, clipped by bounds that
tighten with the update index, and scaled by the capability ratio. "HACPO + GRAFT which" is
``selection: graft``: the peer-rollout loss only on the prompts GRAFT's rule selects."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.errors import ConfigError
from graft_rl.methods.base import Method, MethodConfig, check_range, register_method
from graft_rl.methods.exchange import Every, Exchange, NoWeighting, rows_of, success_counts
from graft_rl.methods.objectives import Minibatch, Objective, RowTensors

__all__ = ["CAPABILITY_FLOOR", "HACPO", "HacpoExchange", "HacpoObjective"]

#: HACPO's capability floor (``CapabilityTracker`` ``minimum`` in its recipe's hacpo_trainer.yaml)
CAPABILITY_FLOOR = 1e-8


class HacpoExchange(Exchange):
    """HACPO: own group plus the peer's, capability-aware advantages (Appendix B).

    "HACPO + GRAFT which" (``selection: graft``, Appendix G): "We keep the HACPO configuration of
    Appendix B but apply its peer-rollout loss only on prompts where the receiver fails [...] and
    the peer succeeds at least once [...], subject to the balanced exchange. Peer responses on all
    other prompts receive zero advantage and contribute no gradient." So every prompt still pools
    the peer's group (own responses keep HACPO's pooled, capability-weighted baseline, and the peer
    responses stay in the batch and in the loss's per-response mean); on prompts GRAFT's rule did
    not select, the peer responses' advantages are zero.

    ``capability``: each policy's current capability (:meth:`HACPO.observe` keeps it up to date).
    Each peer row carries the capability ratio ``kappa`` (``Row.extras``) for the objective.
    """

    def __init__(self, cfg: MethodConfig, capability: dict[str, float] | None = None):
        super().__init__(cfg)
        self.capability: dict[str, float] = {} if capability is None else capability
        self._pool_peer: dict[int, str] = {}  # prompt -> the peer whose group it pools (selection != all)

    def build(self, receiver, groups, live, n, gen):
        self._pool_peer = {}
        if self.cfg.selection != "all" and len(groups) > 1:  # HACPO's pooling, on every prompt
            k = {name: success_counts(gs) for name, gs in groups.items()}
            group_n = {name: (gs[0].n if gs else n) for name, gs in groups.items()}
            every, _ = Every(self.cfg).select(receiver, k, group_n, live, gen)  # deterministic: no draw
            for peer, mask in every.items():
                self._pool_peer.update({q: peer for q in torch.nonzero(mask).flatten().tolist()})
        return super().build(receiver, groups, live, n, gen)

    def compose(self, q, own_group, peer, groups, adv, gen, gi):
        selected = peer is not None
        peer = peer if selected else self._pool_peer.get(q)
        if peer is None:
            yield from super().compose(q, own_group, None, groups, adv, gen, gi)
            return
        pg = groups[peer][q]
        cap_self = max(self.capability.get(own_group.policy, 0.5), CAPABILITY_FLOOR)
        cap_peer = max(self.capability.get(peer, 0.5), CAPABILITY_FLOOR)
        a_own, a_peer = algo.hacpo_advantages(
            torch.tensor([own_group.rewards], dtype=torch.float64),
            torch.tensor([pg.rewards], dtype=torch.float64),
            cap_self,
            cap_peer,
            self.cfg.adv_eps,
        )
        if not selected:  # "which": a prompt GRAFT's rule did not select
            a_peer = torch.zeros_like(a_peer)
        peer_rows = rows_of(pg, gi, True, a_peer[0].tolist())
        kappa = algo.hacpo_capability_ratio(self.capability.get(peer, 0.5), self.capability.get(own_group.policy, 0.5))
        for r, lps in zip(peer_rows, pg.gen_logprobs, strict=True):
            r.extras["kappa"] = kappa  # the peer loss's multiplier P_src / P_recv
            # the recipe pops a final EOS before the sequence mean (a source that ended on a stop string
            # rather than EOS loses its last token here too: the paper's presets set no stop strings)
            if r.finished and len(lps) > 1:
                r.src_mean_logprob = (r.src_logprob_sum - lps[-1]) / (len(lps) - 1)
        # Minibatch order. The recipe lays out each learner's batch self first, then peer
        # (`_target_trajectories_self_first`, actor.shuffle=false), and verl splits it contiguously
        # over the data-parallel ranks *before* cutting minibatches: on its 8-GPU launcher ranks 0-3
        # hold own responses of prompts 0-31, 32-63, ..., ranks 4-7 the peer responses of the same
        # prompts, so update m holds own and peer responses of the same 8 prompts per rank pair. A
        # prompt's pooled group (own then peer) in ordinary order gives updates of exactly that kind;
        # the preset's minibatch of 32 pooled groups (512 responses) gives the recipe's 4 updates.
        yield rows_of(own_group, gi, False, a_own[0].tolist()) + peer_rows, False


@dataclass
class _HacpoMinibatch(Minibatch):
    responses: float = 0.0  # the minibatch's included, non-auxiliary responses (HACPO's loss is their mean)


class HacpoObjective(Objective):
    """HACPO's loss is a mean over responses: a micro-batch contributes ``rows_in_micro / rows_in_minibatch``.

    As in its released recipe (``recipe/hacpo/hacpo_workers.py``, ``hacpo_ppo_loss``): the peer
    clip bound follows the minibatch update index within the step, and the KL loss covers the
    learner's *own* responses only: ``low_var_kl`` per response (token mean, clamped to ±10), summed
    over own responses and divided by the minibatch's responses (``seq-mean-token-mean``).
    """

    def prepare(self, t: RowTensors, mb_rows: list[int], step: int, update_index: int) -> Minibatch:
        n_rows = float(sum(1 for r in mb_rows if bool(t.include[r]) and not bool(t.is_aux[r])))
        return _HacpoMinibatch(t, torch.tensor(mb_rows), step, update_index, 0.0, responses=n_rows)

    def micro(self, lp, mb, rows):
        t, c = mb.t, self.cfg
        n_rows = mb.responses
        T = lp.shape[1]
        rl_mask = t.rl_mask(rows)[:, :T].to(lp.device)
        valid = rl_mask.sum(dim=1) > 0
        if not bool(valid.any()):
            return lp.sum() * 0.0, {}
        peer = t.is_peer[rows].to(lp.device)
        kappa = t.extras["kappa"][rows] if "kappa" in t.extras else torch.ones(len(rows))
        loss, st = algo.hacpo_policy_loss(
            lp[valid],
            t.old_for(rows, lp)[valid],
            t.src_mean[rows].to(lp.device)[valid],
            t.adv[rows].to(lp.device)[valid],
            rl_mask[valid],
            peer[valid],
            mb.update_index,
            kappa.to(lp.device)[valid],
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


@register_method("hacpo")
class HACPO(Method):
    @dataclass
    class Params:
        hacpo_self_clip_low: float = 3e-4  # own responses' sequence-ratio clip: [1 - low, 1 + high]
        hacpo_self_clip_high: float = 4e-4  # upper side of the own-response clip
        hacpo_peer_clip_start: float = 0.8  # peer responses' lower clip bound at the step's first update
        hacpo_peer_clip_increment: float = 0.025  # ... raised by this per update of the step
        hacpo_capability_window: int = 5  # steps in each policy's capability (mean success rate)

    default_selection = "all"
    # HACPO's recipe truncates an over-long peer response to the budget and trains on it
    # (hacpo_trajectory.build_training_view, overflow="truncate" in its 8-GPU script)
    keeps_cut_peer_responses = True

    @classmethod
    def check(cls, cfg) -> None:
        check_range(
            cfg,
            {
                "hacpo_self_clip_low": (0.0, 1.0, True),
                "hacpo_self_clip_high": (0.0, math.inf, True),
                "hacpo_peer_clip_start": (0.0, 1.0, True),
                "hacpo_peer_clip_increment": (0.0, 1.0, True),
            },
        )
        if cfg.hacpo_capability_window < 1:
            raise ConfigError(f"method.hacpo_capability_window must be >= 1, got {cfg.hacpo_capability_window}")

    def __init__(self, cfg: MethodConfig):
        super().__init__(cfg)
        #: each policy's success rate per step, the last ``hacpo_capability_window`` steps
        self.success_history: dict[str, deque] = {}
        self.capability: dict[str, float] = {}

    def _history(self, name: str) -> deque:
        return self.success_history.setdefault(name, deque(maxlen=self.cfg.hacpo_capability_window))

    def capability_of(self, name: str) -> float:
        """The window's mean success rate, floored (the recipe's ``CapabilityTracker``); 0.5 before any step."""
        h = self.success_history.get(name)
        return max(statistics.fmean(h), CAPABILITY_FLOOR) if h else 0.5

    def observe(self, groups: dict) -> None:
        for name, gs in groups.items():
            # the step's success rate, floored (its recipe's CapabilityTracker)
            self._history(name).append(max(sum(g.k for g in gs) / max(1, sum(g.n for g in gs)), CAPABILITY_FLOOR))
        self.capability.update({n: self.capability_of(n) for n in groups})

    def state_dict(self) -> dict:
        return {"success_history": {k: list(v) for k, v in self.success_history.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.get("success_history", {}).items():
            self._history(k).extend(v)

    def exchange(self):
        return HacpoExchange(self.cfg, self.capability)

    def weighting(self):
        return NoWeighting(self.cfg)  # its own off-policy correction: every peer response counts fully

    def objective(self):
        return HacpoObjective(self.cfg)

    def loss_mask(self, response_ids, mask, eos_token_ids) -> None:
        """The recipe pops a final EOS (own responses, and peer ones: re-tokenised without one)."""
        eos = set(eos_token_ids)
        for i, ids in enumerate(response_ids):
            if len(ids) > 1 and ids[-1] in eos:  # an EOS, not a stop string's text
                mask[i, len(ids) - 1] = 0
