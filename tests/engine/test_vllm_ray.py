"""The paper-scale path end to end on CPU (issue 21): Ray, both policies sharded over 2 FSDP2 ranks,
each rank with its own vLLM engine; 2 steps, stop, resume to 3.

- the run equals the in-process vLLM run (same exchanges, losses and gradient norms);
- step N's rollouts score against step N-1's weights (the weight push reaches the engine, within a
  run and after a resume) and not against the initial ones; with every rank sampling its share (the
  default), both ranks' engines do;
- ``graft eval`` spreads a policy's checkpoint over vLLM replicas (2 here), and ``graft analyze``
  picks the trainer's best step.

Needs vLLM and Ray: ``bash scripts/setup_vllm_cpu.sh && .venv-vllm/bin/python -m pytest -m vllm``
(what ``.ci/run`` runs after the main suite; this file takes ~6 minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from graft_rl.engine.rollouts import Rollouts  # noqa: E402
from graft_rl.engine.store import RecordStore  # noqa: E402
from graft_rl.engine.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory):
    """Two toy models vLLM's CPU attention accepts (head size 64): Llama + byte-level tokenizer, Qwen3 + BPE."""
    from graft_rl.commands.preflight import build_toy_model

    root = tmp_path_factory.mktemp("vllm_pair")
    return build_toy_model(root / "a", "llama", 0, seed=0), build_toy_model(root / "b", "qwen3", 1, seed=1)


def _strip(lines):
    return [{k: v for k, v in ln.items() if not k.startswith("time_")} for ln in lines]


def test_sharded_vllm_run_equals_in_process_and_pushes_weights_to_every_rank(
    make_cfg, vllm_pair, tiny_data, monkeypatch
):
    from runs import fake_verify

    from graft_rl.commands.analyze import analyze
    from graft_rl.commands.evaluate_cli import run_eval
    from graft_rl.policy import Policy, PolicyConfig

    monkeypatch.setattr(Rollouts, "verify_groups", fake_verify)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    vk = {"max_model_len": 512}
    pols = [
        {"name": "A", "model": str(vllm_pair[0]), "lr": 1e-3, "backend": "vllm", "vllm_kwargs": vk},
        {"name": "B", "model": str(vllm_pair[1]), "lr": 1e-3, "backend": "vllm", "vllm_kwargs": vk},
    ]
    val = {"data": [str(tiny_data)], "every": 1, "samples": 1, "max_new_tokens": 4, "limit": 4}
    common = dict(steps=3, validation=val, keep_checkpoints=3)
    local = Trainer(make_cfg({"name": "graft"}, run="local", policies=pols, **common), show_progress=False)
    local_lines = local.run()
    local.close()
    local_dir = local.run_dir
    local = None  # its two engines go before the Ray ranks start theirs

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    try:
        sharded = [{**p, "world_size": 2, "rollout_on_rank0": True} for p in pols]  # rank 0 samples as one process
        kw = dict(execution="ray", ray={"num_cpus": 0.5, "torch_threads": 1}, policies=sharded, **common)
        first = Trainer(make_cfg({"name": "graft"}, run="ray", **kw), show_progress=False)
        first_lines = first.run(max_steps=2)
        first.close()
        resumed = Trainer.resume(first.run_dir, show_progress=False)
        rest = resumed.run()
        resumed.close()
        run = first.run_dir

        # 1. the sharded, resumed run is the in-process run
        for name in ("A", "B"):
            a, b = RecordStore(local_dir).read_exchange(name), RecordStore(run).read_exchange(name)
            assert [(r["step"], r["prompt_id"], r["group_index"]) for r in a] == [
                (r["step"], r["prompt_id"], r["group_index"]) for r in b
            ]
            assert [r["weight"] for r in b] == pytest.approx([r["weight"] for r in a], abs=1e-6)
        for x, y in zip(_strip(local_lines), _strip(first_lines + rest), strict=True):
            assert x.keys() == y.keys()
            for k in x:
                if isinstance(x[k], list):  # per-response compatibility lists, rounded to 5 decimals
                    assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1.01e-5), (x["step"], x["policy"], k)
                elif isinstance(x[k], float):
                    assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), (x["step"], x["policy"], k)
                else:
                    assert x[k] == y[k], (x["step"], x["policy"], k)
        assert sum(ln["exchanged_in"] for ln in local_lines) > 0

        # 2. step N's rollouts (both ranks' shares of the prompts) score against step N-1's weights
        store = RecordStore(run)
        for name, initial in (("A", vllm_pair[0]), ("B", vllm_pair[1])):
            for step in (2, 3):  # 2: pushed within the first run; 3: after the resume
                groups = store.read(name, step)
                weights = run / "checkpoints" / f"step_{step - 1:06d}" / name
                diffs = {}
                for label, model in (("previous", weights), ("initial", initial)):
                    pol = Policy(PolicyConfig(name, str(model)))
                    lp, mask = pol.token_logprobs(pol.encode_own(groups))
                    gen = torch.zeros_like(lp)
                    for i, row in enumerate(x for g in groups for x in g.gen_logprobs):
                        gen[i, : len(row)] = torch.tensor(row)
                    diffs[label] = float(((gen - lp).abs() * mask).max())
                assert len(groups) == 8
                assert diffs["previous"] < 1e-4, (name, step, diffs)
                assert diffs["initial"] > 100 * diffs["previous"], (name, step, diffs)

        # 3. graft eval over the run's devices (2 vLLM replicas per policy); analyze's best = the trainer's
        from graft_rl.commands.evaluate_cli import default_replicas

        assert default_replicas(str(run), None) == 4  # by default eval spreads over all 4 of the run's devices
        res = run_eval(str(run), samples=1, runs=1, limit=2, show=False, replicas=2, policy="B")  # B: Qwen3 + BPE
        assert {n: (p["replicas"], p["backend"]) for n, p in res["policies"].items()} == {"B": (2, "vllm")}
        summary = analyze(run)
        best = json.loads((run / "best" / "best.json").read_text())
        assert {n: summary["policies"][n]["best_step"] for n in "AB"} == {n: best[n]["step"] for n in "AB"}
    finally:
        ray.shutdown()


