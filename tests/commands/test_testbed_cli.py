"""The CPU testbed, validation with best-checkpoint selection, pass@k, and the `graft train` command."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from testbed_build import ensure_testbed  # noqa: E402  (the build code is a script: scripts/testbed_build.py)

from graft_rl.commands.cli import main
from graft_rl.data import load_jsonl
from graft_rl.engine.config import load_config
from graft_rl.engine.evaluation import pass_at_k
from graft_rl.engine.trainer import Trainer
from graft_rl.rewards import verify_gsm8k
from graft_rl.testbed import TASKS, TRANSFER_KINDS, make_problem, make_split, shipped_root
from graft_rl.testbed import Testbed as _Pair  # (not "Test...": pytest would collect it)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A pair built here by scripts/testbed_build.py (a few seconds of warm-up): the build's own tests."""
    return ensure_testbed(
        tmp_path_factory.mktemp("testbed"), warmup_steps=(20, 20), pool=120, heldout=24, progress=False
    )


def test_problems_are_verifiable_and_solutions_correct():
    rng = random.Random(0)
    for kind in TASKS + TRANSFER_KINDS:
        for _ in range(50):
            expr, sol, ans = make_problem(kind, rng)
            assert verify_gsm8k([sol], [ans]) == [1.0]
            assert eval(expr.removesuffix("=?")) == int(ans)


def test_a_split_larger_than_its_task_space_is_an_error():
    with pytest.raises(ValueError, match="task space"):
        make_split(200, 0, {"mul_lo": 1.0})  # 14 x 4 distinct products


@pytest.fixture(scope="module")
def testbed():
    """The shipped natural pair, by paths (as a user's own build is named): the runs' tests."""
    return _Pair(shipped_root("natural"))


@pytest.mark.slow
def test_splits_are_reproducible_and_disjoint(built):
    testbed = built
    assert make_split(50, 3) == make_split(50, 3)
    train = {p.problem for p in load_jsonl(testbed.train_file)}
    held = {p.problem for p in load_jsonl(testbed.eval_file)}
    assert len(train) == 120 and not train & held


@pytest.mark.slow
def test_pair_differs_in_architecture_tokenizer(built):
    testbed = built
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(testbed.model_a).model_type == "llama"
    assert AutoConfig.from_pretrained(testbed.model_b).model_type == "gpt2"
    ta, tb = AutoTokenizer.from_pretrained(testbed.model_a), AutoTokenizer.from_pretrained(testbed.model_b)
    text = "12*7=84. \\boxed{84}"
    assert len(ta(text).input_ids) > len(tb(text).input_ids)


@pytest.mark.slow
def test_testbed_build_is_cached(built):
    testbed = built
    stamp = (testbed.root / "testbed.json").stat().st_mtime
    again = ensure_testbed(testbed.root, warmup_steps=(20, 20), pool=120, heldout=24, progress=False)
    assert (again.root / "testbed.json").stat().st_mtime == stamp


@pytest.mark.slow
def test_testbed_cache_from_other_settings_is_rebuilt(built, tmp_path):
    testbed = built
    import shutil

    root = tmp_path / "old"
    shutil.copytree(testbed.root, root)
    meta = json.loads((root / "testbed.json").read_text())
    meta["build"]["warmup_steps"] = [5, 5]  # as if made by an older/other procedure
    (root / "testbed.json").write_text(json.dumps(meta))
    again = ensure_testbed(root, warmup_steps=(20, 20), pool=120, heldout=24, progress=False)
    assert json.loads((again.root / "testbed.json").read_text())["build"]["warmup_steps"] == [20, 20]


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - (6 * 5 * 4 * 3) / (8 * 7 * 6 * 5))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def _small(testbed, tmp_path, **kw):
    data = testbed.train_config(run_dir=str(tmp_path / "run"))
    data.update(steps=3, prompt_batch=8, minibatch=4, n=2, max_new_tokens=16, checkpoint_every=2)
    data["validation"].update(every=2, samples=2, limit=8, max_new_tokens=16)
    data.update(kw)
    return data


