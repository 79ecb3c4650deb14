"""HACPO (Appendix B; its recipe ``recipe/hacpo`` in ``zzx-peter/HACRL-code``): every prompt pools
the receiver's group with its peer's, advantages use a capability-weighted baseline, peer responses
are trained with a sequence-level ratio against the source's mean log-prob, clipped by bounds that
tighten with the update index, and scaled by the capability ratio. Its parts: the ``hacpo``
advantage (:mod:`graft_rl.methods.advantages`) and loss (:mod:`graft_rl.methods.losses`), the
``hacpo_pool`` composition (here), no weighting; the method keeps each policy's capability.
"HACPO + GRAFT which" is ``selection: graft``: the peer-rollout loss only on the prompts GRAFT's
rule selects."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.errors import ConfigError, removed_names
from graft_rl.methods.advantages import CAPABILITY_FLOOR, AdvantageContext, register_advantage
from graft_rl.methods.base import Method, register_method
from graft_rl.methods.config import MethodConfig, check_range
from graft_rl.methods.exchange import ComposeContext, register_composition, rows_of
from graft_rl.methods.losses import LossContext, register_loss

__all__ = ["CAPABILITY_FLOOR", "HACPO", "hacpo_advantage", "hacpo_loss", "hacpo_pool"]


@register_advantage("hacpo", needs_pool=True, needs_capability=True)
def hacpo_advantage(rewards: torch.Tensor, ctx: AdvantageContext) -> torch.Tensor:
    """HACPO's capability-weighted baseline over a pooled group (Appendix B; HACPO Eqs. 5-6:
    :func:`graft_rl.algo.hacpo_advantages`); a group with no peer columns gets GRPO's."""
    n = ctx.own_columns
    if n is None or ctx.sources is None or n == rewards.shape[1]:
        return algo.grpo_advantages(rewards, ctx.cfg.adv_eps)
    peer = ctx.sources[n]
    a_own, a_peer = algo.hacpo_advantages(
        rewards[:, :n], rewards[:, n:], ctx.capability_of(ctx.policy), ctx.capability_of(peer), ctx.cfg.adv_eps
    )
    return torch.cat([a_own, a_peer], dim=1)


@dataclass
class HacpoLossParams:
    hacpo_self_clip_low: float = 3e-4  # own responses' sequence-ratio clip: [1 - low, 1 + high]
    hacpo_self_clip_high: float = 4e-4  # upper side of the own-response clip
    hacpo_peer_clip_start: float = 0.8  # peer responses' lower clip bound at the step's first update
    hacpo_peer_clip_increment: float = 0.025  # ... raised by this per update of the step


def _check_hacpo(cfg) -> None:
    check_range(
        cfg,
        {
            "hacpo_self_clip_low": (0.0, 1.0, True),
            "hacpo_self_clip_high": (0.0, math.inf, True),
            "hacpo_peer_clip_start": (0.0, 1.0, True),
            "hacpo_peer_clip_increment": (0.0, 1.0, True),
        },
    )


def pop_final_eos(response_ids: list[list[int]], mask: torch.Tensor, eos_token_ids) -> None:
    """HACPO's recipe pops a final EOS (own responses, and peer ones: re-tokenised without one)."""
    eos = set(eos_token_ids)
    for i, ids in enumerate(response_ids):
        if len(ids) > 1 and ids[-1] in eos:  # an EOS, not a stop string's text
            mask[i, len(ids) - 1] = 0


@register_loss(
    "hacpo",
    aggregation="response_mean",
    weighted=False,
    kl="own_response_mean",
    loss_mask=pop_final_eos,
    Params=HacpoLossParams,
    check=_check_hacpo,
    corrects=True,
)
def hacpo_loss(lp, old, mask, ctx: LossContext):
    """HACPO (Appendix B; ``recipe/hacpo/hacpo_workers.py``): sequence ratios, own ones PPO-clipped by its
    tiny range, peer ones against the source's mean log-prob with a lower bound rising with the update
    index, scaled by the capability ratio ``kappa`` (:func:`graft_rl.algo.hacpo_policy_loss`)."""
    c = ctx.cfg
    kappa = ctx.extras.get("kappa", torch.ones_like(ctx.adv))
    loss, stats = algo.hacpo_policy_loss(
        lp,
        old,
        ctx.src_mean,
        ctx.adv,
        mask,
        ctx.is_peer,
        ctx.update_index,
        kappa,
        c.hacpo_self_clip_low,
        c.hacpo_self_clip_high,
        c.hacpo_peer_clip_start,
        c.hacpo_peer_clip_increment,
        weights=ctx.correction,  # a correction's weight of each own token [m, T], times that token's term
    )
    stats["clipped"] = stats.pop("clipped_seq")  # whole responses, by its own schedule of bounds
    return loss, stats


