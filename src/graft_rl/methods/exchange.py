"""Build each receiver's training batch from all policies' rollouts (Sections 4.1-4.2).

An exchange is three small strategies, chosen by the method (``graft_rl.methods``), never
branches in the step loop:

- a **selection** (:data:`SELECTIONS`, ``method.selection``) decides which prompts take which
  peer's group: complementary candidates with balanced exchange (GRAFT, Section 4.1),
  count-matched random prompts (Appendix G), SGT's rule (receiver fails, peer has a success), or
  every prompt (HACPO);
- a **composition** (:meth:`Exchange.compose`) decides what the receiver trains on for a selected
  prompt: here the peer group *replaces* the failed own group (GRAFT, LUFFY); methods override it
  to pool the groups (pooled-groups ablation, HACPO) or to add one correct response as an
  auxiliary NLL target (SGT);
- a **weighting** (:class:`Weighting`) turns compatibility scores into weights on the receiver's
  worker: the gate (Section 4.2), no gate, no floor, count-matched random admission, or none.

More than two policies (beyond the paper): for receiver R each peer P is first selected
pairwise, exactly as with two models (balancing between R and P); a prompt selected from
several peers takes the group of the peer with the most successes, ties broken by the
order of policies in the config. With two policies this is the paper's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from graft_rl import algo
from graft_rl.methods.base import MethodConfig
from graft_rl.policy import RolloutGroup

__all__ = [
    "SELECTIONS",
    "Exchange",
    "NoWeighting",
    "ReceiverBatch",
    "Row",
    "Selection",
    "Weighting",
    "group_rewards",
    "rows_of",
    "success_counts",
    "successes",
]


@dataclass
class Row:
    """One response in a receiver's batch (own, grafted, pooled or auxiliary)."""

    group: int  # index into ReceiverBatch.groups
    prompt_id: str
    prompt: str
    source: str  # the policy that generated it
    is_peer: bool
    text: str
    token_ids: list[int] | None  # the source's ids: used only when source == receiver
    finished: bool
    reward: float
    advantage: float
    src_logprob_sum: float  # sum of the source's generation log-probs
    src_mean_logprob: float  # mean of the same (paper's l-bar)
    index: int = 0  # position in the source's group
    success: bool = False  # reward >= data.success_threshold
    is_aux: bool = False  # SGT auxiliary NLL target, not in the policy-gradient term
    include: bool = True  # False: removed from numerator and denominator (success-only)
    weight: float = 1.0  # compatibility weight, set by the weighting after scoring
    # per-row numbers a method's objective reads (e.g. HACPO's capability ratio "kappa"), by name
    extras: dict[str, float] = field(default_factory=dict)


@dataclass
class ReceiverBatch:
    receiver: str
    rows: list[Row]
    group_is_peer: list[bool]  # per planned group: contains grafted/peer responses
    stats: dict[str, float] = field(default_factory=dict)

    def group_rows(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.group_is_peer]
        for i, r in enumerate(self.rows):
            out[r.group].append(i)
        return out


# --------------------------------------------------------------------------- helpers
def success_counts(groups: list[RolloutGroup]) -> torch.Tensor:
    return torch.tensor([g.k for g in groups], dtype=torch.long)


def successes(group: RolloutGroup) -> list[float]:
    """1.0 per successful response (``reward >= data.success_threshold``, as the trainer marked it), else 0.0."""
    return [float(x) for x in group.succeeded]


def group_rewards(groups: list[RolloutGroup]) -> torch.Tensor:
    return torch.tensor([g.rewards for g in groups], dtype=torch.float64)


def rows_of(group: RolloutGroup, gi: int, is_peer: bool, adv: list[float]) -> list[Row]:
    rows = []
    ok = successes(group)
    for i in range(group.n):
        lps = group.gen_logprobs[i]
        s = float(sum(lps))
        rows.append(
            Row(
                group=gi,
                prompt_id=group.prompt_id,
                prompt=group.prompt,
                source=group.policy,
                is_peer=is_peer,
                text=group.texts[i],
                token_ids=group.token_ids[i],
                finished=group.finish_reasons[i] == "stop",
                reward=float(group.rewards[i]),
                advantage=float(adv[i]),
                src_logprob_sum=s,
                src_mean_logprob=s / len(lps) if lps else math.nan,
                index=i,
                success=ok[i] > 0,
            )
        )
    return rows


# --------------------------------------------------------------------------- selections
class Selection:
    """Which prompts receive which peer's group: ``{peer: bool[G]}`` (a prompt from one peer at most)."""

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    def pairwise(self, k_peer, k_recv, n, balanced_ok: bool, gen) -> torch.Tensor:
        raise NotImplementedError

    def select(self, receiver, k: dict[str, torch.Tensor], n: dict[str, int], live: set[str], gen) -> tuple[dict, dict]:
        """``n``: each policy's own group size. Whether a *source* group is mixed (``1 <= k < n``)
        uses the source's ``n`` (a replayed peer may have sampled another ``n`` than the receiver)."""
        k_recv = k[receiver]
        chosen: dict[str, torch.Tensor] = {}
        candidates: dict[str, int] = {}
        for peer, k_peer in k.items():
            if peer == receiver:
                continue
            # balancing needs both directions; a replayed peer is one-directional (Section 6.2)
            both_live = peer in live and receiver in live
            chosen[peer] = self.pairwise(k_peer, k_recv, n[peer], both_live, gen)
            candidates[peer] = int(algo.complementary_mask(k_peer, k_recv, n[peer]).sum())
        return _resolve(chosen, k), candidates


