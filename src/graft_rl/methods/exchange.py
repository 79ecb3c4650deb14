"""Build each receiver's training batch from all policies' rollouts (Sections 4.1-4.2).

An exchange is four parts, each chosen by its ``method`` key from a registry
(:mod:`graft_rl.methods.registry`), never branches in the step loop:

- an **advantage** (``method.advantage``, :mod:`graft_rl.methods.advantages`) on each source's own
  groups (GRAFT's source-computed advantages), or on a pooled group;
- a **selection** (``method.selection``) decides which prompts take which peer's group:
  complementary candidates with balanced exchange (GRAFT, Section 4.1), count-matched random
  prompts (Appendix G), every prompt (HACPO); SGT registers its own rule in its file;
- a **composition** (``method.composition``) decides what the receiver trains on for a selected
  prompt: the peer group *replaces* the failed own group (``replace``: GRAFT, LUFFY), the groups are
  pooled (``pool``: the pooled-groups ablation), or one correct response is an auxiliary target
  (``aux_target``: SGT); HACPO registers its pooling in its file;
- a **weighting** (``method.weighting``, :mod:`graft_rl.methods.weighting`) turns compatibility
  scores into weights on the receiver's worker: the gate (Section 4.2) with its switches, or none.

This module is the driver's side (selection, composition, each receiver's batch); the receiver's
side is :mod:`~graft_rl.methods.receiver` and :mod:`~graft_rl.methods.weighting`, what both report
is :mod:`~graft_rl.methods.reporting`.

More than two policies (beyond the paper): for receiver R each peer P is first selected
pairwise, exactly as with two models (balancing between R and P); a prompt selected from
several peers takes the group of the peer with the most successes, ties broken by the
order of policies in the config. With two policies this is the paper's rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graft_rl import algo
from graft_rl.errors import removed_names
from graft_rl.methods.advantages import AdvantageContext
from graft_rl.methods.batch import ReceiverBatch, Row, group_rewards, rows_of, success_counts, successes
from graft_rl.methods.config import MethodConfig
from graft_rl.methods.registry import ADVANTAGES, COMPOSITIONS, SELECTIONS
from graft_rl.methods.reporting import selection_stats, swarm_stats
from graft_rl.policy import RolloutGroup

__all__ = [
    "ComposeContext",
    "Exchange",
    "ReceiverBatch",
    "Row",
    "Selection",
    "SwarmContext",
    "group_rewards",
    "register_composition",
    "register_selection",
    "rows_of",
    "success_counts",
    "successes",
]


# --------------------------------------------------------------------------- selections
def register_selection(name: str) -> Callable:
    """Class decorator: a :class:`Selection` subclass (its ``pairwise``) as ``method.selection: NAME``."""
    return SELECTIONS.register(name)


class Selection:
    """Which prompts receive which peer's group: ``{peer: bool[G]}`` (a prompt from one peer at most).
    A subclass gives the rule for one pair, :meth:`pairwise`; :meth:`select` resolves several peers."""

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    def pairwise(self, k_peer, k_recv, n, balanced_ok: bool, gen) -> torch.Tensor:
        raise NotImplementedError

    def select(self, receiver, k: dict[str, torch.Tensor], n: dict[str, int], live: set[str], gen) -> dict:
        """``{peer: bool[G]}``. ``n``: each policy's own group size. Whether a *source* group is mixed
        (``1 <= k < n``) uses the source's ``n`` (a replayed peer may have sampled another ``n`` than
        the receiver)."""
        k_recv = k[receiver]
        chosen: dict[str, torch.Tensor] = {}
        for peer, k_peer in k.items():
            if peer == receiver:
                continue
            # balancing needs both directions; a replayed peer is one-directional (Section 6.2)
            both_live = peer in live and receiver in live
            chosen[peer] = self.pairwise(k_peer, k_recv, n[peer], both_live, gen)
        return _resolve(chosen, k)


def _resolve(chosen: dict[str, torch.Tensor], k: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A prompt chosen from several peers goes to the peer with most successes (ties: config order)."""
    if len(chosen) <= 1:
        return chosen
    names = list(chosen)
    sel = torch.stack([chosen[p] for p in names])  # [P, G]
    ks = torch.stack([k[p] for p in names]).float()
    # rank = k (most successes) minus a tiny rank term so the earlier peer wins ties
    rank = torch.where(sel, ks - torch.arange(len(names))[:, None] * 1e-3, torch.full_like(ks, -1.0))
    best = rank.argmax(dim=0)
    any_sel = sel.any(dim=0)
    return {p: any_sel & (best == i) for i, p in enumerate(names)}


