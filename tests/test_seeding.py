"""Every random draw of a run comes from ``derive_seed(run seed, Purpose, ...)`` (graft_rl.seeding):
named purposes whose values never change, and no bare integer purpose in the code."""

from __future__ import annotations

import re
from pathlib import Path

from graft_rl.seeding import Purpose, derive_seed, rank_seed

SRC = Path(__file__).resolve().parents[1] / "src" / "graft_rl"


def test_the_purposes_keep_the_values_runs_were_made_with():
    assert {p.name: int(p) for p in Purpose} == {
        "EPOCH_ORDER": 1,
        "GENERATE": 2,
        "REFILL_ORDER": 3,
        "REFILL_GENERATE": 4,
        "UPDATE": 5,
        "EXCHANGE": 6,
        "VALIDATION": 7,
        "PROMPT_STREAM": 8,
        "SWARM": 9,
    }
    assert derive_seed(0, Purpose.UPDATE, 3, 1) == derive_seed(0, 5, 3, 1)  # the same seeds as before the names


def test_seeds_are_stable_and_distinct():
    assert derive_seed(0, 1, 2) == 8250771747500411118  # stable across runs and platforms
    seeds = {derive_seed(s, p, step) for s in range(3) for p in Purpose for step in range(5)}
    assert len(seeds) == 3 * len(Purpose) * 5
    assert rank_seed(11, 0, 1) == 11 and rank_seed(11, 0, 2) != rank_seed(11, 1, 2)


def test_no_run_seed_is_derived_with_a_bare_integer_purpose():
    bare = re.compile(r"derive_seed\([\w.]*seed, \d")
    hits = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py") if bare.search(p.read_text())]
    assert not hits, hits