def _resolve(chosen: dict[str, torch.Tensor], k: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A prompt chosen from several peers goes to the peer with most successes (ties: config order)."""
    if len(chosen) <= 1:
        return chosen
    names = list(chosen)
    sel = torch.stack([chosen[p] for p in names])  # [P, G]
    ks = torch.stack([k[p] for p in names]).float()
    # score = k (most successes) minus a tiny rank term so the earlier peer wins ties
    score = torch.where(sel, ks - torch.arange(len(names))[:, None] * 1e-3, torch.full_like(ks, -1.0))
    best = score.argmax(dim=0)
    any_sel = sel.any(dim=0)
    return {p: any_sel & (best == i) for i, p in enumerate(names)}


class Complementary(Selection):
    """GRAFT's rule: receiver all-fail, peer mixed; balanced between the two live models."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        peer_to_recv, _ = algo.balanced_exchange(k_peer, k_recv, n, balance=self.cfg.balance and balanced_ok)
        return peer_to_recv


class CountMatchedRandom(Selection):
    """Appendix G: as many prompts as GRAFT's rule would move, drawn uniformly from the batch."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        peer_to_recv, _ = algo.balanced_exchange(k_peer, k_recv, n, balance=self.cfg.balance and balanced_ok)
        rand, _ = algo.count_matched_random_prompts(peer_to_recv, torch.zeros_like(peer_to_recv), gen)
        return rand


class SGTRule(Selection):
    """SGT's eligibility: receiver has no success, peer has at least one (no balancing, k_peer = n allowed)."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        return algo.sgt_eligible(k_recv, k_peer)


class Every(Selection):
    """HACPO pools the peer's rollouts on every prompt."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        return torch.ones_like(k_recv, dtype=torch.bool)


#: ``method.selection`` -> its rule (the config's allowed values come from here)
SELECTIONS: dict[str, type[Selection]] = {
    "complementary": Complementary,
    "graft": Complementary,
    "random": CountMatchedRandom,
    "sgt": SGTRule,
    "all": Every,
}


# --------------------------------------------------------------------------- weightings
class Weighting:
    """Compatibility score -> weight for one direction's peer responses (own responses keep 1)."""

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    def __call__(self, score: torch.Tensor, gen) -> torch.Tensor:
        c = self.cfg
        if not c.gate:
            return torch.ones_like(score)  # "w/o compatibility gate": w = 1
        if c.admission == "random":
            return algo.random_admission_weight(score, c.delta, gen)
        return algo.compatibility_weight(score, c.delta, floor=c.floor)


class NoWeighting(Weighting):
    """For methods with their own off-policy correction (LUFFY, HACPO): every peer response counts fully."""

    def __call__(self, score, gen):
        return torch.ones_like(score)


# --------------------------------------------------------------------------- the exchange
class Exchange:
    """Selection + composition (GRAFT's: the peer group replaces the failed own group)."""

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg
        self.selection = SELECTIONS[cfg.selection](cfg)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Each group's advantages ``[G, n]`` on its own rewards ``[G, n]`` (GRPO's, Section 3)."""
        return algo.grpo_advantages(rewards, self.cfg.adv_eps)

    def build(
        self,
        receiver: str,
        groups: dict[str, list[RolloutGroup]],
        live: set[str],
        n: int,
        gen: torch.Generator,
    ) -> ReceiverBatch:
        own = groups[receiver]
        k = {name: success_counts(gs) for name, gs in groups.items()}
        adv = {name: self.advantages(group_rewards(gs)) for name, gs in groups.items()}
        group_n = {name: (gs[0].n if gs else n) for name, gs in groups.items()}
        chosen, candidates = self.selection.select(receiver, k, group_n, live, gen) if len(groups) > 1 else ({}, {})
        from_peer = {}  # prompt index -> peer
        for peer, mask in chosen.items():
            for q in torch.nonzero(mask).flatten().tolist():
                from_peer[q] = peer
        rows: list[Row] = []
        group_is_peer: list[bool] = []
        for q, g in enumerate(own):
            peer = from_peer.get(q)
            for part_rows, is_peer in self.compose(q, g, peer, groups, adv, gen, len(group_is_peer)):
                rows.extend(part_rows)
                group_is_peer.append(is_peer)
        stats = {
            "candidates_in": float(sum(candidates.values())),
            "exchanged_in": float(len(from_peer)),
        }
        for peer in chosen:
            stats[f"exchanged_from/{peer}"] = float(sum(1 for p in from_peer.values() if p == peer))
        return ReceiverBatch(receiver, rows, group_is_peer, stats)

    def compose(self, q, own_group, peer, groups, adv, gen, gi):
        """Yield ``(rows, is_peer_group)`` for prompt ``q`` (GRAFT: the peer group replaces the own one)."""
        if peer is None:
            yield rows_of(own_group, gi, False, adv[own_group.policy][q].tolist()), False
            return
        pg = groups[peer][q]
        rows = rows_of(pg, gi, True, adv[peer][q].tolist())
        if self.cfg.success_only:  # Appendix G: unsuccessful peer responses leave the loss
            keep = algo.success_only_mask(
                torch.ones(len(rows), 1),
                torch.tensor([float(r.success) for r in rows]),  # success: reward >= data.success_threshold
                torch.ones(len(rows), dtype=torch.bool),
            )
            for r, k in zip(rows, keep[:, 0].tolist(), strict=True):
                r.include = k > 0
        yield rows, True
