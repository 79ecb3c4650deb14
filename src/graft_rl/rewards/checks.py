"""Checks that run inside verifier worker processes (see :mod:`graft_rl.rewards.pool`).

Each takes JSON-able arguments and returns a float score. They may be slow or hang on
pathological input; the pool bounds them with a hard wall-clock timeout.
"""

from __future__ import annotations

import contextlib
import io
from functools import lru_cache

__all__ = ["math_equal", "gym_score", "warm_up"]


def warm_up() -> None:
    """Run one small comparison so that math-verify's first-use imports and grammar set-up happen
    while the worker starts (before ``READY``), not inside the first answer's timeout."""
    math_equal("\\frac{1}{2}", "0.5")


@lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    from math_verify import parse

    return parse("\\boxed{" + gold + "}")


def math_equal(pred: str, gold: str) -> float:
    """1.0 if math-verify finds ``pred`` (a boxed answer's content) equal to ``gold``, else 0.0."""
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold)
    pred_parsed = parse("\\boxed{" + pred + "}")
    if not gold_parsed or not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed) else 0.0


@lru_cache(maxsize=64)
def _gym_dataset(name: str, size: int, seed: int, config_json: str):
    import json

    import reasoning_gym

    with contextlib.redirect_stdout(io.StringIO()):  # reasoning-gym's ``bf`` prints a dot per problem
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def gym_score(name: str, size: int, seed: int, config_json: str, index: int, answer: str) -> float:
    """reasoning-gym's own ``score_answer`` for entry ``index`` of a re-created dataset."""
    ds = _gym_dataset(name, size, seed, config_json)
    with contextlib.redirect_stdout(io.StringIO()):
        entry = ds[index]
    return float(ds.score_answer(answer, entry))
