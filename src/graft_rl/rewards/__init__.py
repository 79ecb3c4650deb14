"""``graft_rl.rewards``: binary verifiable rewards that cannot hang or crash training (docs/design.md, layer 2).

Public entry point: :func:`verify_math`. Also :func:`verify_gsm8k` (numbers) and
:func:`gym_scores` (reasoning-gym tasks' own scoring), and :class:`VerifierPool`, the
worker pool with a hard per-answer timeout behind them.
"""

from graft_rl.rewards.extract import last_boxed, normalize_answer, parse_number
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
