"""Mutual RL's probes PRP and XGRPO (arXiv 2605.07244, beyond the paper), **from the description, not
the paper's equations**: only the abstract and the first author's blog are readable here
(docs/fidelity.md, "Methods after the paper", lists every reading and the sentence it rests on). Its
third probe, SGT, is the GRAFT paper's SGT baseline (:mod:`graft_rl.methods.sgt`).

- **PRP**, peer rollout pooling: "The receiver retokenizes via THL and uses them as additional
  trajectories", paying "a density-ratio variance cost". Every prompt pools the receiver's group with
  every peer's group of that prompt (``pool_all``), advantages over the pool (the blog's figure:
  "Advantage Recompute" over own and peer rollouts), each peer response weighted by its density ratio
  under the receiver and its sampler, truncated (``density_ratio``: ``min(pi_old(y) / mu(y), prp_cap)``
  over the whole text, :func:`graft_rl.algo.truncated_sequence_ratio`).
- **XGRPO**, cross-policy GRPO advantage sharing: "Policies share advantage signals rather than full
  rollouts; the local actor's on-policy support is preserved while the baselines used to compute
  advantages are influenced by peer behavior." The receiver trains on its own group only, with
  advantages computed over its rewards pooled with every peer's on the same prompt
  (``xgrpo_baseline``): ``(r_i - mean(R_own ∪ R_peers)) / (std(R_own ∪ R_peers) + eps)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.methods.base import Method, register_method
from graft_rl.methods.config import check_range
from graft_rl.methods.exchange import ComposeContext, register_composition, rows_of
from graft_rl.methods.weighting import register_weighting

__all__ = ["PRP", "XGRPO", "density_ratio", "pool_all", "xgrpo_baseline"]


def _peer_groups(peer, ctx: ComposeContext) -> list:
    """Every peer's group of this prompt (config order); the selected one at least."""
    groups = list(ctx.peers.values())
    return groups if groups else [peer]


@register_composition("pool_all", pools=True, every_prompt=True)
def pool_all(own, peer, ctx: ComposeContext):
    """PRP: the receiver's group and every peer's group of the prompt as one pooled group, advantages
    over the pool (own columns first). A prompt the selection did not choose keeps the own group alone
    (with ``selection: all``, PRP's, every prompt is chosen)."""
    if peer is None or not ctx.selected:
        return [(rows_of(own, ctx.gi, False, ctx.own_advantages(own)), False)]
    peers = _peer_groups(peer, ctx)
    a_own, a_peers = ctx.pool_advantages(own, peers)
    rows = rows_of(own, ctx.gi, False, a_own)
    for g, a in zip(peers, a_peers, strict=True):
        rows += rows_of(g, ctx.gi, True, a)
    return [(rows, True)]


@register_composition("xgrpo_baseline", pools=True, every_prompt=True)
def xgrpo_baseline(own, peer, ctx: ComposeContext):
    """XGRPO: the receiver's own group only, its advantages over its rewards pooled with every peer's
    rewards on the prompt (the peers' responses move as rewards, not as training rows)."""
    if peer is None or not ctx.selected:
        return [(rows_of(own, ctx.gi, False, ctx.own_advantages(own)), False)]
    peers = _peer_groups(peer, ctx)
    a_own, _ = ctx.pool_advantages(own, peers)
    for g in peers:
        ctx.moved_rewards(g)
    return [(rows_of(own, ctx.gi, False, a_own), False)]


@dataclass
class DensityRatioParams:
    prp_cap: float = 2.0  # C of PRP's truncated density ratio min(pi_old(y) / mu(y), C) (a reading: TIS's C)


@register_weighting(
    "density_ratio",
    score="sequence_ratio",
    Params=DensityRatioParams,
    check=lambda cfg: check_range(cfg, {"prp_cap": (0.0, math.inf, False)}),
)
def density_ratio(ratio: torch.Tensor, cfg, gen) -> torch.Tensor:
    """PRP's importance weight of each peer response: its sequence density ratio (the receiver's pi_old
    over the sampler's mu, each over its own tokens of the text), truncated at ``prp_cap``."""
    log = torch.log(ratio.double().clamp(min=1e-300))
    return algo.truncated_sequence_ratio(log, torch.zeros_like(log), cfg.prp_cap).to(ratio.dtype)


@register_method("prp")
class PRP(Method):
    """Peer rollout pooling: every peer's group pooled on every prompt, peer responses by truncated density ratio."""

    preset = {**Method.preset, "selection": "all", "composition": "pool_all", "weighting": "density_ratio"}
    source = "PRP, Mutual RL (arXiv 2605.07244): from the description (abstract, blog), not the paper's equations"


@register_method("xgrpo")
class XGRPO(Method):
    """Cross-policy advantage sharing: own rollouts only, baselines over own and peer rewards."""

    preset = {**Method.preset, "selection": "all", "composition": "xgrpo_baseline", "weighting": "none"}
    source = "XGRPO, Mutual RL (arXiv 2605.07244): from the description (abstract, blog), not the paper's equations"
