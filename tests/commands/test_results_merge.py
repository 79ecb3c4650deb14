"""Issue 33: results files merge instead of overwrite (``graft eval`` of one policy, then another; two
at once), and tables over runs refuse runs that are not comparable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import graft_rl.commands.evaluate_cli as ev
import graft_rl.engine.evaluators as evaluators
from graft_rl.commands.results import check_comparable, merge_eval
from graft_rl.engine.config import to_dict

from .test_eval_analyze import FakePolicy


@pytest.fixture
def bench(tmp_path):
    def make(name, n=5):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"id": f"t-{i}", "problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(n))
        )
        return str(path)

    return make


def _eval(tmp_path, model, benchmarks, **kw):
    return ev.run_eval(
        str(tmp_path / model), benchmarks, out_dir=str(tmp_path / "out"), **{"samples": 2, "runs": 2, **kw}
    )


def test_eval_of_one_policy_then_another_keeps_both(tmp_path, bench, monkeypatch, capsys):
    monkeypatch.setattr(evaluators, "Policy", FakePolicy)  # where the in-process evaluator builds it
    toy, other = bench("toy"), bench("other")
    _eval(tmp_path, "A", [toy], show=False)
    _eval(tmp_path, "B", [toy], show=False)
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert list(saved["policies"]) == ["A", "B"]  # B's evaluation left A's results in place
    # A on another benchmark, same settings: both benchmarks kept, the average over both
    _eval(tmp_path, "A", [other])
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    a = saved["policies"]["A"]
    assert list(a["benchmarks"]) == ["toy", "other"]
    assert a["average"] == pytest.approx(
        (a["benchmarks"]["toy"]["pass@1_mean"] + a["benchmarks"]["other"]["pass@1_mean"]) / 2
    )
    # A again on toy with other settings: its earlier results are replaced whole, and that is said
    _eval(tmp_path, "A", [toy], samples=4)
    out = capsys.readouterr().out
    assert "replaced A's earlier results (other settings: samples 2 -> 4)" in out
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert list(saved["policies"]["A"]["benchmarks"]) == ["toy"] and saved["policies"]["A"]["settings"]["samples"] == 4
    assert saved["policies"]["B"]["settings"]["samples"] == 2  # B kept, with its own settings
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "B was evaluated with other settings: samples 2" in md


def test_merge_replaces_only_what_was_evaluated_again():
    runs = {"pass@1_mean": 0.5, "pass@1_std": 0.0, "pass@1_runs": [0.5], "pass@k": {}, "problems": 1}
    old = {"samples": 2, "runs": 1, "policies": {"A": {"benchmarks": {"x": runs, "y": runs}, "average": 0.5}}}
    new = {
        "samples": 2,
        "runs": 1,
        "policies": {"A": {"benchmarks": {"y": {**runs, "pass@1_mean": 1.0, "pass@1_runs": [1.0]}}}},
    }
    merged, notes = merge_eval(old, new)
    assert notes == ["replaced A's earlier y"]
    assert merged["policies"]["A"]["benchmarks"]["x"]["pass@1_mean"] == 0.5
    assert merged["policies"]["A"]["average"] == 0.75


WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, {src!r})
import time
import graft_rl.commands.evaluate_cli as ev
import graft_rl.commands.results as results
real = results.merge_eval
results.merge_eval = lambda old, new, written=(): (time.sleep(0.01), real(old, new, written))[1]  # widen the read-write window
name = sys.argv[1]
bench = {{"pass@1_mean": 0.5, "pass@1_std": 0.0, "pass@1_runs": [0.5], "pass@k": {{}}, "problems": 1}}
for i in range(40):
    res = {{"samples": 1, "runs": 1, "temperature": 0.6, "top_p": 0.95, "limit": None, "max_new_tokens": 8, "complete": True,
            "policies": {{name: {{"benchmarks": {{f"b{{i}}": bench}}, "average": 0.5, "average_std": 0.0}}}}}}
    ev._write_results(Path(sys.argv[2]), res, [f"b{{i}}"], show=False)
"""


@pytest.mark.slow  # two processes at once: seconds
def test_two_evals_writing_at_once_lose_nothing(tmp_path):
    """Two `graft eval` processes writing into one eval.json at once: every policy's every benchmark
    survives (read-modify-write under a lock; each process's own earlier writes are merged too)."""
    src = str(ev.__file__).rsplit("/graft_rl/", 1)[0]
    code = WRITER.format(src=src)
    procs = [subprocess.Popen([sys.executable, "-c", code, name, str(tmp_path)]) for name in ("A", "B")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert {n: len(p["benchmarks"]) for n, p in saved["policies"].items()} == {"A": 40, "B": 40}


def test_an_unreadable_eval_json_is_moved_aside_not_overwritten(tmp_path, bench, monkeypatch, capsys):
    monkeypatch.setattr(evaluators, "Policy", FakePolicy)  # where the in-process evaluator builds it
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "eval.json").write_text("{not json")
    _eval(tmp_path, "A", [bench("toy")])
    assert "eval.json could not be read; moved to eval.json.unreadable" in capsys.readouterr().out
    assert (tmp_path / "out" / "eval.json.unreadable").read_text() == "{not json"


