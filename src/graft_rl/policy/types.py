"""The data contract passed between layers: one group of rollouts, and token batches.

A peer response crosses models as *text* plus the source's generation log-probs; the
receiver never uses the source's token ids (docs/fidelity.md, re-tokenisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["RolloutGroup", "TokenBatch", "SamplingParams", "PolicyError", "RankFault", "Sample"]


class PolicyError(ValueError):
    """A policy that cannot be built as configured; the message names the field or path."""


class RankFault(RuntimeError):
    """A rank of a sharded policy failed in a phase its ranks run together (a weight push and its check);
    every rank raises it, naming each failed rank's error (:func:`graft_rl.policy.fsdp.agree`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How a group is sampled (Table 3 defaults: temperature 1, top-p 1, full vocabulary)."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = full vocabulary
    max_new_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams: n must be >= 1, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams: temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("SamplingParams: top_k must be >= 0 and max_new_tokens >= 1")


@dataclass
class RolloutGroup:
    """The ``n`` responses one policy sampled for one prompt.

    Fields (``n`` responses; ``L_i`` tokens of response ``i`` under the *source's* tokenizer):
        prompt_id: dataset id of the prompt.
        prompt: the raw problem text (before any model's formatting).
        policy: name of the policy that generated the group.
        texts: ``[n]`` decoded response texts (special tokens removed).
        token_ids: ``[n][L_i]`` generated ids, EOS included when the response stopped.
        gen_logprobs: ``[n][L_i]`` log-probs of the sampled tokens under the *sampling
            distribution* (temperature-scaled and top-p/top-k renormalised logits).
        finish_reasons: ``[n]`` ``"stop"`` (EOS) or ``"length"`` (cut at max_new_tokens).
        rewards: ``[n]`` binary rewards, filled in after verification.
    """

    prompt_id: str
    prompt: str
    policy: str
    texts: list[str]
    token_ids: list[list[int]]
    gen_logprobs: list[list[float]]
    finish_reasons: list[str]
    rewards: list[float] = field(default_factory=list)
    # per response: reward >= data.success_threshold (set by the trainer's verification); empty: reward > 0
    success: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.texts)
        if not (len(self.token_ids) == len(self.gen_logprobs) == len(self.finish_reasons) == n):
            raise ValueError(
                f"RolloutGroup {self.prompt_id!r}: texts, token_ids, gen_logprobs, finish_reasons differ in length"
            )
        for ids, lps in zip(self.token_ids, self.gen_logprobs, strict=True):
            if len(ids) != len(lps):
                raise ValueError(
                    f"RolloutGroup {self.prompt_id!r}: a response has {len(ids)} ids but {len(lps)} log-probs"
                )

    @property
    def n(self) -> int:
        return len(self.texts)

    @property
    def succeeded(self) -> list[bool]:
        """Per response: ``success`` where the trainer set it, else ``reward > 0`` (rewards must be set)."""
        return list(self.success) if len(self.success) == len(self.rewards) else [r > 0 for r in self.rewards]

    @property
    def k(self) -> int:
        """Number of successful responses (:attr:`succeeded`)."""
        return sum(self.succeeded)

    @property
    def truncated(self) -> list[bool]:
        return [f == "length" for f in self.finish_reasons]


@dataclass
class TokenBatch:
    """Sequences under one policy's own tokenisation: formatted prompt ids + response ids.

    ``response_tensors`` gives the right-padded ``[M, T]`` response-aligned view that the
    algorithm layer works on.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    cut: list[int] = field(default_factory=list)  # rows re-tokenised past a length cap and cut to it

    def __post_init__(self) -> None:
        if len(self.prompt_ids) != len(self.response_ids):
            raise ValueError("TokenBatch: prompt_ids and response_ids differ in length")

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, rows) -> TokenBatch:
        rows = [int(r) for r in rows]
        return TokenBatch([self.prompt_ids[r] for r in rows], [self.response_ids[r] for r in rows])

    def lengths(self) -> list[int]:
        """Tokens per sequence (prompt + response): what a forward pass computes for each row."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]

    @property
    def max_response_len(self) -> int:
        return max((len(r) for r in self.response_ids), default=0)

    def response_mask(self) -> torch.Tensor:
        T = self.max_response_len
        lengths = torch.tensor([len(r) for r in self.response_ids])
        return (torch.arange(T)[None, :] < lengths[:, None]).float()

    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
