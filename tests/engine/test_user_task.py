"""A researcher's own task end to end: data read through ``datasets`` with a column mapping, a reward by
import path (and one given as a Python function), used by training, validation, resume, ``graft eval``
and ``graft probe`` -- in-process and under Ray. A reward that returns a constant proves every score
comes from it: the built-in verifiers give the random tiny models 0."""

from __future__ import annotations

import json
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graft_rl.engine.config import load_config
from graft_rl.engine.store import RecordStore
from graft_rl.engine.trainer import Trainer
from graft_rl.rewards import RewardError

CONSTANT = 0.25  # every response's reward; success_threshold 0.2 makes each one a success

REWARD_FILE = textwrap.dedent(
    f"""
    def constant(responses, problems):
        assert all("kind" in p for p in problems)  # the data's own column reaches the reward
        return [{CONSTANT}] * len(responses)
    """
)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The three files a user writes: data (parquet, own column names), a reward, and (below) a config."""
    root = tmp_path_factory.mktemp("task")
    rows = [{"question": f"{i}+{i}=?", "target": 2 * i, "kind": "even" if i % 2 == 0 else "odd"} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), root / "heldout.parquet")
    (root / "task_reward.py").write_text(REWARD_FILE)
    return root


def _cfg(task, tiny_pair, run_dir, reward: str | None = None, **kw):
    columns = {"problem": "question", "answer": "target"}
    data = {
        "run_dir": str(run_dir),
        "steps": 2,
        "prompt_batch": 8,
        "minibatch": 4,
        "n": 2,
        "max_new_tokens": 4,
        "checkpoint_every": 1,
        "data": {"train": str(task / "train.parquet"), "columns": columns, "success_threshold": 0.2},
        "validation": {
            "data": [
                {"data": str(task / "heldout.parquet"), "name": "heldout", "columns": columns},
                {"data": str(task / "heldout.parquet"), "name": "numbers", "columns": columns, "reward": "gsm8k"},
            ],
            "every": 1,
            "samples": 2,
            "max_new_tokens": 4,
        },
        "method": {"name": "graft"},
        "policies": [
            {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
            {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3},
        ],
        **kw,
    }
    if reward is not None:
        data["data"]["reward"] = reward
    return load_config(data)


def _check_run(run_dir, steps=(1, 2)):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({ln["step"] for ln in lines}) == list(steps)
    assert all(ln["reward_mean"] == pytest.approx(CONSTANT) and ln["all_pass_frac"] == 1.0 for ln in lines)
    val = [json.loads(x) for x in (run_dir / "validation.jsonl").read_text().splitlines()]
    assert all(v["val/heldout"] == 1.0 for v in val)  # the run's reward: every response a success
    assert all(v["val/numbers"] == 0.0 for v in val)  # this set's own reward (gsm8k): nothing boxed
    rewards = RecordStore(run_dir).read("A", steps[-1])
    assert all(r == pytest.approx(CONSTANT) for g in rewards for r in g.rewards)


def test_a_reward_by_path_trains_validates_resumes_evaluates_and_probes(task, tiny_pair, tmp_path):
    from graft_rl import probe, run_eval

    run = tmp_path / "run"
    cfg = _cfg(task, tiny_pair, run, reward=f"{task / 'task_reward.py'}:constant")
    tr = Trainer(cfg, show_progress=False)
    try:
        tr.run(max_steps=1)
    finally:
        tr.close()
    resumed = load_config(run / "config.yaml", saved=True)
    assert resumed.data.reward.endswith("task_reward.py:constant")
    tr = Trainer(resumed, resume=True, show_progress=False)  # the reward comes back from the config
    try:
        tr.run()
    finally:
        tr.close()
    _check_run(run)

    res = run_eval(str(run), samples=2, runs=1, max_new_tokens=4, show=False)
    assert {b: p["pass@1_mean"] for b, p in res["policies"]["A"]["benchmarks"].items()} == {
        "heldout": 1.0,
        "numbers": 0.0,
    }

    out = probe(cfg, limit=8, out_dir=tmp_path / "probe", show=False)
    assert out["reward"].endswith("task_reward.py:constant")
    assert all(p["reward_mean"] == pytest.approx(CONSTANT) and p["all_pass"] == 1.0 for p in out["policies"].values())


def test_a_reward_given_as_a_python_function(task, tiny_pair, tmp_path):
    seen = []

    def constant(responses, problems):  # a notebook's function: no import path names it
        seen.append(problems[0]["kind"])
        return [CONSTANT] * len(responses)

    run = tmp_path / "run"
    tr = Trainer(_cfg(task, tiny_pair, run), show_progress=False, reward=constant)
    try:
        tr.run(max_steps=1)
    finally:
        tr.close()
    saved = load_config(run / "config.yaml", saved=True)
    assert saved.data.reward.startswith("python:") and saved.data.reward.endswith("constant")
    with pytest.raises(RewardError, match=r"give it again \(Trainer\(cfg, resume=True, reward=FUNCTION\)\)"):
        Trainer(saved, resume=True, show_progress=False)
    tr = Trainer(saved, resume=True, show_progress=False, reward=constant)
    try:
        tr.run()
    finally:
        tr.close()
    _check_run(run)
    assert seen == []  # it ran in the verifier workers, not in this process
    from graft_rl import probe, run_eval

    with pytest.raises(ValueError, match=r"its reward python:.*constant was a Python function; evaluate from Python"):
        run_eval(str(run), samples=2, runs=1, max_new_tokens=4, show=False)
    res = run_eval(str(run), samples=2, runs=1, max_new_tokens=4, show=False, reward=constant)
    assert res["policies"]["B"]["benchmarks"]["heldout"]["pass@1_mean"] == 1.0
    out = probe(_cfg(task, tiny_pair, tmp_path / "p"), limit=8, out_dir=tmp_path / "probe", show=False, reward=constant)
    assert all(p["reward_mean"] == pytest.approx(CONSTANT) for p in out["policies"].values())


def test_a_broken_reward_stops_before_training_with_one_line(task, tiny_pair, tmp_path):
    bad = task / "bad_reward.py"
    bad.write_text("def f(responses, problems):\n    return [1.0, 2.0]\n")
    with pytest.raises(
        RewardError, match=r"reward .*bad_reward.py:f on problem '\w+': reward contract: returned 2 scores"
    ):
        Trainer(_cfg(task, tiny_pair, tmp_path / "run", reward=f"{bad}:f"), show_progress=False)
    assert not (tmp_path / "run").exists()  # nothing left behind


@pytest.mark.slow
def test_a_reward_by_path_under_ray(task, tiny_pair, tmp_path, ray_local):
    pytest.importorskip("ray")
    run = tmp_path / "ray"
    cfg = _cfg(
        task, tiny_pair, run, reward=f"{task / 'task_reward.py'}:constant", execution="ray", ray={"num_cpus": 0.5}
    )
    tr = Trainer(cfg, show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    _check_run(run)  # validation ran in the policies' actors, with the same reward
    from graft_rl import run_eval

    res = run_eval(str(run), samples=2, runs=1, max_new_tokens=4, show=False, replicas=2)  # two Ray replicas
    assert {b: p["pass@1_mean"] for b, p in res["policies"]["B"]["benchmarks"].items()} == {
        "heldout": 1.0,
        "numbers": 0.0,
    }
    assert all(g.success == [True] * g.n for g in RecordStore(run).read("B", 2))  # recorded per response
