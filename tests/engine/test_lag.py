"""Rollouts that lag the trainer (``rollout.lag``, graft_rl.policy.lag): which weights a generation samples
from, that the live weights come back exactly, the gap it opens, and resume."""

from __future__ import annotations

import json

import pytest
import torch

from graft_rl.policy.lag import RolloutLag


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- the history
def _params(v: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((2, 2), v)), ("b", torch.full((3,), -v))]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_lagged_generation_samples_the_weights_of_k_pushes_earlier(k):
    """Pushes at versions 0, 1, 2, ...: generation t samples version max(0, t - k); an unchanged version
    (every update of a step skipped) is no new push."""
    lag = RolloutLag(k)
    sampled = []
    for version in [0, 1, 2, 2, 3, 4, 5]:
        params = _params(float(version))
        lag.observe(params, version)
        i = lag.chosen()
        if i is None:
            sampled.append(version)
            continue
        live = [t.clone() for _, t in params]
        with lag.swapped(params, i):
            sampled.append(float(params[0][1][0, 0]))
            assert float(params[1][1][0]) == -sampled[-1]
        assert all(torch.equal(a, t) for a, (_, t) in zip(live, params, strict=True))  # back, bit for bit
        assert len(lag.history) <= k + 1
    pushes = [0, 1, 2, 2, 3, 4, 5]
    order = [0, 1, 2, 3, 4, 5]  # distinct pushes in order
    want = [order[max(0, order.index(v) - k)] for v in pushes]
    assert sampled == want


def test_the_history_survives_a_checkpoint(tmp_path):
    lag = RolloutLag(2)
    for v in range(4):
        lag.observe(_params(float(v)), v)
    lag.save(tmp_path / "lag.safetensors", version=4)  # live weights moved on: 4 is not in the history
    back = RolloutLag(2)
    back.load(tmp_path / "lag.safetensors", version=0)
    assert [float(e["w"][0, 0]) for e in back.history] == [2.0, 3.0]  # the k entries the next push needs
    back.observe(_params(4.0), 0)
    lag.observe(_params(4.0), 4)
    assert [float(e["w"][0, 0]) for e in back.history] == [float(e["w"][0, 0]) for e in lag.history]
    assert back.chosen() == lag.chosen()


# --------------------------------------------------------------------------- a run
def test_lag_opens_the_gap_from_the_second_step_on(make_cfg, fake_rewards):
    """At lag 0 the hf engine is the trainer's live module (gap ~1e-13); at lag 1 step 2 samples from the
    step-1 weights while pi_old is the step-2 ones."""
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "grpo"}, steps=3, run="lag1", rollout={"lag": 1}), show_progress=False)
    tr.run()
    for ln in _lines(tr.run_dir):
        if ln["step"] == 1:
            assert ln["mismatch_kl"] < 1e-6, ln
        else:
            assert ln["mismatch_kl"] > 1e-6, ln


def test_a_resume_at_lag_1_equals_the_uninterrupted_run(make_cfg, fake_rewards):
    from safetensors.torch import load_file

    from graft_rl.engine.store import RecordStore
    from graft_rl.engine.trainer import Trainer

    method = {"name": "graft", "correction": "tis"}
    full = Trainer(make_cfg(method, steps=4, run="full", rollout={"lag": 1}), show_progress=False)
    full.run()
    first = Trainer(make_cfg(method, steps=4, run="resumed", rollout={"lag": 1}), show_progress=False)
    first.run(max_steps=2)
    first.close()
    assert any((first.run_dir / "checkpoints").rglob("rollout_lag.safetensors"))
    resumed = Trainer.resume(first.run_dir, show_progress=False)
    resumed.run()
    resumed.close()

    def strip(lines):
        return [{k: v for k, v in ln.items() if not k.startswith("time_")} for ln in lines]

    assert strip(_lines(full.run_dir)) == strip(_lines(first.run_dir))
    full.close()
    for name in ("A", "B"):
        assert RecordStore(full.run_dir).read_exchange(name) == RecordStore(first.run_dir).read_exchange(name)
        # the final weights, and the lag history a further resume would read
        for f in ("model.safetensors", "rollout_lag.safetensors"):
            a = load_file(str(full.run_dir / "checkpoints" / "step_000004" / name / f))
            b = load_file(str(first.run_dir / "checkpoints" / "step_000004" / name / f))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, f)


@pytest.mark.parametrize("lag", [-1, 1.5, True])
def test_rollout_lag_is_checked(make_cfg, lag):
    from graft_rl.engine.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.lag"):
        make_cfg(rollout={"lag": lag})


@pytest.mark.slow
def test_the_lookup_pair_at_lag_0_and_1(tmp_path):
    """Issue 51's check on the lookup pair (configs/lookup/graft.yaml), hf backend, float32, 3 steps:
    mismatch_kl below 1e-6 at lag 0, above it from the second step on at lag 1."""
    from pathlib import Path

    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    config = Path(__file__).resolve().parents[2] / "configs" / "lookup" / "graft.yaml"
    gaps = {}
    for lag in (0, 1):
        run_dir = tmp_path / f"lag{lag}"
        keys = [f"run_dir={run_dir}", "steps=3", "validation.data=[]", f"rollout.lag={lag}"]
        tr = Trainer(load_config(config, keys), show_progress=False)
        tr.run()
        tr.close()
        gaps[lag] = [(ln["step"], ln["mismatch_kl"]) for ln in _lines(run_dir) if ln["mismatch_kl"] is not None]
    assert len(gaps[0]) == len(gaps[1]) == 3  # B's own rows every step (A's groups are all replaced)
    assert all(g < 1e-6 for _, g in gaps[0])
    assert [g > 1e-6 for _, g in gaps[1]] == [False, True, True]