# ---------------------------------------------------------------- tables over runs
def _run(tmp_path, make_cfg, name, method="graft", limit=None, model_b=None, data=None):
    cfg = to_dict(make_cfg({"name": method}, run=name))
    if model_b:
        cfg["policies"][1]["model"] = model_b
    if data:
        cfg["data"]["train"] = data
    d = tmp_path / name
    (d / "eval").mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    b = {"pass@1_mean": 0.5, "pass@1_std": 0.0, "pass@1_runs": [0.5], "pass@k": {}, "problems": 1}
    res = {
        "samples": 8,
        "runs": 5,
        "temperature": 0.6,
        "top_p": 0.95,
        "limit": limit,
        "max_new_tokens": 64,
        "complete": True,
        "policies": {n: {"benchmarks": {"math500": b}, "average": 0.5, "average_std": 0.0} for n in ("A", "B")},
    }
    (d / "eval" / "eval.json").write_text(json.dumps(res))
    return str(d)


def test_graft_seeds_refuses_runs_that_do_not_belong_in_one_table(tmp_path, make_cfg, tiny_data):
    g1, g2 = _run(tmp_path, make_cfg, "g1"), _run(tmp_path, make_cfg, "g2")
    grpo = _run(tmp_path, make_cfg, "grpo1", method="grpo")
    assert ev.across_runs([g1, g2], [grpo])["policies"]["A"]["average"]["runs"] == 2  # a baseline of another method
    with pytest.raises(ValueError, match=r"g1 is given twice"):
        ev.across_runs([g1, g1])
    with pytest.raises(ValueError, match=r"the runs differ in method: .*g1 has 'graft', .*grpo1 has 'grpo'"):
        ev.across_runs([g1, grpo])
    limited = _run(tmp_path, make_cfg, "g3", limit=10)
    with pytest.raises(
        ValueError, match=r"g3 evaluated A with samples 8, runs 5, temperature 0.6, top_p 0.95, limit 10"
    ):
        ev.across_runs([g1, limited])
    other_model = _run(tmp_path, make_cfg, "g4", model_b="/elsewhere/model")
    with pytest.raises(ValueError, match=r"differ in model of B"):
        ev.across_runs([g1, other_model])
    other_data = _run(tmp_path, make_cfg, "g5", data="math500")
    with pytest.raises(ValueError, match=r"the runs and the baseline runs differ in data.train"):
        ev.across_runs([g1], [_run(tmp_path, make_cfg, "grpo2", method="grpo", data="math500")])
    check_comparable([other_data], "one run")  # alone, nothing to compare


def test_results_of_other_weights_are_not_mixed_and_order_is_kept():
    """Review: a resumed run's best/ moved to another step; evaluating one benchmark again must not
    average it with the other weights' numbers. Re-evaluating a benchmark keeps its place."""
    b = {"pass@1_mean": 0.5, "pass@1_std": 0.0, "pass@1_runs": [0.5], "pass@k": {}, "problems": 1}
    old = {
        "samples": 2,
        "runs": 1,
        "policies": {"A": {"model": "run/best/A", "step": 4, "benchmarks": {"x": b, "y": b}}},
    }
    same = {"samples": 2, "runs": 1, "policies": {"A": {"model": "run/best/A", "step": 4, "benchmarks": {"x": b}}}}
    merged, _ = merge_eval(old, same)
    assert list(merged["policies"]["A"]["benchmarks"]) == ["x", "y"]
    moved = {"samples": 2, "runs": 1, "policies": {"A": {"model": "run/best/A", "step": 8, "benchmarks": {"y": b}}}}
    merged, notes = merge_eval(old, moved)
    assert list(merged["policies"]["A"]["benchmarks"]) == ["y"]
    assert "weights run/best/A (step 4) -> run/best/A (step 8)" in notes[0]


def test_a_baseline_of_fewer_policies_is_comparable(tmp_path, make_cfg):
    g = _run(tmp_path, make_cfg, "g_full")
    base = tmp_path / "b_one"
    cfg = to_dict(make_cfg({"name": "grpo"}, run="b_one"))
    cfg["policies"] = cfg["policies"][:1]
    (base / "eval").mkdir(parents=True)
    (base / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = json.loads((Path(g) / "eval" / "eval.json").read_text())
    res["policies"] = {"A": res["policies"]["A"]}
    (base / "eval" / "eval.json").write_text(json.dumps(res))
    out = ev.across_runs([g], [str(base)])
    assert set(out["delta"]) == {"A"}


def test_a_first_eval_says_nothing_was_replaced_and_its_bar_follows_the_work(tmp_path, bench, monkeypatch, capsys):
    """Issue 63: a command's own write after each policy is not an "earlier" result (a first eval into a
    fresh --out said "replaced A's earlier toy" about itself); in-process chunks run as the bar advances
    (it jumped to the end at 10^5 chunk/s after all the work was done)."""
    import functools

    import tqdm.auto

    monkeypatch.setattr(evaluators, "Policy", FakePolicy)
    done, seen = [], []
    real = evaluators.LocalEvaluator.evaluate

    @functools.wraps(real)
    def counted(self, *a, **k):
        done.append(1)
        return real(self, *a, **k)

    class Bar:
        def __init__(self, *a, total=0, **k):
            self.total = total

        def update(self, n):
            seen.append(len(done))

        def close(self):
            pass

    monkeypatch.setattr(evaluators.LocalEvaluator, "evaluate", counted)
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    toy = bench("toy", n=5)
    _eval(tmp_path, "A", [toy], show=True)
    assert "replaced" not in capsys.readouterr().out
    assert seen == list(range(1, len(seen) + 1)) and len(seen) == 2  # one chunk per run, each run before its tick
    _eval(tmp_path, "A", [toy], show=True)  # a second command: now it is a replacement, said once
    assert capsys.readouterr().out.count("replaced A's earlier toy") == 1
