"""A receiver's batch (:class:`ReceiverBatch`, one :class:`Row` per response): what the driver's
exchange (:mod:`graft_rl.methods.exchange`) builds for a receiver and the receiver's side
(:mod:`graft_rl.methods.receiver`) trains on, with each row's source, reward, source-computed
advantage (Section 4.1) and the source's mean generation log-prob the compatibility *s* needs
(Section 4.2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from graft_rl.policy import RolloutGroup

__all__ = ["ReceiverBatch", "Row", "group_rewards", "rows_of", "success_counts", "successes"]


@dataclass
class Row:
    """One response in a receiver's batch (own, grafted, pooled or auxiliary)."""

    group: int  # index into ReceiverBatch.groups
    prompt_id: str
    prompt: str
    source: str  # the policy that generated it
    is_peer: bool
    text: str
    token_ids: list[int] | None  # the source's ids: used when source == receiver, or by a peer_tokens loss
    finished: bool
    reward: float
    advantage: float
    src_logprob_sum: float  # sum of the source's generation log-probs
    src_mean_logprob: float  # mean of the same (paper's l-bar)
    index: int = 0  # position in the source's group
    success: bool = False  # reward >= data.success_threshold
    is_aux: bool = False  # SGT auxiliary NLL target, not in the policy-gradient term
    include: bool = True  # False: removed from numerator and denominator (success-only)
    weight: float = 1.0  # compatibility weight, set by the weighting from the compatibility s
    # per-row numbers a method's objective reads (e.g. HACPO's capability ratio "kappa"), by name
    extras: dict[str, float] = field(default_factory=dict)
    # the source's per-token engine log-probs (log mu of token_ids): of an own row, the gap to pi_old and
    # its correction (graft_rl.methods.corrections); of a peer's row, read only by a loss with
    # peer_tokens (one vocabulary, F-TIS), since a re-tokenised response has no per-token mu
    gen_logprobs: list[float] | None = None


@dataclass
class ReceiverBatch:
    receiver: str
    rows: list[Row]
    group_is_peer: list[bool]  # per planned group: contains grafted/peer responses
    stats: dict[str, float] = field(default_factory=dict)
    # exchange records of what moved without a row (XGRPO: the peer rewards in a receiver's baselines)
    moved: list[dict] = field(default_factory=list)

    def group_rows(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.group_is_peer]
        for i, r in enumerate(self.rows):
            out[r.group].append(i)
        return out


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
                gen_logprobs=list(lps),
            )
        )
    return rows
