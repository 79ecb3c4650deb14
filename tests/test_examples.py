"""examples/word_games stays runnable: its config loads, its data reads through `datasets` with its
column mapping, its reward scores as its docstring says, and one GRAFT step runs on it (tiny models in
place of the two real LMs, which the example's own run uses)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from graft_rl import Trainer, load_config
from graft_rl.data import load_dataset
from graft_rl.rewards import resolve_reward

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "word_games"


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root, as its README runs it


def test_the_example_config_data_and_reward(in_repo):
    cfg = load_config(EXAMPLE / "graft.yaml")
    assert load_config(EXAMPLE / "grpo.yaml").method.name == "grpo"
    train = load_dataset(cfg.data.train, columns=cfg.data.columns)
    assert len(train) == 240 and {p.subject for p in train} == {"first", "upper"}
    reward = resolve_reward(cfg.data.reward, cfg.data.success_threshold)
    first = next(p for p in train if p.subject == "first").row()
    upper = next(p for p in train if p.subject == "upper").row()
    responses = [
        f"The answer is \\boxed{{{first['target'].upper()}}}.",  # first letter: case does not matter
        f"The answer is \\boxed{{{upper['target']}}}.",
        f"The answer is \\boxed{{{upper['target'].lower()}}}.",  # right word, wrong case: partial credit
        "I do not know.",
    ]
    scores, _ = reward.score(responses, [first, upper, upper, upper])
    assert scores == [1.0, 1.0, 0.5, 0.0] and reward.successes(scores) == [True, True, False, False]


def _have(module: str) -> bool:
    """Whether an optional package imports (the track extra's trackers are optional)."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_one_graft_step_on_the_example(in_repo, tiny_pair, tmp_path, capsys):
    cfg = load_config(
        EXAMPLE / "graft.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            "steps=1",
            "n=2",
            *(["report_to=[mlflow]"] if _have("mlflow") else []),  # the tracker: only with the track extra
            "validation.limit=4",
            "validation.samples=1",
            f"policies.0.model={tiny_pair[0]}",
            f"policies.1.model={tiny_pair[1]}",
        ],
    )
    cfg = dataclasses.replace(cfg, policies=[dataclasses.replace(p, plain_template="{prompt}\n") for p in cfg.policies])
    tr = Trainer(cfg, show_progress=False)
    try:
        lines = tr.run()
    finally:
        tr.close()
    assert len(lines) == 2 and all(ln["groups/first"] + ln["groups/upper"] == 8 for ln in lines)
    if _have("mlflow"):
        assert (tmp_path / "run" / "mlruns").is_dir()
        assert "failed" not in capsys.readouterr().out  # the tracker took every metric, per-family ones too