def test_validation_and_best_checkpoint(testbed, tmp_path):
    tr = Trainer(load_config(_small(testbed, tmp_path)), show_progress=False)
    tr.run()
    val = [json.loads(x) for x in (tr.run_dir / "validation.jsonl").read_text().splitlines()]
    assert [(v["step"], v["policy"]) for v in val] == [(0, "A"), (0, "B"), (2, "A"), (2, "B"), (3, "A"), (3, "B")]
    best = json.loads((tr.run_dir / "best" / "best.json").read_text())
    for name in ("A", "B"):
        # step 0 (the initial weights) is validated but not a candidate (validation.select_initial)
        scores = [v["val/score"] for v in val if v["policy"] == name and v["step"] > 0]
        steps = [v["step"] for v in val if v["policy"] == name and v["step"] > 0]
        assert best[name]["score"] == max(scores)
        assert best[name]["step"] == steps[scores.index(max(scores))]  # first step reaching the best score
        assert (tr.run_dir / "best" / name / "config.json").is_file()
    # every validation line carries the selection score's standard error
    assert all(v["val/score_se"] > 0 or v["val/score"] in (0.0, 1.0) for v in val)


def test_cli_train_config_file_and_summary(testbed, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_small(testbed, tmp_path)))
    assert main(["train", str(cfg), "steps=2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "held-out %" in out and "grafted" in out
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()
    # resume a finished run: nothing left to do, still a clean exit
    assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress"]) == 0


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("method: {name: graft, dleta: 0.9}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["graft train: unknown key method.dleta; did you mean 'delta'?"]
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_default_uses_the_shipped_testbed_without_a_cache(tmp_path, monkeypatch, capsys):
    """`graft train` with no config builds nothing: the shipped pair, wherever GRAFT_RL_CACHE points."""
    monkeypatch.setenv("GRAFT_RL_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.chdir(tmp_path)
    args = [
        "steps=1",
        "prompt_batch=8",
        "n=2",
        "max_new_tokens=8",
        "validation.limit=4",
        "validation.samples=1",
        "--no-progress",
    ]
    assert main(["train", *args]) == 0
    assert (tmp_path / "runs" / "demo" / "metrics.jsonl").is_file()
    assert not (tmp_path / "empty_cache").exists()


def test_a_typo_is_caught_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "stpes=5"]) == 2
    assert capsys.readouterr().err.strip() == "graft train: unknown key stpes; did you mean 'steps'?"
    assert not (tmp_path / "runs").exists()


def test_testbed_presets_run_from_any_directory(tmp_path, monkeypatch):
    """configs/testbed name the shipped pair, not a cache path (README: `graft train configs/testbed/... n=16`)."""
    from graft_rl.engine.config import load_config

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAFT_RL_CACHE", str(tmp_path / "nowhere"))
    cfg = load_config(
        root / "configs" / "testbed" / "graft_no_gate.yaml",
        [f"run_dir={tmp_path / 'r'}", "steps=1", "prompt_batch=8", "n=2", "max_new_tokens=4"],
    )
    tr = Trainer(cfg, show_progress=False)
    assert tr.cfg.policies[0].model == "zoo:testbed-a" and len(tr.data) == 1000
    tr.close()


def test_run_summary_fits_an_80_column_terminal(testbed, tmp_path, capsys):
    """Issue 15: the end-of-run table neither wraps nor truncates at 80 columns."""
    from graft_rl.commands.report import print_run_summary

    tr = Trainer(load_config(_small(testbed, tmp_path, steps=2)), show_progress=False)
    tr.run()
    print_run_summary(tr.run_dir, width=80)
    lines = capsys.readouterr().out.splitlines()
    assert all(len(ln) <= 80 for ln in lines) and not any("…" in ln for ln in lines)
    main_table = lines[: next(i for i, ln in enumerate(lines) if "per prompt family" in ln)]
    rows = [ln for ln in main_table if ln.strip().startswith(("A ", "B "))]
    assert len(rows) == 2 and all("→" in r for r in rows)


def test_per_family_counts_and_validation_add_up(testbed, tmp_path, capsys):
    """Issue 13: per prompt family (the problems' ``subject``), the metrics count own groups, all-fail
    groups, grafted groups and admitted peer responses, and validation scores each family; they add
    up to the run-level numbers, and the summary prints one row per policy and family in 80 columns."""
    from graft_rl.commands.report import family_summary, print_run_summary

    tr = Trainer(load_config(_small(testbed, tmp_path, steps=2, n=4)), show_progress=False)
    tr.run()
    metrics = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = {p.subject for p in tr.data}
    for m in metrics:
        fam = {k.split("/", 1)[1] for k in m if k.startswith("groups/")}
        assert fam <= kinds and sum(m[f"groups/{f}"] for f in fam) == 8
        assert sum(m[f"all_fail/{f}"] for f in fam) == round(m["all_fail_frac"] * 8)
        assert sum(m.get(f"grafted/{f}", 0) for f in fam) == m["exchanged_in"]
        for f in fam:
            assert m.get(f"admitted_rows/{f}", 0) <= m.get(f"grafted_rows/{f}", 0) == 4 * m.get(f"grafted/{f}", 0)
    held = load_jsonl(testbed.eval_file)[:8]
    for v in [json.loads(x) for x in (tr.run_dir / "validation.jsonl").read_text().splitlines()]:
        per = {k.rsplit("/", 1)[1]: x for k, x in v.items() if k.startswith("val/heldout/")}
        assert set(per) == {p.subject for p in held}
        weighted = sum(per[p.subject] for p in held) / len(held)  # problem-weighted mean of the families
        assert weighted == pytest.approx(v["val/heldout"])
    rows = family_summary(tr.run_dir)
    assert {(r["policy"], r["family"]) for r in rows} == {(n, f) for n in ("A", "B") for f in kinds}
    print_run_summary(tr.run_dir, width=80)
    out = capsys.readouterr().out.splitlines()
    assert "per prompt family" in "\n".join(out) and all(len(ln) <= 80 for ln in out)


def test_families_are_reported_only_for_a_few_named_ones():
    from graft_rl.data import Problem
    from graft_rl.engine.evaluation import families

    two = [Problem(f"p{i}", "1+1=?", "2", subject=("x" if i % 2 else "y")) for i in range(6)]
    assert families(two) == {f"p{i}": ("x" if i % 2 else "y") for i in range(6)}
    assert families([Problem("a", "q", "1", subject="x"), Problem("b", "q", "1")]) == {}  # one unnamed: none
    assert families([Problem(f"p{i}", "q", "1", subject="x") for i in range(3)]) == {}  # a single family
    assert families([Problem(f"p{i}", "q", "1", subject=str(i)) for i in range(20)]) == {}  # too many to tabulate


def test_eval_of_a_default_run_uses_the_shipped_heldout_set(tmp_path, monkeypatch, capsys):
    """The README's `graft eval runs/demo --limit 50` on a default (testbed) run."""
    monkeypatch.chdir(tmp_path)
    args = [
        "steps=1",
        "prompt_batch=8",
        "n=2",
        "max_new_tokens=8",
        "validation.limit=4",
        "validation.samples=1",
        "--no-progress",
    ]
    assert main(["train", *args]) == 0
    assert main(["eval", "runs/demo", "--limit", "3", "--samples", "2", "--runs", "2"]) == 0
    res = json.loads((tmp_path / "runs" / "demo" / "eval" / "eval.json").read_text())
    assert list(res["policies"]["A"]["benchmarks"]) == ["transfer_heldout"] and res["max_new_tokens"] == 40