@register_selection("complementary")
class Complementary(Selection):
    """GRAFT's rule: receiver all-fail, peer mixed; balanced between the two live models."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        peer_to_recv, _ = algo.balanced_exchange(k_peer, k_recv, n, balance=self.cfg.balance and balanced_ok)
        return peer_to_recv


@register_selection("random")
class CountMatchedRandom(Selection):
    """Appendix G: as many prompts as GRAFT's rule would move, drawn uniformly from the batch."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        peer_to_recv, _ = algo.balanced_exchange(k_peer, k_recv, n, balance=self.cfg.balance and balanced_ok)
        rand, _ = algo.count_matched_random_prompts(peer_to_recv, torch.zeros_like(peer_to_recv), gen)
        return rand


@register_selection("all")
class Every(Selection):
    """Every prompt takes the peer's group (HACPO pools the peer's rollouts on every prompt)."""

    def pairwise(self, k_peer, k_recv, n, balanced_ok, gen):
        return torch.ones_like(k_recv, dtype=torch.bool)


# --------------------------------------------------------------------------- compositions
@dataclass
class ComposeContext:
    """What a composition reads for prompt ``q``: ``gi`` (the index its first group takes in the batch),
    ``selected`` (the selection chose ``peer`` for it; False for a prompt a composition with
    ``every_prompt`` pools anyway), ``adv`` (each policy's advantages on its own groups), and the
    advantage part, to compute one over a pooled group (:meth:`pooled_advantages`)."""

    q: int
    gi: int
    cfg: MethodConfig
    gen: torch.Generator
    selected: bool
    adv: dict[str, torch.Tensor]
    advantage: Callable
    capability: dict[str, float]
    state: dict
    #: every peer's group of prompt ``q`` (config order), for a composition that uses them all (PRP, XGRPO)
    peers: dict[str, RolloutGroup] = field(default_factory=dict)
    #: exchange records of what moved without a row (:meth:`moved_rewards`), shared by the batch's prompts
    moved: list[dict] = field(default_factory=list)

    def moved_rewards(self, group: RolloutGroup) -> None:
        """Record that ``group``'s rewards shaped this prompt's baseline (its responses did not move)."""
        for i, r in enumerate(group.rewards):
            self.moved.append(
                {"prompt_id": group.prompt_id, "source": group.policy, "group_index": i, "reward": float(r)}
                | dict.fromkeys(("advantage", "weight", "compat_token", "compat_char"))
                | {"included": False, "auxiliary": False, "moved": "reward"}
            )

    def own_advantages(self, group: RolloutGroup) -> list[float]:
        return self.adv[group.policy][self.q].tolist()

    def pooled_advantages(self, own: RolloutGroup, peer: RolloutGroup) -> tuple[list[float], list[float]]:
        """The advantage part over ``own || peer`` (own columns first): ``(own advantages, peer advantages)``."""
        a_own, (a_peer,) = self.pool_advantages(own, [peer])
        return a_own, a_peer

    def pool_advantages(self, own: RolloutGroup, peers: list[RolloutGroup]) -> tuple[list[float], list[list[float]]]:
        """The advantage part over ``own || peers[0] || ...``: ``(own advantages, [each peer's advantages])``."""
        groups = [own, *peers]
        rewards = torch.tensor([[float(r) for g in groups for r in g.rewards]], dtype=torch.float64)
        sources = [g.policy for g in groups for _ in range(g.n)]
        ctx = AdvantageContext(own.policy, self.cfg, sources, self.capability, self.state)
        adv = self.advantage(rewards, ctx)[0].tolist()
        out, at = [], 0
        for g in groups:
            out.append(adv[at : at + g.n])
            at += g.n
        return out[0], out[1:]


@dataclass
class SwarmContext:
    """What an unpaired composition reads (``unpaired=True``, SAPO): the receiver, ``gen`` (its draws,
    seeded by ``Purpose.SWARM``), ``adv`` (each policy's advantages on its own groups, the receiver's
    advantage part on each group's rewards), and the config."""

    receiver: str
    cfg: MethodConfig
    gen: torch.Generator
    adv: dict[str, torch.Tensor]
    #: what the composition reports: ``candidates_in``, the external groups it could have taken
    found: dict = field(default_factory=dict)

    def rows(self, group: RolloutGroup, q: int, gi: int, is_peer: bool) -> list[Row]:
        """The rows of ``group`` (its source's ``q``-th group) as the ``gi``-th group of the batch."""
        return rows_of(group, gi, is_peer, self.adv[group.policy][q].tolist())


