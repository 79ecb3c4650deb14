"""Binary verifiable rewards: math (math-verify), GSM8K numbers, reasoning-gym tasks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence

from graft_rl.rewards.extract import _NUM_RE, last_boxed, normalize_answer, parse_number, parse_whole_number
from graft_rl.rewards.pool import Outcome, VerifierPool, VerifyStats

__all__ = ["verify_math", "verify_math_detailed", "verify_gsm8k", "gym_scores", "score_responses", "default_pool"]

_default_pool: VerifierPool | None = None
_default_lock = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide verifier pool, created on first use."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = VerifierPool()
        return _default_pool


def _finish(
    outcomes: list,
    todo: list[int],
    fn: str,
    args: list,
    timeout: float,
    pool,
    stats: VerifyStats,
    t0: float,
    budget: float | None = None,
) -> None:
    """Run the undecided items in the pool (each distinct argument tuple once), fill their outcomes,
    and count everything."""
    if todo:
        keys = [json.dumps(a) for a in args]
        unique = list(dict.fromkeys(keys))
        first = {k: args[keys.index(k)] for k in unique}
        done = dict(
            zip(
                unique,
                (pool or default_pool()).map(fn, [first[k] for k in unique], timeout=timeout, budget=budget),
                strict=True,
            )
        )
        for i, k in zip(todo, keys, strict=True):
            outcomes[i] = done[k]
    for o in outcomes:
        stats.add(o)
    stats.seconds = time.monotonic() - t0


def _check_lengths(responses: Sequence[str], answers: Sequence[str], who: str) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"{who}: got {len(responses)} responses but {len(answers)} answers")


def verify_math_detailed(
    responses: Sequence[str],
    answers: Sequence[str],
    timeout: float = 5.0,
    pool: VerifierPool | None = None,
    budget: float | None = None,
) -> tuple[list[float], VerifyStats]:
    """:func:`verify_math` plus counters (timeouts, errors, crashes, answers without a box, over budget).

    Identical (answer, reference) pairs are checked once; ``budget`` bounds the whole batch's
    wall-clock time (what is left then scores 0 and is counted as ``budget``)."""
    _check_lengths(responses, answers, "verify_math")
    t0 = time.monotonic()
    stats = VerifyStats()
    outcomes: list[Outcome | None] = [None] * len(responses)
    todo: list[int] = []
    args: list[tuple[str, str]] = []
    for i, (resp, gold) in enumerate(zip(responses, answers, strict=True)):
        pred = last_boxed(resp)
        if pred is None or not pred:
            outcomes[i] = Outcome(0.0, "skipped")
        elif normalize_answer(pred) == normalize_answer(gold):
            outcomes[i] = Outcome(1.0, "skipped")
        else:
            todo.append(i)
            args.append((pred, gold))
    _finish(outcomes, todo, "graft_rl.rewards.checks:math_equal", args, timeout, pool, stats, t0, budget)
    return [o.score for o in outcomes], stats


def verify_math(responses: Sequence[str], answers: Sequence[str], timeout: float = 5.0) -> list[float]:
    r"""Binary math rewards: math-verify on the **last** ``\boxed{}`` of each response.

    A response without a boxed answer scores 0. Each verification runs in a worker
    process and is bounded by ``timeout`` seconds of wall time, enforced from outside
    math-verify (whose own signal timer only works on the main thread), so this is safe
    from any thread, inside Ray actors, and in scripts without a ``__main__`` guard.
    Timeout, error or a crashed worker score 0.0 (see :func:`verify_math_detailed` for counts).

    Examples:
        >>> verify_math([r"... so \boxed{\frac{1}{2}}", r"\boxed{0.5}", "no box", r"\boxed{3}"],
        ...             ["1/2", r"\frac12", "1", "4"])
        [1.0, 1.0, 0.0, 0.0]
    """
    return verify_math_detailed(responses, answers, timeout)[0]


def verify_gsm8k(responses: Sequence[str], answers: Sequence[str], rel_tol: float = 1e-6) -> list[float]:
    r"""Binary GSM8K rewards: the last ``\boxed{}`` (else the line after the last ``####``) must be
    *one* number equal to the reference (:func:`~graft_rl.rewards.extract.parse_whole_number`:
    never "the first number" of ``12-5`` or ``3 or 4 or 5``); a response with neither is judged
    by its last number.

    Pure string/float work with bounded cost, so it runs in-process.

    Examples:
        >>> verify_gsm8k([r"\boxed{1,200}", "#### 18", "so it is 7 apples", "\\boxed{x}"], ["1200", "18", "7", "3"])
        [1.0, 1.0, 1.0, 0.0]
        >>> verify_gsm8k([r"\boxed{1/2}", r"\boxed{12-5}", r"\boxed{3 or 4 or 5}", r"\boxed{\frac{1}{2}}"], ["1", "12", "3", "0.5"])
        [0.0, 0.0, 0.0, 1.0]
    """
    _check_lengths(responses, answers, "verify_gsm8k")
    out = []
    for resp, gold in zip(responses, answers, strict=True):
        boxed = last_boxed(resp)
        if boxed is not None:
            pred = parse_whole_number(boxed)
        elif "####" in resp:
            pred = parse_whole_number(resp.rsplit("####", 1)[1].strip().split("\n", 1)[0])
        else:
            nums = list(_iter_numbers(resp))
            pred = parse_number(nums[-1]) if nums else None
        ref = parse_whole_number(gold)  # the reference held to the response's rule (data.check_answers refuses others)
        ok = pred is not None and ref is not None and abs(pred - ref) <= rel_tol * max(1.0, abs(ref))
        out.append(1.0 if ok else 0.0)
    return out


def _iter_numbers(text: str):
    return (m.group(0) for m in _NUM_RE.finditer(text[-2000:]))


def gym_scores(
    responses: Sequence[str],
    source: str,
    indices: Sequence[int],
    timeout: float = 5.0,
    binary: bool = True,
    pool: VerifierPool | None = None,
    budget: float | None = None,
) -> tuple[list[float], VerifyStats]:
    r"""Score responses with a reasoning-gym dataset's own ``score_answer``.

    ``source`` is the row's ``source`` field written by :class:`graft_rl.data.ReasoningGymTask`
    (``reasoning_gym:NAME:SIZE:SEED:CONFIG_JSON``); ``indices`` the entries' indices. The
    answer is the content of the last ``\boxed{}``. With ``binary`` a score counts as 1 only
    when reasoning-gym gives full credit (rewards are binary). Scoring runs in the
    verifier pool, under the same hard timeout as math.
    """
    if len(responses) != len(indices):
        raise ValueError(f"gym_scores: got {len(responses)} responses but {len(indices)} indices")
    kind, name, size, seed, config_json = source.split(":", 4)
    if kind != "reasoning_gym":
        raise ValueError(f"gym_scores: source must start with 'reasoning_gym:', got {source!r}")
    json.loads(config_json)  # fail here, not in a worker
    t0 = time.monotonic()
    stats = VerifyStats()
    outcomes: list[Outcome | None] = [None] * len(responses)
    todo, args = [], []
    for i, (resp, idx) in enumerate(zip(responses, indices, strict=True)):
        pred = last_boxed(resp)
        if not pred:
            outcomes[i] = Outcome(0.0, "skipped")
        else:
            todo.append(i)
            args.append((name, int(size), int(seed), config_json, int(idx), pred))
    _finish(outcomes, todo, "graft_rl.rewards.checks:gym_score", args, timeout, pool, stats, t0, budget)
    scores = [o.score for o in outcomes]
    if binary:
        scores = [1.0 if s >= 1.0 else 0.0 for s in scores]
    return scores, stats


def score_responses(
    responses: Sequence[str],
    answers: Sequence[str],
    verifier: str = "math",
    sources: Sequence[str | None] | None = None,
    ids: Sequence[str] | None = None,
    timeout: float = 5.0,
    budget: float | None = None,
) -> tuple[list[float], VerifyStats]:
    """Binary rewards with the named verifier (``math``, ``gsm8k`` or ``gym``) and counters;
    ``budget`` bounds the wall-clock time of the whole batch.

    ``gym`` needs each row's ``source`` and ``id`` (as written by ``ReasoningGymTask``).
    """
    _check_lengths(responses, answers, "score_responses")
    if verifier == "math":
        return verify_math_detailed(responses, answers, timeout, budget=budget)
    if verifier == "gsm8k":
        t0 = time.monotonic()
        scores = verify_gsm8k(responses, answers)
        stats = VerifyStats(total=len(scores), skipped=len(scores), seconds=time.monotonic() - t0)
        return scores, stats
    if verifier == "gym":
        if sources is None or ids is None:
            raise ValueError("score_responses: verifier 'gym' needs sources and ids")
        scores = [0.0] * len(responses)
        total = VerifyStats()
        t_end = time.monotonic() + budget if budget is not None else None
        for src in dict.fromkeys(sources):
            rows = [i for i, s in enumerate(sources) if s == src]
            left = max(1e-3, t_end - time.monotonic()) if t_end is not None else None
            got, st = gym_scores(
                [responses[i] for i in rows], src, [int(ids[i].rsplit("/", 1)[1]) for i in rows], timeout, budget=left
            )
            for i, s in zip(rows, got, strict=True):
                scores[i] = s
            for k in ("total", "ok", "timeout", "error", "crash", "skipped", "budget"):
                setattr(total, k, getattr(total, k) + getattr(st, k))
            total.seconds += st.seconds
            total.errors.extend(st.errors[: 20 - len(total.errors)])
        return scores, total
    raise ValueError(f"score_responses: unknown verifier {verifier!r}; use 'math', 'gsm8k' or 'gym'")
