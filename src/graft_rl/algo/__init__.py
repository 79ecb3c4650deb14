"""``graft_rl.algo``: GRAFT's equations and the baselines' building blocks, pure torch.

The public API (stable; other code and external checks call these names; docs/design.md, layer 1):
:func:`grpo_advantages`, :func:`complementary_mask`, :func:`balanced_exchange`,
:func:`mean_token_logprob`, :func:`compatibility_score`, :func:`compatibility_weight`,
:func:`policy_loss`, :func:`minibatch_order`. Appendix B/G building blocks live in
:mod:`graft_rl.algo.baselines` and are re-exported here.
"""

from graft_rl.algo.baselines import (
    count_matched_random_prompts,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    gspo_policy_loss,
    hacpo_advantages,
    hacpo_capability_ratio,
    hacpo_peer_clip_lower,
    hacpo_policy_loss,
    luffy_policy_loss,
    luffy_shaping,
    pooled_advantages,
    random_admission_weight,
    reference_kl,
    rloo_advantages,
    sequence_reference_kl,
    sgt_eligible,
    sgt_nll,
    sgt_select,
    success_only_mask,
)
from graft_rl.algo.core import (
    MAX_LOG_RATIO,
    balanced_exchange,
    compatibility_score,
    compatibility_weight,
    complementary_mask,
    grpo_advantages,
    mean_token_logprob,
    minibatch_order,
    per_char_compatibility_score,
    policy_loss,
)

__all__ = [
    "MAX_LOG_RATIO",
    "balanced_exchange",
    "compatibility_score",
    "compatibility_weight",
    "complementary_mask",
    "count_matched_random_prompts",
    "dr_grpo_advantages",
    "dynamic_sampling_mask",
    "gspo_policy_loss",
    "grpo_advantages",
    "hacpo_advantages",
    "hacpo_capability_ratio",
    "hacpo_peer_clip_lower",
    "hacpo_policy_loss",
    "luffy_policy_loss",
    "luffy_shaping",
    "mean_token_logprob",
    "minibatch_order",
    "per_char_compatibility_score",
    "policy_loss",
    "pooled_advantages",
    "random_admission_weight",
    "reference_kl",
    "rloo_advantages",
    "sequence_reference_kl",
    "sgt_eligible",
    "sgt_nll",
    "sgt_select",
    "success_only_mask",
]
