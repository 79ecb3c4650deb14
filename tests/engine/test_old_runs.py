"""A run directory recorded by an earlier version is still read and resumed.

``tests/fixtures/run_0_8`` is two steps of ``configs/lookup/graft.yaml`` (8 prompts, a checkpoint at
step 2) written by graft-rl at commit 1217b3a, before the metric ``time_score`` became
``time_logprobs`` (issue 49). Its checkpoint holds the tiny lookup models' weights and optimizer state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from metric_docs import undocumented

from graft_rl.commands.analyze import analyze
from graft_rl.commands.report import read_metrics, run_summary
from graft_rl.engine.config import load_config
from graft_rl.engine.rundir import RENAMED_KEYS, read_log
from graft_rl.engine.trainer import Trainer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_0_8"


@pytest.fixture
def old_run(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run


PHASES_BEFORE = ("time_generate", "time_reward", "time_score", "time_update")


def _raw() -> list[dict]:
    return [json.loads(x) for x in (FIXTURE / "metrics.jsonl").read_text().splitlines()]


def _seconds_before(policy: str) -> float:
    """A policy's training seconds as the code that wrote the fixture summed them."""
    return sum(r[k] for r in _raw() if r["policy"] == policy for k in PHASES_BEFORE)


def test_the_fixture_holds_the_old_keys():
    assert all("time_score" in r and "time_logprobs" not in r for r in _raw())


def test_old_metric_keys_are_read_under_their_new_names(old_run):
    lines = read_metrics(old_run)
    assert lines and all("time_logprobs" in ln for ln in lines)
    assert not any(old in ln for ln in lines for old in RENAMED_KEYS)
    assert [ln["time_logprobs"] for ln in lines] == [r["time_score"] for r in _raw()]
    assert not undocumented(lines) and not undocumented(read_log(old_run / "validation.jsonl")[0], "validation.jsonl")
    for s in run_summary(old_run):
        assert s["seconds"] == pytest.approx(_seconds_before(s["policy"]))


def test_graft_analyze_reads_an_old_run(old_run):
    summary = analyze(old_run, cases=1)
    for p in "AB":
        assert summary["policies"][p]["seconds"] == pytest.approx(_seconds_before(p))
    report = (Path(summary["out"]) / "report.md").read_text()
    assert "| A |" in report and "log-probs s" in report


@pytest.mark.slow
def test_an_old_run_resumes_and_reads_as_one_run(old_run):
    cfg = load_config(old_run / "config.yaml", [f"run_dir={old_run}", "steps=3"])
    tr = Trainer(cfg, resume=True, show_progress=False)
    try:
        new = tr.run()
    finally:
        tr.close()
    assert [ln["step"] for ln in new] == [3, 3]
    lines, _ = read_log(old_run / "metrics.jsonl")
    assert [ln["step"] for ln in lines] == [1, 1, 2, 2, 3, 3]
    assert all("time_logprobs" in ln and "time_score" not in ln for ln in lines)
    assert set(analyze(old_run, cases=1)["policies"]) == {"A", "B"}
