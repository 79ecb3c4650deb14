"""``graft_rl.rewards``: verifiable rewards that cannot hang or crash training (docs/design.md, layer 2).

Public entry points: :func:`resolve_reward` (``data.reward``: a built-in, a registered name, a
function by import path, or a callable; docs/tasks.md) and :func:`verify_math`. Also :func:`verify_gsm8k` (numbers) and
:func:`gym_scores` (reasoning-gym tasks' own scoring), and :class:`VerifierPool`, the
worker pool with a hard per-answer timeout behind them.
"""

from graft_rl.rewards.extract import last_boxed, normalize_answer, parse_number
from graft_rl.rewards.functions import (
    BUILTIN_REWARDS,
    Reward,
    RewardError,
    register_reward,
    registered_rewards,
    resolve_reward,
)
from graft_rl.rewards.pool import Outcome, VerifierPool, VerifyStats
from graft_rl.rewards.verifiers import (
    default_pool,
    gym_scores,
    score_responses,
    verify_gsm8k,
    verify_math,
    verify_math_detailed,
)

__all__ = [
    "BUILTIN_REWARDS",
    "Reward",
    "RewardError",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "Outcome",
    "VerifierPool",
    "VerifyStats",
    "default_pool",
    "gym_scores",
    "last_boxed",
    "normalize_answer",
    "parse_number",
    "score_responses",
    "verify_gsm8k",
    "verify_math",
    "verify_math_detailed",
]
