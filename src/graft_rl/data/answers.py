"""Which verifier scores a dataset, and reference answers it could never match (refused at load)."""

from __future__ import annotations

from collections.abc import Sequence

from graft_rl.data.catalog import BUILTIN, TESTBED_DATA
from graft_rl.data.problem import DatasetError, Problem

__all__ = ["default_reward", "verifier_for", "check_answers"]


def default_reward(name_or_path: str, problem: Problem | None = None) -> str | None:
    """The reward a dataset names itself: a built-in set's verifier, ``gym`` for reasoning-gym rows;
    None for a user's file (its reward is the run's ``data.reward``)."""
    if problem is not None and problem.source and problem.source.startswith("reasoning_gym:"):
        return "gym"
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path][1]
    if name_or_path in TESTBED_DATA:
        return TESTBED_DATA[name_or_path][1]
    if name_or_path.startswith("reasoning_gym:"):
        return "gym"
    return None


def verifier_for(name_or_path: str, problem: Problem | None = None) -> str:
    """Which built-in verifier scores this dataset when nothing names one: its own
    (:func:`default_reward`), else ``math``."""
    return default_reward(name_or_path, problem) or "math"


def check_answers(problems: Sequence[Problem], verifier: str, name: str) -> None:
    """Refuse reference answers the verifier that will score them can never match (one line naming
    the dataset and problem): an empty or NaN answer for ``math``; for ``gsm8k`` anything but one
    number, by the rule responses are held to (:func:`~graft_rl.rewards.extract.parse_whole_number`:
    ``1/2``, ``12-5``, ``3 or 4`` or ``2^{10}`` are not one number, and a response's boxed ``1``
    must not match them). ``gym`` answers are scored by reasoning-gym itself."""
    from graft_rl.data.table import ProblemTable

    if isinstance(problems, ProblemTable):  # each distinct answer once, then the first row holding a bad one
        import pyarrow as pa
        import pyarrow.compute as pc

        answers = problems.column("answer")
        bad = [a for a in answers.unique().to_pylist() if _unmatchable(a, verifier)]
        if bad:
            mask = pc.is_in(answers, value_set=pa.array(bad, pa.string())).to_numpy(zero_copy_only=False)
            problems = [problems[int(mask.nonzero()[0][0])]]
        else:
            return
    for p in problems:
        if _unmatchable(p.answer, verifier) and verifier == "gsm8k":
            raise DatasetError(
                f"{name}: problem {p.id!r} has answer {p.answer!r}, which is not one number; the gsm8k "
                f"verifier compares a response's one number with it, so it could never score"
            )
        if _unmatchable(p.answer, verifier):
            raise DatasetError(
                f"{name}: problem {p.id!r} has answer {p.answer!r}; the math verifier could never match it"
            )


def _unmatchable(answer: str, verifier: str) -> bool:
    """Whether a reference answer is one the verifier could never match (see :func:`check_answers`)."""
    import math

    from graft_rl.rewards.extract import parse_whole_number

    text = answer.strip()
    if verifier == "gsm8k":
        value = parse_whole_number(text)
        return value is None or not math.isfinite(value)
    return verifier == "math" and (not text or text.lower() in ("nan", "none", "null"))
