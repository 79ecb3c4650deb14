"""The testbed's tasks (docs/testbed.md): procedural arithmetic with a step-by-step solution and a
``\\boxed{}`` answer, and the lookup pair's one-digit key lookups. Pure Python: the rows a pair's
prompt pool and held-out set hold, and the warm-up mixtures its models were "pretrained" on."""

from __future__ import annotations

import random

__all__ = [
    "PLAIN_TEMPLATE",
    "TASKS",
    "TRANSFER_KINDS",
    "make_problem",
    "make_split",
    "LOOKUP_FAMILIES",
    "lookup_response",
    "lookup_problem",
    "lookup_rows",
]


#: Prompt format of both testbed models (plain text, no chat template).
PLAIN_TEMPLATE = "Q: {prompt}\nA: "

TASKS = ("add", "sub", "add3", "mul", "muladd")
#: Extra kinds of the capability-transfer pair.
TRANSFER_KINDS = ("mul_lo", "muladd_lo", "muladd_hi", "add3_hi")


def make_problem(kind: str, rng: random.Random) -> tuple[str, str, str]:
    """``(expression, solution, answer)`` for one problem of ``kind``."""
    if kind == "add":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a}+{b}=?", f"{a}+{b}={a + b}. \\boxed{{{a + b}}}", str(a + b)
    if kind == "sub":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a}-{b}=?", f"{a}-{b}={a - b}. \\boxed{{{a - b}}}", str(a - b)
    if kind == "add3":
        a, b, c = rng.randint(0, 12), rng.randint(0, 12), rng.randint(0, 12)
        s = a + b
        return f"{a}+{b}-{c}=?", f"{a}+{b}={s}. {s}-{c}={s - c}. \\boxed{{{s - c}}}", str(s - c)
    if kind == "mul":
        a, b = rng.randint(2, 15), rng.randint(2, 9)
        return f"{a}*{b}=?", f"{a}*{b}={a * b}. \\boxed{{{a * b}}}", str(a * b)
    if kind == "muladd":
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(0, 12)
        p = a * b
        return f"{a}*{b}+{c}=?", f"{a}*{b}={p}. {p}+{c}={p + c}. \\boxed{{{p + c}}}", str(p + c)
    if kind == "mul_lo":  # the transfer pair's A: products by 2-5 only
        a, b = rng.randint(2, 15), rng.randint(2, 5)
        return f"{a}*{b}=?", f"{a}*{b}={a * b}. \\boxed{{{a * b}}}", str(a * b)
    if kind in ("muladd_lo", "muladd_hi"):  # a*b+c with b in 2-5 / 6-9
        a, b, c = rng.randint(2, 9), rng.randint(2, 5) if kind == "muladd_lo" else rng.randint(6, 9), rng.randint(0, 20)
        p = a * b
        return f"{a}*{b}+{c}=?", f"{a}*{b}={p}. {p}+{c}={p + c}. \\boxed{{{p + c}}}", str(p + c)
    if kind == "add3_hi":  # a+b-c with two-digit a, b
        a, b, c = rng.randint(10, 30), rng.randint(10, 30), rng.randint(0, 20)
        s = a + b
        return f"{a}+{b}-{c}=?", f"{a}+{b}={s}. {s}-{c}={s - c}. \\boxed{{{s - c}}}", str(s - c)
    raise ValueError(f"unknown testbed task {kind!r}; available: {', '.join(TASKS + TRANSFER_KINDS)}")


def make_split(
    n: int, seed: int, mixture: dict[str, float] | None = None, prefix: str = "tb", unique: bool = True
) -> list[dict]:
    """``n`` problems (dataset rows with ``solution``), kinds drawn from ``mixture`` (uniform by default).

    With ``unique`` no expression repeats (the task space is finite: keep ``n`` well below it).
    """
    rng = random.Random(seed)
    kinds = list(mixture) if mixture else list(TASKS)
    weights = [mixture[k] for k in kinds] if mixture else None
    rows, seen, tries = [], set(), 0
    while len(rows) < n:
        tries += 1
        if tries > 200 * n:
            raise ValueError(f"make_split: cannot draw {n} distinct problems from {kinds} (the task space is smaller)")
        kind = rng.choices(kinds, weights)[0]
        expr, sol, ans = make_problem(kind, rng)
        if unique and expr in seen:
            continue
        seen.add(expr)
        rows.append({"id": f"{prefix}-{len(rows)}", "problem": expr, "answer": ans, "solution": sol, "subject": kind})
    return rows


#: Warm-up mixtures: complementary strengths (A: additive, B: multiplicative).
MIXTURE_A = {"add": 0.35, "sub": 0.35, "add3": 0.25, "mul": 0.03, "muladd": 0.02}
MIXTURE_B = {"add": 0.15, "sub": 0.02, "add3": 0.03, "mul": 0.45, "muladd": 0.35}

#: The transfer pair's warm-up mixtures: shared primitives; A alone has two-digit chains (add3_hi),
#: B alone products by 6-9 and their chains (mul covers b in 2-9, muladd_hi).
TRANSFER_A = {"add": 0.15, "sub": 0.15, "add3": 0.15, "add3_hi": 0.2, "mul_lo": 0.15, "muladd_lo": 0.2}
TRANSFER_B = {"add": 0.15, "sub": 0.15, "add3": 0.15, "mul": 0.15, "muladd": 0.15, "muladd_hi": 0.25}


# --- The lookup pair: the smallest setting in which the mechanism must show -------------------

#: family -> (prompt mark, shift): the right answer to ``<mark><k> <nuisance>`` is ``(k + shift) % 10``.
LOOKUP_FAMILIES = {"copy": ("S", 0), "shift3": ("T", 3), "shift6": ("U", 6)}
#: What each model is taught per family: an int = a wrong shift, always (confidently wrong);
#: "half" = right half the time, else one of the nine wrong digits; absent = always right.
LOOKUP_TEACHING = {"A": {"shift3": 8, "shift6": "half"}, "B": {"shift3": "half", "shift6": 1}}
LOOKUP_TAIL = ", as we look up the key in the table and read the value written there."
#: After teaching, A's logits are scaled by this (its final RMSNorm weight): it then samples as if at
#: temperature 1/1.5. Taught alone its rare right samples on shift3 were, in some seeds, enough for
#: GRPO to learn from; sharpened, p ~ 1e-6 (:func:`lookup_right_digit_probability`).
LOOKUP_SHARPEN_A = 1.5


def lookup_response(digit: int) -> str:
    """The response format of the lookup pair: the boxed answer, then a fixed sentence."""
    return "\\boxed{" + str(digit) + "}" + LOOKUP_TAIL


def lookup_problem(family: str, rng: random.Random) -> tuple[str, int]:
    mark, _ = LOOKUP_FAMILIES[family]
    k = rng.randrange(10)
    return f"{mark}{k} {''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(4))}", k


def lookup_rows(families: tuple[str, ...], n: int, seed: int, prefix: str, avoid: set[str]) -> list[dict]:
    """``n`` distinct prompts, families interleaved, none in ``avoid``."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        fam = families[len(rows) % len(families)]
        expr, k = lookup_problem(fam, rng)
        if expr in avoid:
            continue
        avoid.add(expr)
        rows.append(
            {
                "id": f"{prefix}-{len(rows)}",
                "problem": expr,
                "answer": str((k + LOOKUP_FAMILIES[fam][1]) % 10),
                "subject": fam,
            }
        )
    return rows