def test_every_rank_engine_samples_its_share_from_the_pushed_weights(make_cfg, vllm_pair, monkeypatch):
    """Issue 22 (default rollouts): each rank's engine samples its share of the prompts with its own
    seed; step 2's rollouts of both shares score against step 1's weights."""
    from runs import fake_verify

    from graft_rl.policy import Policy, PolicyConfig

    monkeypatch.setattr(Rollouts, "verify_groups", fake_verify)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    try:
        pol = {
            "name": "A",
            "model": str(vllm_pair[0]),
            "lr": 1e-3,
            "backend": "vllm",
            "world_size": 2,
            "vllm_kwargs": {"max_model_len": 512},
        }
        tr = Trainer(
            make_cfg(
                {"name": "grpo"},
                steps=2,
                run="shares",
                policies=[pol],
                execution="ray",
                ray={"num_cpus": 1, "torch_threads": 1},
            ),
            show_progress=False,
        )
        tr.run()
        tr.close()
    finally:
        ray.shutdown()
    groups = RecordStore(tr.run_dir).read("A", 2)
    assert len(groups) == 8
    pols = {
        label: Policy(PolicyConfig("A", str(m)))
        for label, m in (("previous", tr.run_dir / "checkpoints" / "step_000001" / "A"), ("initial", vllm_pair[0]))
    }
    for share in (groups[0::2], groups[1::2]):  # rank 0's prompts, rank 1's
        diffs = {}
        for label, p in pols.items():
            lp, mask = p.token_logprobs(p.encode_own(share))
            gen = torch.zeros_like(lp)
            for i, row in enumerate(x for g in share for x in g.gen_logprobs):
                gen[i, : len(row)] = torch.tensor(row)
            diffs[label] = float(((gen - lp).abs() * mask).max())
        assert diffs["previous"] < 1e-4 and diffs["initial"] > 100 * diffs["previous"], diffs
