"""Build each receiver's training batch from all policies' rollouts (SPEC §4 layer 4).

A method is three small strategies chosen by config, not branches in the step loop:

- a **selection** decides which prompts take which peer's group: complementary candidates
  with balanced exchange (GRAFT, Section 4.1), count-matched random prompts (Appendix G),
  SGT's rule (receiver fails, peer has a success), or every prompt (HACPO);
- a **composition** decides what the receiver trains on for a selected prompt: the peer
  group *replaces* the failed own group (GRAFT, LUFFY), is *pooled* with it (pooled-groups
  ablation, HACPO), or supplies one correct response for an *auxiliary* NLL (SGT);
- a **weighting** turns compatibility scores into weights: the gate (Section 4.2), no gate,
  no floor, count-matched random admission, or none (LUFFY).

The objective (clipped token loss, LUFFY, HACPO) is chosen in :mod:`graft_rl.objectives`.

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
from graft_rl.config import MethodConfig
from graft_rl.policy import RolloutGroup

__all__ = ["Row", "ReceiverBatch", "Exchange", "build_exchange"]


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
    is_aux: bool = False  # SGT auxiliary NLL target, not in the policy-gradient term
    include: bool = True  # False: removed from numerator and denominator (success-only)
    weight: float = 1.0  # compatibility weight, set by the weighting after scoring


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
def _k(groups: list[RolloutGroup]) -> torch.Tensor:
    return torch.tensor([g.k for g in groups], dtype=torch.long)


def _rewards(groups: list[RolloutGroup]) -> torch.Tensor:
    return torch.tensor([g.rewards for g in groups], dtype=torch.float64)


def _rows_of(group: RolloutGroup, gi: int, is_peer: bool, adv: list[float]) -> list[Row]:
    rows = []
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


_SELECTIONS = {"complementary": Complementary, "graft": Complementary, "random": CountMatchedRandom, "sgt": SGTRule, "all": Every}


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
    """LUFFY and HACPO bring their own off-policy correction: every peer response counts fully."""

    def __call__(self, score, gen):
        return torch.ones_like(score)


# --------------------------------------------------------------------------- the exchange
class Exchange:
    """Selection + composition + weighting, for one method config."""

    composition = "replace"

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg
        self.selection = _SELECTIONS[cfg.selection](cfg)
        self.weighting: Weighting = Weighting(cfg)

    # which compositions: replace (GRAFT/LUFFY), pool, aux (SGT), none (GRPO)
    def build(
        self,
        receiver: str,
        groups: dict[str, list[RolloutGroup]],
        live: set[str],
        n: int,
        gen: torch.Generator,
    ) -> ReceiverBatch:
        own = groups[receiver]
        k = {name: _k(gs) for name, gs in groups.items()}
        adv = {name: algo.grpo_advantages(_rewards(gs), self.cfg.adv_eps) for name, gs in groups.items()}
        group_n = {name: (gs[0].n if gs else n) for name, gs in groups.items()}
        chosen, candidates = (self.selection.select(receiver, k, group_n, live, gen) if len(groups) > 1 else ({}, {}))
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
            yield _rows_of(own_group, gi, False, adv[own_group.policy][q].tolist()), False
            return
        pg = groups[peer][q]
        rows = _rows_of(pg, gi, True, adv[peer][q].tolist())
        if self.cfg.success_only:
            for r in rows:
                r.include = r.reward > 0
        yield rows, True


class PooledExchange(Exchange):
    """Pooled groups (Appendix G): the selected prompt trains on G_B || G_A with pooled advantages."""

    def compose(self, q, own_group, peer, groups, adv, gen, gi):
        if peer is None:
            yield from super().compose(q, own_group, None, groups, adv, gen, gi)
            return
        pg = groups[peer][q]
        a_own, a_peer = algo.pooled_advantages(
            torch.tensor([own_group.rewards], dtype=torch.float64), torch.tensor([pg.rewards], dtype=torch.float64), self.cfg.adv_eps
        )
        yield _rows_of(own_group, gi, False, a_own[0].tolist()) + _rows_of(pg, gi, True, a_peer[0].tolist()), True


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
    """

    def __init__(self, cfg: MethodConfig):
        super().__init__(cfg)
        self.weighting = NoWeighting(cfg)
        self.capability: dict[str, float] = {}
        self._pool_peer: dict[int, str] = {}  # prompt -> the peer whose group it pools (selection != all)

    def build(self, receiver, groups, live, n, gen):
        self._pool_peer = {}
        if self.cfg.selection != "all" and len(groups) > 1:  # HACPO's pooling, on every prompt
            k = {name: _k(gs) for name, gs in groups.items()}
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
        peer_rows = _rows_of(pg, gi, True, a_peer[0].tolist())
        for r, lps in zip(peer_rows, pg.gen_logprobs, strict=True):
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
        yield _rows_of(own_group, gi, False, a_own[0].tolist()) + peer_rows, False


class SGTExchange(Exchange):
    """SGT (Appendix B): the own group stays; one uniformly drawn correct peer response per
    selected prompt is an auxiliary NLL target (weight ``sgt_coef``)."""

    def compose(self, q, own_group, peer, groups, adv, gen, gi):
        own_rows = _rows_of(own_group, gi, False, adv[own_group.policy][q].tolist())
        if peer is None:
            yield own_rows, False
            return
        pg = groups[peer][q]
        idx = int(algo.sgt_select(torch.tensor([pg.rewards]), torch.tensor([True]), gen)[0])
        if idx < 0:
            yield own_rows, False
            return
        aux = _rows_of(pg, gi, True, [0.0] * pg.n)[idx]
        aux.is_aux = True
        # the NLL target travels with its prompt's own group, in ordinary minibatch order: SGT is
        # "GRPO + a supervised NLL term", not GRAFT's peer-last packing (Appendix B)
        yield own_rows + [aux], False


class NoExchange(Exchange):
    """GRPO: every receiver trains on its own groups only."""

    def build(self, receiver, groups, live, n, gen):
        return super().build(receiver, {receiver: groups[receiver]}, live, n, gen)


def build_exchange(cfg: MethodConfig) -> Exchange:
    """The exchange strategy for a method config."""
    if cfg.name == "grpo":
        return NoExchange(cfg)
    if cfg.name == "hacpo":
        return HacpoExchange(cfg)
    if cfg.name == "sgt":
        return SGTExchange(cfg)
    if cfg.name == "luffy":
        ex = Exchange(cfg)
        ex.weighting = NoWeighting(cfg)
        return ex
    return PooledExchange(cfg) if cfg.pooled else Exchange(cfg)