def register_composition(name: str, **attrs) -> Callable:
    """Decorator: make ``fn(own, peer, ctx: ComposeContext) -> [(rows, is_peer_group), ...]`` available as
    ``method.composition: NAME`` (``peer``: the selected peer's group, or None). Declared attributes:
    ``pools`` (its groups mix own and peer responses: pooled advantages apply), ``aux`` (it adds
    auxiliary targets: an ``aux_loss`` is needed), ``every_prompt`` (it receives a peer group on every
    prompt, ``ctx.selected`` telling the selected ones), ``keeps_cut`` (a peer response longer than
    the receiver's budget stays in the loss, cut, instead of leaving it), ``unpaired`` (it is not paired
    by prompt: ``fn(own, external, ctx: SwarmContext)`` with ``own`` the receiver's groups and ``external``
    ``[(source, q, group)]``, every other policy's groups of its own prompts; it builds the whole batch)."""
    return COMPOSITIONS.register(name, **attrs)


@register_composition("replace")
def replace(own: RolloutGroup, peer: RolloutGroup | None, ctx: ComposeContext):
    """GRAFT's (Section 4.1): the peer group replaces the failed own group, with the source's advantages;
    ``success_only`` (Appendix G) leaves its unsuccessful responses out of the loss."""
    if peer is None:
        return [(rows_of(own, ctx.gi, False, ctx.own_advantages(own)), False)]
    rows = rows_of(peer, ctx.gi, True, ctx.own_advantages(peer))
    if ctx.cfg.success_only:  # Appendix G: unsuccessful peer responses leave the loss
        keep = algo.success_only_mask(
            torch.ones(len(rows), 1),
            torch.tensor([float(r.success) for r in rows]),  # success: reward >= data.success_threshold
            torch.ones(len(rows), dtype=torch.bool),
        )
        for r, k in zip(rows, keep[:, 0].tolist(), strict=True):
            r.include = k > 0
    return [(rows, True)]


@register_composition("pool", pools=True)
def pool(own: RolloutGroup, peer: RolloutGroup | None, ctx: ComposeContext):
    """Pooled groups (Appendix G): the selected prompt trains on G_B || G_A with advantages over the pool."""
    if peer is None:
        return replace(own, None, ctx)
    a_own, a_peer = ctx.pooled_advantages(own, peer)
    return [(rows_of(own, ctx.gi, False, a_own) + rows_of(peer, ctx.gi, True, a_peer), True)]