@register_composition("hacpo_pool", pools=True, every_prompt=True, keeps_cut=True)
def hacpo_pool(own, peer, ctx: ComposeContext):
    """HACPO: own group plus the peer's on every prompt, advantages over the pool (Appendix B).

    "HACPO + GRAFT which" (``selection: graft``, Appendix G): "We keep the HACPO configuration of
    Appendix B but apply its peer-rollout loss only on prompts where the receiver fails [...] and
    the peer succeeds at least once [...], subject to the balanced exchange. Peer responses on all
    other prompts receive zero advantage and contribute no gradient." So every prompt still pools
    the peer's group (``every_prompt``); on prompts the selection did not choose (``ctx.selected``
    false) the peer responses' advantages are zero. Each peer row carries the capability ratio
    ``kappa`` (``Row.extras``) for the loss. An over-long peer response stays in the loss, cut, as the
    recipe truncates it (``keeps_cut``; hacpo_trajectory.build_training_view, overflow="truncate").
    """
    if peer is None:
        return [(rows_of(own, ctx.gi, False, ctx.own_advantages(own)), False)]
    a_own, a_peer = ctx.pooled_advantages(own, peer)
    if not ctx.selected:  # "which": a prompt GRAFT's rule did not select
        a_peer = [0.0] * len(a_peer)
    peer_rows = rows_of(peer, ctx.gi, True, a_peer)
    kappa = algo.hacpo_capability_ratio(ctx.capability.get(peer.policy, 0.5), ctx.capability.get(own.policy, 0.5))
    for r, lps in zip(peer_rows, peer.gen_logprobs, strict=True):
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
    return [(rows_of(own, ctx.gi, False, a_own) + peer_rows, False)]


@register_method("hacpo")
class HACPO(Method):
    @dataclass
    class Params:
        hacpo_capability_window: int = 5  # steps in each policy's capability (mean success rate)

    preset = {
        **Method.preset,
        "advantage": "hacpo",
        "selection": "all",
        "composition": "hacpo_pool",
        "weighting": "none",
        "loss": "hacpo",
    }
    keeps = ("capability",)
    source = "HACPO: the GRAFT paper (Appendix B) and its recipe's code (zzx-peter/HACRL-code, recipe/hacpo)"

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.hacpo_capability_window < 1:
            raise ConfigError(f"method.hacpo_capability_window must be >= 1, got {cfg.hacpo_capability_window}")

    def __init__(self, cfg: MethodConfig):
        super().__init__(cfg)
        #: each policy's success rate per step, the last ``hacpo_capability_window`` steps
        self.success_history: dict[str, deque] = {}
        self._capability: dict[str, float] = {}

    def _history(self, name: str) -> deque:
        return self.success_history.setdefault(name, deque(maxlen=self.cfg.hacpo_capability_window))

    def capability_of(self, name: str) -> float:
        """The window's mean success rate, floored (the recipe's ``CapabilityTracker``); 0.5 before any step."""
        h = self.success_history.get(name)
        return max(statistics.fmean(h), CAPABILITY_FLOOR) if h else 0.5

    def capability(self) -> dict[str, float]:
        return self._capability

    def observe(self, groups: dict) -> None:
        for name, gs in groups.items():
            # the step's success rate, floored (its recipe's CapabilityTracker)
            self._history(name).append(max(sum(g.k for g in gs) / max(1, sum(g.n for g in gs)), CAPABILITY_FLOOR))
        self._capability.update({n: self.capability_of(n) for n in groups})

    def state_dict(self) -> dict:
        return {"success_history": {k: list(v) for k, v in self.success_history.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.get("success_history", {}).items():
            self._history(k).extend(v)


__getattr__ = removed_names(
    __name__,
    {
        "HacpoExchange": "removed in 0.1.0 (methods are presets of parts): advantage hacpo, composition hacpo_pool",
        "HacpoObjective": "removed in 0.1.0 (methods are presets of parts): loss hacpo",
    },
)
