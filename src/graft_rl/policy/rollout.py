"""Rollout backends: one interface, two engines (docs/design.md, layer 3).

- ``hf``: :class:`~graft_rl.policy.hf_backend.HFBackend`, transformers' model in a KV-cached sampling
  loop that records each token's log-prob under the sampling distribution (CPU or GPU);
- ``vllm``: :class:`~graft_rl.policy.vllm_backend.VLLMBackend`, vLLM's engine with verified weight
  pushes and sleep, imported only when chosen.
"""

from __future__ import annotations

from typing import Protocol

from graft_rl.policy.hf_backend import (
    GEN_MEMORY_BUDGET_BYTES,
    HFBackend,
    auto_gen_batch_rows,
    kv_bytes_per_token,
    sampling_logprobs,
)
from graft_rl.policy.types import Sample, SamplingParams

__all__ = [
    "Sample",
    "RolloutBackend",
    "HFBackend",
    "sampling_logprobs",
    "make_backend",
    "GEN_MEMORY_BUDGET_BYTES",
    "kv_bytes_per_token",
    "auto_gen_batch_rows",
]


class RolloutBackend(Protocol):
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, in prompt order."""

    def sync_weights(self) -> None:
        """Make the engine sample from the trainer's current weights."""


def make_backend(kind: str, policy) -> RolloutBackend:
    """``hf`` or ``vllm`` for a :class:`~graft_rl.policy.Policy`."""
    if kind == "hf":
        # a sharded policy samples from its unsharded float32 rollout copy (FSDP2), under autocast
        copy = getattr(policy, "rollout_model", None)
        return HFBackend(
            copy or policy.model,
            policy.eos_token_ids,
            policy.tokenizer.pad_token_id,
            policy.config.gen_batch_size,
            policy.autocast_context if copy is not None else policy.compute_context,
            stop=policy.config.stop,
            decode=lambda ids: policy.tokenizer.decode(ids, skip_special_tokens=True),
        )  # as the texts are
    if kind == "vllm":
        from graft_rl.policy.vllm_backend import VLLMBackend

        # every rank builds its engine, rollout_on_rank0 included: vLLM's start-up creates its groups with
        # new_group over the existing default group, a collective every rank must join
        weights_fn = getattr(policy, "rollout_weights", None)  # a sharded policy's gathered full weights
        return VLLMBackend(
            policy.model,
            policy.model_dir,
            dtype=policy.config.dtype,
            weights_fn=weights_fn,
            digest_fn=policy.push_digest,
            tied=policy.tied_names(),
            state_fn=policy.rollout_state,
            push_at_start=policy.lora is not None,  # the engine loads the base; the adapters are merged in
            digest_stream=policy.lora is not None,  # merged tensors made (sharded: gathered) once a push
            agree=getattr(policy, "agree", None),  # a sharded policy: a push ends alike on every rank
            stop=policy.config.stop,
            name=policy.name,
            device=policy.config.device,
            **policy.config.vllm_kwargs,
        )
    raise ValueError(f"unknown rollout backend {kind!r}; use 'hf' or 'vllm'")
