"""``graft_rl.policy``: one model + tokenizer + optimiser, rollout backends, tiny test models."""

from graft_rl.policy.config import PolicyConfig, auto_micro_batch_tokens, saved_policy_config
from graft_rl.policy.logprobs import token_logprobs_from_logits
from graft_rl.policy.policy import Policy
from graft_rl.policy.rollout import HFBackend, RolloutBackend, Sample, make_backend, sampling_logprobs
from graft_rl.policy.tokens import PromptTooLongError
from graft_rl.policy.training import POLICY_SETTINGS
from graft_rl.policy.types import PolicyError, RolloutGroup, SamplingParams, TokenBatch
from graft_rl.policy.vllm_backend import VLLMBackend

__all__ = [
    "POLICY_SETTINGS",
    "HFBackend",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "PromptTooLongError",
    "RolloutBackend",
    "RolloutGroup",
    "Sample",
    "SamplingParams",
    "TokenBatch",
    "VLLMBackend",
    "auto_micro_batch_tokens",
    "make_backend",
    "sampling_logprobs",
    "saved_policy_config",
    "token_logprobs_from_logits",
]
