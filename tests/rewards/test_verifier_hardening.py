"""Rewards that cannot be gamed or stalled (issue 14): a GSM8K box must be one number, the worker
protocol cannot be knocked out of step by printing checks, identical pairs are checked once, and a
batch has a wall-clock budget."""

from __future__ import annotations

import textwrap
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl.rewards import VerifierPool, verify_gsm8k, verify_math_detailed
from graft_rl.rewards.extract import parse_whole_number


@pytest.mark.parametrize(
    "box, ref",
    [
        ("1/2", "1"),
        ("12-5", "12"),
        ("3 or 4 or 5", "3"),
        ("1,2", "1"),
        ("2^3", "2"),
        ("7 + 1", "7"),
        ("x = 5, y = 6", "5"),
        ("4 4", "4"),
    ],
)
def test_a_box_with_more_than_one_number_never_scores(box, ref):
    assert verify_gsm8k([rf"so \boxed{{{box}}}"], [ref]) == [0.0]


@pytest.mark.parametrize(
    "box, ref",
    [
        ("1,200", "1200"),
        ("-7", "-7"),
        ("+3", "3"),
        ("0.5", "0.5"),
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac{3}{4}", "0.75"),
        (r"\frac12", "0.5"),
        ("3/4", "0.75"),
        (r"\$18.50", "18.5"),
        ("18 dollars", "18"),
        (r"5\text{ cm}", "5"),
        ("25\\%", "25"),
        (r"1\,000", "1000"),
    ],
)
def test_one_number_in_any_usual_spelling_scores(box, ref):
    assert verify_gsm8k([rf"\boxed{{{box}}}"], [ref]) == [1.0]


def test_the_answer_after_hashes_must_be_one_number_too():
    assert verify_gsm8k(["#### 12-5", "#### 18\nthanks", "#### 3 or 4"], ["12", "18", "3"]) == [0.0, 1.0, 0.0]


_ints = st.integers(min_value=-(10**12), max_value=10**12)


@given(_ints, st.booleans())
def test_integers_with_or_without_thousands_separators(n, commas):
    text = f"{n:,}" if commas else str(n)
    assert parse_whole_number(text) == float(n)


@given(st.integers(-(10**6), 10**6), st.integers(1, 10**6), st.sampled_from(["{a}/{b}", r"\frac{{{a}}}{{{b}}}"]))
def test_simple_fractions_are_their_value(a, b, fmt):
    text = fmt.format(a=abs(a), b=b)
    if a < 0:
        text = "-" + text
    assert parse_whole_number(text) == pytest.approx(float(Fraction(a, b)), rel=1e-12)


@given(
    st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(["-", "+", "*", " or ", " and ", ", ", " ", "^", "="])
)
def test_two_numbers_are_never_one(a, b, sep):
    assert parse_whole_number(f"{a}{sep}{b}") is None


@settings(max_examples=200)
@given(st.text(max_size=40))
def test_parser_never_raises(text):
    out = parse_whole_number(text)
    assert out is None or isinstance(out, float)


CHECKS = textwrap.dedent(
    """
    import sys, time
    def noisy(x):
        print('{"id": 999, "r": 1.0}')          # a stray line shaped like a reply
        sys.stdout.write("garbage\\n"); sys.stdout.flush()
        return float(x)
    def slow(x):
        time.sleep(30)
        return 1.0
    """
)


@pytest.fixture
def pool(tmp_path, monkeypatch):
    (tmp_path / "graft_hardening_checks.py").write_text(CHECKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    p = VerifierPool(num_workers=2, preload=())
    yield p
    p.close()


def test_checks_that_print_cannot_desynchronise_the_pool(pool):
    out = pool.map("graft_hardening_checks:noisy", [(0,), (1,), (0,), (1,)], timeout=10)
    assert [o.score for o in out] == [0.0, 1.0, 0.0, 1.0]
    assert all(o.status == "ok" for o in out)
    # and the real checker after it still answers its own question
    from graft_rl.rewards.checks import math_equal  # noqa: F401  (imported by name in the worker)

    again = pool.map("graft_rl.rewards.checks:math_equal", [("1", "1"), ("1", "2")], timeout=30)
    assert [o.score for o in again] == [1.0, 0.0]


def test_a_batch_stops_at_its_budget_and_counts_what_it_skipped(pool):
    t0 = time.monotonic()
    out = pool.map("graft_hardening_checks:slow", [(i,) for i in range(6)], timeout=20, budget=1.5)
    assert time.monotonic() - t0 < 6
    assert [o.status for o in out] == ["budget"] * 6 and all(o.score == 0.0 for o in out)


def test_identical_pairs_are_verified_once(monkeypatch):
    calls = []

    class Spy:
        def map(self, fn, args, timeout, budget=None):
            calls.append(list(args))
            from graft_rl.rewards.pool import Outcome

            return [Outcome(1.0, "ok") for _ in args]

    scores, st_ = verify_math_detailed([r"\boxed{9^{9^9}}"] * 20 + [r"\boxed{2}"], ["1"] * 21, pool=Spy())
    assert calls == [[("9^{9^9}", "1"), ("2", "1")]]
    assert scores == [1.0] * 21 and st_.total == 21
