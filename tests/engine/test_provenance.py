"""A resume knows what changed under it (issue 40, item 3): the reward's source and every data file
are recorded in each checkpoint; a changed one is refused in one line unless allowed, and an allowed
change is recorded where ``graft analyze`` marks it. A built-in verifier's new version is reported."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from graft_rl.commands.cli import main
from graft_rl.engine import provenance
from graft_rl.engine.provenance import changes, data_fingerprint
from graft_rl.rewards import resolve_reward

REWARD = textwrap.dedent(
    """
    def score(responses, problems):
        return [0.5 if any(c.isdigit() for c in r) else 0.0 for r in responses]
    """
)


@pytest.fixture
def run(tmp_path, tiny_pair, tiny_data):
    """A 2-step run of a file.py:function reward on a copy of the tiny data (both files the user's)."""
    (tmp_path / "my_reward.py").write_text(REWARD)
    data = tmp_path / "train.jsonl"
    data.write_text(tiny_data.read_text())
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "steps": 2,
        "prompt_batch": 8,
        "minibatch": 4,
        "n": 2,
        "max_new_tokens": 4,
        "checkpoint_every": 2,
        "data": {"train": str(data), "reward": f"{tmp_path / 'my_reward.py'}:score", "success_threshold": 0.5},
        "method": {"name": "graft"},
        "policies": [
            {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
            {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3},
        ],
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "task.yaml"), "--no-progress"]) == 0
    return tmp_path


def test_every_checkpoint_records_the_reward_source_and_the_data(run):
    state = json.loads((run / "run" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    fp = state["provenance"]
    assert fp["rewards"]["train"]["source"] == str(run / "my_reward.py") and len(fp["rewards"]["train"]["sha256"]) == 64
    assert fp["data"][str(run / "train.jsonl")]["bytes"] == (run / "train.jsonl").stat().st_size


@pytest.mark.parametrize("what", ["reward", "data"])
def test_a_changed_reward_or_data_file_is_refused_then_allowed_and_marked(run, what, capsys):
    metrics = (run / "run" / "metrics.jsonl").read_bytes()
    if what == "reward":  # every answer now scores 1.0
        (run / "my_reward.py").write_text(REWARD.replace("0.5 if any(c.isdigit() for c in r) else 0.0", "1.0"))
    else:  # a training file edited in place
        (run / "train.jsonl").write_text((run / "train.jsonl").read_text().replace('"answer": "0"', '"answer": "1"'))
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "run"), "--no-progress", "steps=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "since checkpoint step_000002" in err and f"--allow-changed {what}" in err
    assert ("my_reward.py changed (sha256" if what == "reward" else "train.jsonl changed (sha256") in err
    assert (run / "run" / "metrics.jsonl").read_bytes() == metrics  # a refusal changes nothing
    assert not (run / "run" / "changes.jsonl").exists()

    args = ["train", "--resume", str(run / "run"), "--no-progress", "steps=3", "--allow-changed", what]
    assert main(args) == 0
    assert "going on with it from step 3" in capsys.readouterr().out
    recorded = [json.loads(x) for x in (run / "run" / "changes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in recorded] == [(3, what)]

    assert main(["analyze", str(run / "run")]) == 0
    assert "changed from step 3: " in capsys.readouterr().out
    assert "Changed during the run" in (run / "run" / "analysis" / "report.md").read_text()


def test_a_new_version_of_a_builtin_verifier_is_reported_not_refused(make_cfg, fake_rewards, monkeypatch, capsys):
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg(steps=2, run="builtin", checkpoint_every=2), show_progress=False)
    tr.run()
    real = provenance._version
    monkeypatch.setattr(provenance, "_version", lambda p: "99.0" if p == "math-verify" else real(p))
    resumed = Trainer.resume(tr.run_dir, show_progress=False, overrides=["steps=3"])  # the data's verifier: math
    resumed.close()
    out = capsys.readouterr().out
    assert "the training reward math: math-verify" in out and "-> 99.0 since checkpoint step_000002 (reported" in out
    assert [k for k, _ in changes(tr.provenance, resumed.provenance)] == ["version"]


def test_unknown_allow_changed_and_without_resume_are_one_line(run, capsys):
    assert main(["train", "--resume", str(run / "run"), "--allow-changed", "rewards", "--no-progress"]) == 2
    assert "--allow-changed 'rewards': expected reward or data" in capsys.readouterr().err
    assert main(["train", str(run / "task.yaml"), "--allow-changed", "reward", "--no-progress"]) == 2
    assert "--allow-changed goes with --resume" in capsys.readouterr().err


def test_a_file_over_the_hashing_limit_is_recorded_by_sampled_blocks(tmp_path, monkeypatch):
    f = tmp_path / "big.jsonl"
    f.write_text("x" * 100)
    monkeypatch.setattr(provenance, "HASH_LIMIT", 10)
    fp = data_fingerprint(str(f))
    assert fp["bytes"] == 100 and "sampled_sha256" in fp and "sha256" not in fp


def test_a_moved_or_copied_run_with_the_same_files_resumes(run, capsys):
    """Content is compared, not paths or modification times: the same reward file elsewhere resumes."""
    import shutil

    moved = run.parent / (run.name + "_moved")
    shutil.copytree(run, moved)  # new paths and modification times; the same bytes
    cfg = yaml.safe_load((moved / "run" / "config.yaml").read_text())
    cfg["data"]["train"] = str(moved / "train.jsonl")
    cfg["data"]["reward"] = f"{moved / 'my_reward.py'}:score"
    fp = json.loads((moved / "run" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["provenance"]
    now = {
        "rewards": {"train": provenance.reward_fingerprint(resolve_reward(cfg["data"]["reward"], 0.5))},
        "data": {str(run / "train.jsonl"): data_fingerprint(str(moved / "train.jsonl"))},
    }
    assert changes(fp, now) == []


def test_large_files_and_folders_are_recorded_by_content(tmp_path, monkeypatch):
    import shutil

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "a.arrow").write_bytes(b"x" * 5000)
    (folder / "b.arrow").write_bytes(b"y" * 5000)
    monkeypatch.setattr(provenance, "HASH_LIMIT", 6000)  # a.arrow hashed whole, b.arrow sampled
    fp = data_fingerprint(str(folder))
    assert "sha256" in fp["files"]["a.arrow"] and "sampled_sha256" in fp["files"]["b.arrow"]
    shutil.copytree(folder, tmp_path / "copy")
    assert changes({"data": {"d": fp}}, {"data": {"d": data_fingerprint(str(tmp_path / "copy"))}}) == []
    (folder / "b.arrow").write_bytes(b"z" * 5000)
    assert [k for k, _ in changes({"data": {"d": fp}}, {"data": {"d": data_fingerprint(str(folder))}})] == ["data"]


def test_a_python_function_s_code_is_hashed_not_where_it_sits():
    from graft_rl.rewards.functions import _code_sha256

    a = lambda r, p: [1.0] * len(r)  # noqa: E731
    b = lambda r, p: [1.0] * len(r)  # noqa: E731 (same code, another column and line)
    c = lambda r, p: [0.5] * len(r)  # noqa: E731
    assert _code_sha256(a) == _code_sha256(b) != _code_sha256(c)
