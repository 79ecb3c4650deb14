"""pass@k evaluation of a policy on verifiable problems (paper Section 5.1, Evaluation).

pass@1 is estimated by averaging correctness over the ``k`` samples of each problem, then
over problems; pass@k uses the unbiased estimator of Chen et al. (2021),
``1 - C(n - c, k) / C(n, k)`` for ``c`` correct out of ``n`` samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from graft_rl.data import Problem
from graft_rl.policy import Policy, SamplingParams
from graft_rl.rewards import Reward, resolve_reward

__all__ = ["pass_at_k", "evaluate_policy", "families", "pass1_by_family", "MAX_FAMILIES", "EVAL_CHUNK"]

#: Problems per generate call in :func:`evaluate_policy`; chunk ``s`` (its first problem's index) is
#: sampled with ``seed + s``, so a chunk evaluated alone (``graft eval`` over several replicas)
#: gives what it gives inside the whole set.
EVAL_CHUNK = 64

#: Reported per family only when the data names this few (the testbed kinds; MATH's seven subjects).
MAX_FAMILIES = 8


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples.

    Examples:
        >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), round(pass_at_k(4, 2, 2), 4)
        (0.25, 1.0, 0.8333)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_policy(
    policy: Policy,
    problems: Sequence[Problem],
    reward: str | Reward = "math",
    samples: int = 8,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 4096,
    seed: int = 0,
    timeout: float = 5.0,
    batch_prompts: int = EVAL_CHUNK,
    top_k: int = 0,
    budget: float | None = None,
) -> dict:
    """Sample ``samples`` responses per problem and score them with ``reward`` (a built-in verifier's
    name, or a :class:`~graft_rl.rewards.Reward`); a response is correct when its reward reaches the
    reward's success threshold.

    ``budget``: seconds of verification per chunk of ``batch_prompts`` problems, as a training step's
    ``data.verify_budget`` bounds its batch; answers still unchecked then score 0 and are counted.
    Returns ``{"pass@1", "pass@k": {k: value}, "correct": [c per problem], "samples", "n_problems",
    "truncated_frac", "verify_over_budget", "reward_mean"}``; pass@k for every power of two up to ``samples`` and
    ``samples`` itself.
    """
    sp = SamplingParams(samples, temperature, top_p, top_k, max_new_tokens)  # top_k 1: greedy
    reward = resolve_reward(reward)
    correct: list[int] = []
    truncated = total = over_budget = 0
    reward_sum = 0.0
    for s in range(0, len(problems), batch_prompts):
        chunk = list(problems[s : s + batch_prompts])
        groups = policy.generate([(p.id, p.problem) for p in chunk], sp, seed=seed + s)
        flat = [(p, t) for p, g in zip(chunk, groups, strict=True) for t in g.texts]
        scores, st = reward.score([t for _, t in flat], [p.row() for p, _ in flat], timeout, budget)
        reward_sum += sum(scores)
        over_budget += st.budget
        for i in range(len(chunk)):
            correct.append(sum(reward.successes(scores[i * samples : (i + 1) * samples])))
        truncated += sum(f == "length" for g in groups for f in g.finish_reasons)
        total += sum(g.n for g in groups)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, samples) if k <= samples})
    return {
        "pass@1": statistics.fmean(c / samples for c in correct),
        "pass@k": {k: statistics.fmean(pass_at_k(samples, c, k) for c in correct) for k in ks},
        "correct": correct,
        "samples": samples,
        "n_problems": len(problems),
        "truncated_frac": truncated / max(total, 1),
        "verify_over_budget": over_budget,
        "reward_mean": reward_sum / max(total, 1),
    }


def families(problems: Sequence[Problem]) -> dict[str, str]:
    """Problem id -> family (the problem's ``subject``) when every problem names one and there are
    2..MAX_FAMILIES of them; else ``{}``."""
    fams = {p.id: p.subject for p in problems}
    if any(f is None for f in fams.values()) or not 2 <= len(set(fams.values())) <= MAX_FAMILIES:
        return {}
    return {k: str(v) for k, v in fams.items()}  # every one a subject (checked above)


def pass1_by_family(problems: Sequence[Problem], correct: Sequence[int], samples: int) -> dict[str, float]:
    """pass@1 per family (``subject``) from :func:`evaluate_policy`'s ``correct`` counts."""
    by: dict[str, list[float]] = {}
    for p, c in zip(problems, correct, strict=True):
        by.setdefault(str(p.subject), []).append(c / samples)  # families: every problem has a subject
    return {f: statistics.fmean(v) for f, v in sorted(by.items())}
