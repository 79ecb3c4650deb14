"""`graft eval` arithmetic and `graft analyze` from records alone."""

from __future__ import annotations

import json
import statistics

import pytest
from runs import quick_eval_args

import graft_rl.commands.evaluate_cli as ev
import graft_rl.engine.evaluators as evaluators
from graft_rl.commands.analyze import AnalysisError, analyze
from graft_rl.commands.cli import main
from graft_rl.engine.trainer import Trainer
from graft_rl.engine.validation import best_from_log
from graft_rl.policy import RolloutGroup


class FakePolicy:
    """Answers problem i correctly in the first c_i of its samples; c_i depends on the seed (run)."""

    def __init__(self, pc):
        self.name = pc.name

    def context_length(self):
        return None

    def generate(self, prompts, sp, seed=0):
        out = []
        for pid, _ in prompts:
            i = int(pid.split("-")[1])
            run = seed // 1000
            c = (i + run) % (sp.n + 1)
            texts = [f"\\boxed{{{i if j < c else -1}}}" for j in range(sp.n)]
            out.append(RolloutGroup(pid, "", self.name, texts, [[0]] * sp.n, [[0.0]] * sp.n, ["stop"] * sp.n))
        return out


def test_eval_pass1_averages_samples_then_problems_and_std_over_runs(tmp_path, monkeypatch):
    bench = tmp_path / "toy.jsonl"
    bench.write_text(
        "".join(json.dumps({"id": f"t-{i}", "problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(5))
    )
    monkeypatch.setattr(evaluators, "Policy", FakePolicy)  # where the in-process evaluator builds it
    res = ev.run_eval(
        str(tmp_path / "modelX"), [str(bench)], samples=4, runs=3, out_dir=str(tmp_path / "out"), show=False
    )
    per = res["policies"]["modelX"]["benchmarks"]["toy"]
    expected_runs = [statistics.fmean(((i + r) % 5) / 4 for i in range(5)) for r in range(3)]
    assert per["pass@1_runs"] == pytest.approx(expected_runs)
    assert per["pass@1_mean"] == pytest.approx(statistics.fmean(expected_runs))
    assert per["pass@1_std"] == pytest.approx(statistics.stdev(expected_runs))
    assert per["pass@k"][12] <= 1.0 and per["pass@k"][1] == pytest.approx(per["pass@1_mean"])
    assert res["policies"]["modelX"]["average"] == pytest.approx(per["pass@1_mean"])
    assert (tmp_path / "out" / "eval.md").read_text().startswith("pass@1 (%)")


def test_eval_unknown_benchmark_lists_available(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--benchmarks", "math5000"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("graft eval: unknown benchmark 'math5000'; available: math_train, math500") and "\n" not in err
    )


def _run(make_cfg, method, run):
    tr = Trainer(make_cfg(method, steps=2, run=run), show_progress=False)
    tr.run()
    return tr.run_dir


@pytest.mark.slow
def test_analyze_from_records_alone(make_cfg, fake_rewards, monkeypatch, tmp_path):
    graft = _run(make_cfg, {"name": "graft", "gate": False}, "g")
    grpo = _run(make_cfg, {"name": "grpo"}, "r")

    def no_models(*a, **k):
        raise AssertionError("analyze must not load a model")

    monkeypatch.setattr("graft_rl.policy.Policy.__init__", no_models)
    s = analyze(graft, compare=[str(grpo)])
    out = graft / "analysis"
    for png in ("complementarity.png", "exchange_volume.png", "compatibility.png", "clipping.png", "curves.png"):
        assert (out / png).stat().st_size > 1000
    report = (out / "report.md").read_text()
    for section in (
        "Complementarity",
        "Exchange volume",
        "Compatibility and admission",
        "Clipped-token",
        "Case studies",
        "Compute",
    ):
        assert section in report
    # conftest K: A's all-fail prompts {q1, q3, q6, q7}; B solves q1, q6, q7 -> 3/4
    assert s["policies"]["A"]["complementarity_mean"] == pytest.approx(0.75)
    assert s["policies"]["A"]["grafted"] == 4 and s["policies"]["B"]["grafted"] == 4
    assert "failed response" in report  # a case study with the receiver's failure beside the peer's success


def test_analyze_run_with_zero_exchanges(make_cfg, fake_rewards):
    grpo = _run(make_cfg, {"name": "grpo"}, "r0")
    s = analyze(grpo)
    assert "zero exchanges" in (grpo / "analysis" / "report.md").read_text()
    assert s["policies"]["A"]["grafted"] == 0


def test_analyze_bad_input_is_one_line(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graft analyze:") and "no trajectory records" in err and "\n" not in err
    with pytest.raises(AnalysisError, match="not a directory"):
        analyze(tmp_path / "nope")


def test_compatibility_stats_compare_both_normalisations():
    from graft_rl.commands.analyze import compatibility_stats

    rows = [
        {"compat_token": 0.9, "compat_char": 0.7, "weight": 0.9, "reward": 1.0},
        {"compat_token": 0.5, "compat_char": 0.85, "weight": 0.0, "reward": 1.0},
        {"compat_token": 0.85, "compat_char": 0.95, "weight": 0.85, "reward": 0.0},
        {"compat_token": 0.2, "compat_char": 0.3, "weight": 0.0, "reward": 0.0},
        {"compat_token": None, "compat_char": None, "weight": 1.0, "reward": 1.0},  # not scored: left out
    ]
    st = compatibility_stats(rows, delta=0.8)
    assert st["n"] == 4 and st["admitted"] == 0.5
    assert st["pass_token"] == 0.5 and st["pass_char"] == 0.5
    assert st["median_token"] == (0.5 + 0.85) / 2 and st["median_char"] == (0.7 + 0.85) / 2
    assert st["admitted_correct"] == 0.5 and st["admitted_wrong"] == 0.5
    assert compatibility_stats([], 0.8) == {"n": 0}


def test_eval_of_a_run_defaults_to_its_own_task_and_lengths(make_cfg, fake_rewards, tiny_data, tmp_path, capsys):
    """Issue 15: `graft eval RUN_DIR` uses the run's validation set, sampling and max_new_tokens (a
    testbed run: its held-out set and 40 tokens), not the paper's math benchmarks and 4,096 tokens."""
    tr = Trainer(
        make_cfg(
            {"name": "graft"},
            steps=1,
            run="evrun",
            validation={
                "data": [str(tiny_data)],
                "every": 1,
                "samples": 1,
                "max_new_tokens": 6,
                "temperature": 1.0,
                "top_p": 1.0,
            },
        ),
        show_progress=False,
    )
    tr.run()
    defaults, source = ev.eval_defaults(str(tr.run_dir))
    assert defaults["benchmarks"] == [str(tiny_data)] and defaults["max_new_tokens"] == 6 and "validation" in source
    assert main(["eval", str(tr.run_dir), "--limit", "2", "--samples", "1", "--runs", "1"]) == 0
    res = json.loads((tr.run_dir / "eval" / "eval.json").read_text())
    assert res["max_new_tokens"] == 6 and list(res["policies"]["A"]["benchmarks"]) == [tiny_data.stem]


def test_eval_clamps_max_new_tokens_to_the_models_context(tmp_path, tiny_data, capsys):
    """A 512-position GPT-2 asked for 4,096 new tokens: clamped with one line, not an IndexError."""
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model

    model = build_tiny_model(tmp_path / "short", "gpt2", bpe_tokenizer(), max_positions=64, seed=3)
    res = ev.run_eval(
        str(model), [str(tiny_data)], samples=1, runs=1, limit=1, max_new_tokens=4096, out_dir=str(tmp_path / "out")
    )
    out = capsys.readouterr()
    assert "64-token context: max_new_tokens 4096 ->" in out.out + out.err
    assert res["max_new_tokens"] == 4096 and res["policies"]["short"]["benchmarks"][tiny_data.stem]["problems"] == 1


@pytest.mark.slow
def test_analyze_best_step_is_the_trainers(make_cfg, fake_rewards, tiny_data):
    """Issue 21: step 0 scored highest but `validation.select_initial` is off: analyze's best step (and
    so its seconds-to-best) is the trainer's selected checkpoint, not 0."""
    from graft_rl.engine.rundir import read_log, rewrite_log

    tr = Trainer(
        make_cfg(
            {"name": "graft"},
            steps=2,
            run="best",
            validation={"data": [str(tiny_data)], "every": 1, "samples": 1, "max_new_tokens": 4},
        ),
        show_progress=False,
    )
    tr.run()
    log = tr.run_dir / "validation.jsonl"
    lines = read_log(log)[0]
    for ln in lines:  # step 0 best, then step 2 above step 1
        ln["val/score"] = {0: 0.9, 1: 0.2, 2: 0.5}[ln["step"]]
    rewrite_log(log, lines)
    s = analyze(tr.run_dir)
    assert {p: s["policies"][p]["best_step"] for p in ("A", "B")} == {"A": 2, "B": 2}
    assert best_from_log(tr.run_dir, select_initial=False) == {p: {"step": 2, "score": 0.5} for p in "AB"}


def test_eval_of_a_checkpoint_keeps_its_prompt_format(make_cfg, fake_rewards, tmp_path, tiny_pair):
    """Issue 21: a checkpoint directory is prompted as its run prompted it (testbed: 36 % -> 0 % before),
    from the checkpoint's graft_policy.json or, for older checkpoints, its run's config; `--backend`
    overrides the run's backend instead of failing with a duplicate keyword."""
    template = "Problem: {prompt}\nSolution:"
    pols = [
        {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
        {
            "name": "B",
            "model": str(tiny_pair[1]),
            "lr": 1e-3,
            "prompt_format": "plain",
            "plain_template": template,
            "prompt_suffix": None,
        },
    ]
    tr = Trainer(make_cfg({"name": "graft"}, steps=1, run="fmt", policies=pols), show_progress=False)
    tr.run()
    ckpt = tr.run_dir / "checkpoints" / "step_000001" / "B"
    (a, b) = ev.resolve_targets(str(tr.run_dir), backend="vllm", device="cpu")
    assert (a.backend, b.backend, b.plain_template, b.world_size) == ("vllm", "vllm", template, 1)
    assert ev.default_replicas(str(tr.run_dir), b) == 1
    for _ in range(2):
        (pc,) = ev.resolve_targets(str(ckpt))
        assert (pc.name, pc.prompt_format, pc.plain_template, pc.prompt_suffix, pc.model) == (
            "B",
            "plain",
            template,
            None,
            str(ckpt),
        )
        # second pass: a checkpoint from before graft_policy.json (and the checksum manifest) existed
        (ckpt / "graft_policy.json").unlink(missing_ok=True)
        (ckpt.parent / "manifest.json").unlink(missing_ok=True)
    # the run's own checkpoint without its manifest: damaged (issue 33), not evaluated
    with pytest.raises(ev.DatasetError, match=r"step_000001/A: manifest.json is missing"):
        ev.resolve_targets(str(tr.run_dir))


@pytest.mark.slow
def test_eval_spread_over_replicas_equals_one_process(tmp_path):
    """`graft eval --world-size 2`: two Ray actors, each a whole model, share the chunks; every chunk is
    sampled with the seed one process gives it, so the scores equal the single-process eval."""
    pytest.importorskip("ray")
    import ray

    kw = dict(benchmarks=["testbed_heldout"], samples=2, runs=2, limit=12, max_new_tokens=24, show=False)
    one = ev.run_eval("zoo:testbed-a", out_dir=str(tmp_path / "one"), **kw)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        two = ev.run_eval("zoo:testbed-a", out_dir=str(tmp_path / "two"), replicas=2, **kw)
    finally:
        ray.shutdown()
    a, b = one["policies"]["zoo:testbed-a"], two["policies"]["zoo:testbed-a"]
    assert b["replicas"] == 2 and a["replicas"] == 1
    assert a["benchmarks"]["testbed_heldout"]["pass@1_runs"] == b["benchmarks"]["testbed_heldout"]["pass@1_runs"]
    assert 0 < a["average"] < 1  # the shipped model solves some of them: the comparison is not 0 == 0


def test_eval_keeps_finished_policies_on_ctrl_c_and_checks_its_output_first(
    make_cfg, fake_rewards, tiny_data, tmp_path, monkeypatch, capsys
):
    """Issue 24: each policy's results are written (atomically) as it finishes; Ctrl-C exits 130 in one
    line and keeps them; an unwritable --out fails before any evaluation."""
    from graft_rl.commands.cli import main

    tr = Trainer(make_cfg({"name": "graft"}, steps=1, run="ctrlc"), show_progress=False)
    tr.run()
    args = quick_eval_args(tr.run_dir, tiny_data)
    (tmp_path / "afile").write_text("x")
    assert main([*args, "--out", str(tmp_path / "afile")]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err

    real, calls = ev.evaluate_benchmarks, []

    def second_interrupted(pc, *a):
        calls.append(pc.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(pc, *a)

    monkeypatch.setattr(ev, "evaluate_benchmarks", second_interrupted)
    assert main(args) == 130
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("graft eval:")]  # (bars aside)
    assert len(err) == 1 and "interrupted; finished policies (A) written to" in err[0]
    saved = json.loads((tr.run_dir / "eval" / "eval.json").read_text())
    assert list(saved["policies"]) == ["A"] and saved["complete"] is False
    monkeypatch.setattr(ev, "evaluate_benchmarks", real)
    assert main(args) == 0
    saved = json.loads((tr.run_dir / "eval" / "eval.json").read_text())
    assert list(saved["policies"]) == ["A", "B"] and saved["complete"] is True
