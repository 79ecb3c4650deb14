"""Every command through its real entry point, output printed, on a user's own task built as
docs/tasks.md says (issue 40, item 1): a CSV with its own column names, a ``file.py:function`` reward
with partial credit, validation sets given as mappings. ``graft eval RUN`` on exactly this run was a
``TypeError`` while printing its header: tests that called ``run_eval(..., show=False)`` never printed."""

from __future__ import annotations

import csv
import json
import textwrap

import pytest
import yaml

from graft_rl.commands.cli import main

REWARD = textwrap.dedent(
    """
    def partial(responses, problems):
        # partial credit: 0.5 for a response that contains a digit, 1 for the target itself
        out = []
        for r, p in zip(responses, problems):
            assert "kind" in p and "question" in p  # the file's own columns reach the reward
            out.append(1.0 if r.strip() == str(p["target"]) else 0.5 if any(c.isdigit() for c in r) else 0.0)
        return out
    """
)


@pytest.fixture(scope="module")
def user_task(tmp_path_factory, tiny_pair):
    """The files a user writes (docs/tasks.md), and the config naming them."""
    root = tmp_path_factory.mktemp("user_task_cli")
    for name, n in (("train.csv", 8), ("heldout.csv", 3)):
        with (root / name).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["question", "target", "kind"])
            for i in range(n):
                w.writerow([f"{i}+{i}=?", 2 * i, "even" if i % 2 == 0 else "odd"])
    (root / "my_reward.py").write_text(REWARD)
    columns = {"problem": "question", "answer": "target"}
    cfg = {
        "run_dir": str(root / "run"),
        "steps": 2,
        "prompt_batch": 4,
        "minibatch": 4,
        "n": 2,
        "max_new_tokens": 4,
        "checkpoint_every": 1,
        "data": {
            "train": str(root / "train.csv"),
            "columns": columns,
            "reward": f"{root / 'my_reward.py'}:partial",
            "success_threshold": 0.5,
        },
        "validation": {
            "data": [
                {"data": str(root / "heldout.csv"), "name": "heldout", "columns": columns},
                {"data": str(root / "heldout.csv"), "name": "numbers", "columns": columns, "reward": "gsm8k"},
            ],
            "every": 1,
            "samples": 1,
            "max_new_tokens": 4,
        },
        "method": {"name": "graft"},
        "policies": [
            {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
            {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3},
        ],
    }
    (root / "task.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def trained(user_task):
    """``graft train task.yaml`` as a user runs it."""
    assert main(["train", str(user_task / "task.yaml"), "--no-progress"]) == 0
    return user_task / "run"


def test_train_prints_its_table(user_task, trained, capsys):
    assert main(["train", "--resume", str(trained), "--no-progress", "steps=3"]) == 0
    out = capsys.readouterr().out
    assert f"graft run {trained}" in out and "held-out %" in out


def test_eval_of_a_run_with_mapping_validation_sets_prints_them(trained, capsys):
    assert main(["eval", str(trained), "--samples", "1", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "graft eval: heldout, numbers; 1 samples x 1 runs" in out
    assert f"graft eval: A: {trained / 'best' / 'A'}" in out and "the best validation checkpoint" in out
    assert "| policy | heldout | numbers | average |" in (trained / "eval" / "eval.md").read_text()


def test_eval_of_a_run_without_best_says_which_checkpoint(user_task, tiny_pair, capsys):
    cfg = yaml.safe_load((user_task / "task.yaml").read_text())
    cfg.update(run_dir=str(user_task / "no_val"), steps=1, validation={"data": []})
    (user_task / "no_val.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(user_task / "no_val.yaml"), "--no-progress"]) == 0
    capsys.readouterr()
    heldout = user_task / "heldout.csv"
    rc = main(["eval", str(user_task / "no_val"), "--benchmarks", str(heldout), "--samples", "1", "--runs", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "checkpoints/step_000001/A (step 1), the latest checkpoint: the run has no best/" in out


def test_analyze_prints_its_summary(trained, capsys):
    assert main(["analyze", str(trained)]) == 0
    assert "analysis" in capsys.readouterr().out


def test_probe_prints_its_verdict(user_task, capsys, tmp_path):
    assert main(["probe", str(user_task / "task.yaml"), "--limit", "4", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "written:" in out and (tmp_path / "probe.json").is_file()
    assert json.loads((tmp_path / "probe.json").read_text())["reward"].endswith("my_reward.py:partial")


def test_seeds_over_two_evaluated_runs(user_task, trained, capsys):
    cfg = yaml.safe_load((user_task / "task.yaml").read_text())
    cfg.update(run_dir=str(user_task / "seed1"), seed=1)
    (user_task / "seed1.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(user_task / "seed1.yaml"), "--no-progress"]) == 0
    for run in (trained, user_task / "seed1"):
        assert main(["eval", str(run), "--samples", "1", "--runs", "1"]) == 0
    capsys.readouterr()
    assert main(["seeds", str(trained), str(user_task / "seed1")]) == 0
    out = capsys.readouterr().out
    assert "heldout" in out and "numbers" in out


def test_plan_and_config_show(user_task, capsys):
    assert main(["plan", str(user_task / "task.yaml")]) == 0
    assert "policy" in capsys.readouterr().out
    assert main(["config", "show", "data"]) == 0
    assert "columns" in capsys.readouterr().out


@pytest.mark.slow  # the preflight path is tests/commands/test_preflight.py's; here the user's task through it
def test_preflight_of_the_user_task(user_task, capsys):
    assert main(["preflight", str(user_task / "task.yaml")]) == 0
    assert "resume" in capsys.readouterr().out


@pytest.mark.slow
def test_the_run_summary_counts_reward_calls_that_timed_out(user_task, tmp_path, capsys):
    """Issue 40, item 2: the run's output says how many reward calls timed out (their processes ended)."""
    (tmp_path / "slow_reward.py").write_text(
        "import time\n\n"
        "def slow(responses, problems):\n"
        "    if int(problems[0]['target']) % 4 == 2:  # half the problems: the call hangs\n"
        "        time.sleep(60)\n"
        "    return [0.5]\n"
    )
    cfg = yaml.safe_load((user_task / "task.yaml").read_text())
    cfg["data"].update(reward=f"{tmp_path / 'slow_reward.py'}:slow", verify_timeout=1)
    cfg.update(run_dir=str(tmp_path / "run"), steps=1, validation={"data": []})
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "slow.yaml"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("reward calls scored 0:"))
    assert "timed out (data.verify_timeout; each call's processes were ended)" in line
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert f"{sum(m['verify_timeouts'] for m in metrics)} timed out" in line