# --------------------------------------------------------------------------- the exchange
class Exchange:
    """Advantage + selection + composition: each receiver's :class:`ReceiverBatch` (Section 4.1).

    ``uses_peers=False``: a receiver's batch is its own groups only (GRPO)."""

    def __init__(self, cfg: MethodConfig, uses_peers: bool = True):
        self.cfg = cfg
        self.uses_peers = uses_peers
        self.advantage = ADVANTAGES.get(cfg.part_name("advantage"))
        self.selection = SELECTIONS.get(cfg.part_name("selection"))(cfg)
        self.composition = COMPOSITIONS.get(cfg.part_name("composition"))

    def advantages(self, policy: str, rewards: torch.Tensor, capability=None, state=None) -> torch.Tensor:
        """A policy's advantages ``[G, n]`` on its own groups' rewards ``[G, n]``."""
        return self.advantage(rewards, AdvantageContext(policy, self.cfg, None, capability or {}, state or {}))

    def build(
        self,
        receiver: str,
        groups: dict[str, list[RolloutGroup]],
        live: set[str],
        n: int,
        gen: torch.Generator,
        capability: dict[str, float] | None = None,
        state: dict | None = None,
        swarm_gen: torch.Generator | None = None,
    ) -> ReceiverBatch:
        """``capability``/``state``: the method's per-step state (:meth:`Method.observe`); ``swarm_gen``: the
        draws of an unpaired composition (``Purpose.SWARM``; ``gen`` without one)."""
        if not self.uses_peers:
            groups = {receiver: groups[receiver]}
        capability, state = capability or {}, state or {}
        own = groups[receiver]
        k = {name: success_counts(gs) for name, gs in groups.items()}
        adv = {name: self.advantages(name, group_rewards(gs), capability, state) for name, gs in groups.items()}
        if self.composition.unpaired:
            return self._build_unpaired(receiver, groups, adv, swarm_gen if swarm_gen is not None else gen)
        group_n = {name: (gs[0].n if gs else n) for name, gs in groups.items()}
        chosen = self.selection.select(receiver, k, group_n, live, gen) if len(groups) > 1 else {}
        from_peer = {}  # prompt index -> peer
        for peer, mask in chosen.items():
            for q in torch.nonzero(mask).flatten().tolist():
                from_peer[q] = peer
        pooled_with = {}  # every_prompt: prompt -> the peer whose group it pools when none was selected
        if self.composition.every_prompt and len(groups) > 1:
            every = Every(self.cfg).select(receiver, k, group_n, live, gen)  # deterministic: no draw
            for peer, mask in every.items():
                pooled_with.update({q: peer for q in torch.nonzero(mask).flatten().tolist()})
        rows: list[Row] = []
        group_is_peer: list[bool] = []
        moved: list[dict] = []
        entered: dict[str, int] = dict.fromkeys((p for p in groups if p != receiver), 0)
        for q, g in enumerate(own):
            peer = from_peer.get(q, pooled_with.get(q))
            first_row, first_moved = len(rows), len(moved)
            peers = {p: gs[q] for p, gs in groups.items() if p != receiver and q < len(gs)}
            ctx = ComposeContext(
                q,
                len(group_is_peer),
                self.cfg,
                gen,
                q in from_peer,
                adv,
                self.advantage,
                capability,
                state,
                peers,
                moved,
            )
            for part_rows, is_peer in self.composition(g, groups[peer][q] if peer else None, ctx):
                rows.extend(part_rows)
                group_is_peer.append(is_peer)
            sources = {r.source for r in rows[first_row:] if r.is_peer} | {m["source"] for m in moved[first_moved:]}
            for src in sources & entered.keys():
                entered[src] += 1
        stats = selection_stats(receiver, k, group_n, chosen, from_peer)
        if self.composition.every_prompt and len(entered) > 1:
            # every peer's group may enter one prompt (PRP, XGRPO, F-TIS): count each peer's, not the
            # one peer the selection resolved the prompt to
            stats.update({f"exchanged_from/{p}": float(c) for p, c in entered.items()})
        return ReceiverBatch(receiver, rows, group_is_peer, stats, moved)

    def _build_unpaired(self, receiver: str, groups: dict, adv: dict, gen: torch.Generator) -> ReceiverBatch:
        """An unpaired composition's batch: the receiver's own groups and every other policy's groups (of
        their own prompts), in config order, handed to the composition whole."""
        external = [(src, q, g) for src, gs in groups.items() if src != receiver for q, g in enumerate(gs)]
        ctx = SwarmContext(receiver, self.cfg, gen, adv)
        rows: list[Row] = []
        group_is_peer: list[bool] = []
        for part_rows, is_peer in self.composition(groups[receiver], external, ctx):
            rows.extend(part_rows)
            group_is_peer.append(is_peer)
        stats = swarm_stats(receiver, groups, rows, ctx.found)
        return ReceiverBatch(receiver, rows, group_is_peer, stats)


_MOVED = {"register_weighting": "weighting", "gate": "weighting", "no_weighting": "weighting"}


def __getattr__(name: str):
    """Names that left this module in 0.2.0 still import from here for one version, with a warning."""
    if name in _MOVED:
        import importlib
        import warnings

        where = f"graft_rl.methods.{_MOVED[name]}"
        warnings.warn(
            f"graft_rl.methods.exchange.{name} moved to {where} in 0.2.0 (this name goes in 0.3.0)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), name)
    return _removed(name)


_removed = removed_names(
    __name__,
    {
        "SGTRule": "removed in 0.1.0 (methods are presets of parts): selection sgt (graft_rl.methods.sgt)",
        "Weighting": "removed in 0.1.0: a weighting is a function, @register_weighting(NAME) (graft_rl.methods.weighting)",
        "NoWeighting": "removed in 0.1.0: weighting none (graft_rl.methods.weighting.no_weighting)",
    },
)
