"""What only a GPU would show (issue 32), checked here with a fake vLLM that behaves as the CUDA build
does where it matters: the V2 model runner draws an unseeded request's seed from numpy's global RNG,
which every engine resets to the model seed at start (``v1/worker/gpu/sample/states.py``,
``gpu_worker.py``), and never reads torch's generator; sleep mode's allocator is one per process.
The real engine's paths run in ``tests/policy/test_vllm_backend.py`` (vLLM's CPU build) and in
``scripts/gpu_check.py`` on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graft_rl.policy.types import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm as fv  # noqa: E402
from fake_vllm import FakeLLM, SyncMPClient  # noqa: E402


@pytest.fixture
def fake_vllm(monkeypatch):
    return fv.install(monkeypatch)


def _backend(sleep=False, name="A", model=None, **kw):
    from graft_rl.policy.vllm_backend import VLLMBackend

    torch.manual_seed(0)
    model = model or torch.nn.Linear(2, 2)
    FakeLLM.source = model  # the engine loads what the trainer loaded
    return VLLMBackend(model, "model_dir", sleep=sleep, name=name, **kw)


SP = SamplingParams(n=4, max_new_tokens=8)
PROMPTS = [[1, 2, 3], [1, 2, 3], [4, 5]]


def _tokens(backend, seed):
    return [s.token_ids for group in backend.generate(PROMPTS, SP, seed) for s in group]


# ---------------------------------------------------------------- 1: sampling seeds


def test_every_request_carries_its_own_seed_derived_from_the_calls(fake_vllm):
    from graft_rl.policy.vllm_backend import request_seeds

    seen = []
    b = _backend()
    real = b.llm.generate
    b.llm.generate = lambda prompts, params, **kw: (seen.append([p.seed for p in params]), real(prompts, params))[1]
    b.generate(PROMPTS, SP, 7)
    assert seen == [request_seeds(7, 3)] and None not in seen[0]
    # a request's children take seed + i: no two prompts of a call share a stream
    children = [s + i for s in request_seeds(7, 1000) for i in range(64)]
    assert len(set(children)) == len(children)


def test_same_seed_same_samples_and_rank_seeds_differ_under_the_v2_runner(fake_vllm):
    """Two engines (two ranks, or two eval replicas) each reset numpy to the model seed: unseeded requests
    drew identical samples on every one of them (torch's generator, which graft-rl reseeded, is never
    read). With per-request seeds the call's seed decides."""
    from graft_rl.seeding import rank_seed

    rank0, rank1 = _backend(), _backend()
    a = _tokens(rank0, rank_seed(11, 0, 2))
    assert _tokens(rank1, rank_seed(11, 1, 2)) != a  # ranks sample independently
    assert _tokens(_backend(), rank_seed(11, 0, 2)) == a  # a seed reproduces a call, on a fresh engine
    assert _tokens(rank0, rank_seed(11, 0, 2)) == a  # and on the same engine, after other calls
    groups = rank0.generate(PROMPTS, SP, 3)
    assert groups[0][0].token_ids != groups[1][0].token_ids  # identical prompts: independent groups
    assert len({tuple(s.token_ids) for s in groups[0]}) == 4  # the n samples of one prompt differ


def test_the_worker_reseed_reaches_numpy_the_v2_runners_fallback():
    """The seed path V2 takes for an unseeded request, in isolation: numpy's global RNG, which the
    reseed callable now sets from the call's seed (it only seeded torch)."""
    from graft_rl.policy.vllm_backend import _reseed_worker

    draws = []
    for seed in (5, 6, 5):
        np.random.seed(0)  # the engine's reset to the model seed
        _reseed_worker(None, seed)
        draws.append(int(np.random.randint(-(2**62), 2**62)))
    assert draws[0] == draws[2] != draws[1]


def test_eval_runs_on_different_replicas_sample_differently(fake_vllm):
    """graft eval's run r of chunk s is sampled with seed 1000 r + s wherever it runs: two replicas
    (fresh engines) give different samples for runs 0 and 1, the same for the same run."""
    assert _tokens(_backend(), 1000) != _tokens(_backend(), 0)
    assert _tokens(_backend(), 1000) == _tokens(_backend(), 1000)


# ---------------------------------------------------------------- 2, 3: sleep


def test_a_second_sleep_mode_engine_in_one_process_is_refused_in_one_line(fake_vllm):
    from graft_rl.policy.vllm_backend import VLLMEngineError

    _backend(sleep=True, name="A")
    with pytest.raises(VLLMEngineError) as err:
        _backend(sleep=True, name="B")
    msg = str(err.value)
    assert "policy 'B'" in msg and "execution: ray" in msg and "\n" not in msg
    assert "sleep: false" not in msg  # issue 39: no message recommends a second engine in the process


def test_a_closed_engine_lets_the_next_one_start(fake_vllm, monkeypatch):
    b = _backend(sleep=True)
    monkeypatch.setattr(FakeLLM, "usage", 0)  # vLLM freed the allocator's memory on shutdown
    b.close()
    assert b.llm is None
    _backend(sleep=True, name="B")


def test_level_one_until_a_push_reloads_every_weight_then_level_two_and_a_push_before_each_generation(fake_vllm):
    from graft_rl.policy.training import PolicyTraining

    b = _backend(sleep=True)
    assert b.llm.calls == [("sleep", 1)]  # as built: the weights loaded from disk are kept (level 1)
    assert not b.needs_push
    pol = SimpleNamespace(backend=b, weights_version=1, _synced_version=0)
    PolicyTraining.sync_rollout_weights(pol)  # the first step's push: every weight loaded
    b.generate(PROMPTS, SP, 0)
    assert b.llm.calls[-1] == ("sleep", 2) and b.needs_push  # discarded: nothing is copied to host memory
    PolicyTraining.sync_rollout_weights(pol)  # same weights version (e.g. validation): pushed anyway
    assert [c for c in b.llm.calls if c[0] == "reload"] == [("reload", 2), ("reload", 2)]
    assert not b.needs_push
    b.generate(PROMPTS, SP, 1)
    assert [c for c in b.llm.calls if c[0] == "sleep"] == [("sleep", 1), ("sleep", 2), ("sleep", 2)]


def test_a_push_that_misses_a_weight_is_refused_at_level_one_and_nothing_is_sampled(fake_vllm, monkeypatch):
    """Issue 39.1: the old check raised only after a level-2 sleep, which a push that missed weights
    never reached: the engine sampled from its old weights at level 1 for ever, silently."""
    from graft_rl.policy.training import PolicyTraining
    from graft_rl.policy.vllm_backend import VLLMEngineError

    b = _backend(sleep=True)
    with torch.no_grad():
        b.model.weight.add_(1.0)  # an update
    monkeypatch.setattr(FakeLLM, "unloaded", {"weight"})
    with pytest.raises(
        VLLMEngineError, match=r"policy 'A': .*weight differs from the trainer's weight \(2 of 2 rows\)"
    ):
        b.sync_weights()
    assert b.needs_push and not b.full_push
    with pytest.raises(VLLMEngineError, match="not the trainer's"):
        b.generate(PROMPTS, SP, 0)  # nothing is sampled from the stale engine
    monkeypatch.setattr(FakeLLM, "unloaded", set())
    pol = SimpleNamespace(backend=b, weights_version=1, _synced_version=1)
    PolicyTraining.sync_rollout_weights(pol)  # needs_push: pushed although the version is unchanged
    assert not b.needs_push and b.full_push
    b.generate(PROMPTS, SP, 0)
    assert [c for c in b.llm.calls if c[0] == "sleep"] == [("sleep", 1), ("sleep", 2)]


def test_generation_after_a_level_two_sleep_without_a_push_is_refused(fake_vllm):
    from graft_rl.policy.vllm_backend import VLLMEngineError

    b = _backend(sleep=True)
    b.sync_weights()
    b.generate(PROMPTS, SP, 0)
    with pytest.raises(VLLMEngineError, match="without a verified weight push"):
        b.generate(PROMPTS, SP, 0)


# ---------------------------------------------------------------- 4: in-process engine


def test_the_engine_is_kept_in_process_whatever_the_environment_says(fake_vllm, monkeypatch):
    import os

    from graft_rl.policy.vllm_backend import VLLMEngineError

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    _backend()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setattr(FakeLLM, "core", SyncMPClient)  # an engine that started in a child process anyway
    with pytest.raises(VLLMEngineError, match="in another process"):
        _backend()


# ---------------------------------------------------------------- config: one sleep engine per process


def _two_vllm(execution="local", sleep_b=None):
    from graft_rl.engine.config import load_config

    b = {"name": "B", "model": "Qwen/Qwen3-1.7B-Base", "device": "cuda", "backend": "vllm"}
    if sleep_b is not None:
        b["vllm_kwargs"] = {"sleep": sleep_b}
    return load_config(
        {
            "execution": execution,
            "policies": [{"name": "A", "model": "Qwen/Qwen3-1.7B-Base", "device": "cuda", "backend": "vllm"}, b],
        }
    )


def test_local_execution_with_two_vllm_engines_on_cuda_is_refused_before_anything_loads():
    """Issue 39.2: whatever their sleep settings (a second engine without sleep mode would reuse the first
    one's rotary cache from its sleep pool), naming execution: ray with a fractional GPU share."""
    from graft_rl.commands.plan import format_plan, plan
    from graft_rl.engine.config import ConfigError
    from graft_rl.engine.resources import check_vllm_engines

    for cfg in (_two_vllm(), _two_vllm(sleep_b=False)):
        with pytest.raises(ConfigError) as err:
            check_vllm_engines(cfg)
        msg = str(err.value)
        assert "execution: ray" in msg and "ray.num_gpus=0.5" in msg and "A, B" in msg and "\n" not in msg
        assert "sleep" not in msg.split("execution: ray")[1]  # no second engine in the process is suggested
        assert "NOT supported as configured" in format_plan(plan(cfg), shared=True)
    check_vllm_engines(_two_vllm("ray"))


def test_a_vllm_policy_on_a_gpu_other_than_cuda_0_under_local_execution_is_refused():
    from graft_rl.engine.config import ConfigError, load_config
    from graft_rl.engine.resources import check_vllm_engines

    pols = [{"name": "A", "model": "m", "device": "cuda:1", "backend": "vllm"}, {"name": "B", "model": "m"}]
    with pytest.raises(ConfigError, match=r"policy 'A': device cuda:1 .*CUDA_VISIBLE_DEVICES=1.*execution: ray"):
        check_vllm_engines(load_config({"execution": "local", "policies": pols}))
    pols[0]["backend"] = "hf"
    check_vllm_engines(load_config({"execution": "local", "policies": pols}))


def test_the_backend_refuses_cuda_1_itself(fake_vllm):
    from graft_rl.policy.vllm_backend import VLLMEngineError

    with pytest.raises(VLLMEngineError, match=r"device cuda:1 .*CUDA_VISIBLE_DEVICES=1"):
        _backend(device="cuda:1")
    assert FakeLLM.built == []  # refused before an engine is built


# ---------------------------------------------------------------- 4: device placement


def test_a_rank_actor_pins_its_ray_gpu_as_the_only_visible_device(monkeypatch):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")

    from graft_rl.engine.distributed import ActorError, pin_actor_gpu

    seen = {}
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("device", d))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    pin_actor_gpu("A", 1)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and seen["device"] == 0
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0, 1])
    with pytest.raises(ActorError, match=r"policy 'A' rank 1: a rank actor needs exactly one GPU, Ray assigned it 2"):
        pin_actor_gpu("A", 1)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [2])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ActorError, match="CUDA started before"):
        pin_actor_gpu("A", 1)


def test_a_vllm_rank_shares_a_gpu_only_with_an_engine_share_that_fits():
    """Issue 39.2: two vLLM policies on one GPU run under execution: ray with ray.num_gpus=0.5 (each in its
    own process), as long as each engine asks for less than its share (vLLM's start-up check)."""
    from graft_rl.engine.config import load_config
    from graft_rl.engine.distributed import ResourceError, check_cluster

    def cfg(num_gpus, backend="vllm", util=None):
        kw = {"vllm_kwargs": {"gpu_memory_utilization": util}} if util is not None else {}
        pols = [{"name": n, "model": "x", "device": "cuda", "backend": backend, **kw} for n in ("A", "B")]
        return load_config({"execution": "ray", "ray": {"num_cpus": 1, "num_gpus": num_gpus}, "policies": pols})

    one_gpu = [{"CPU": 8.0, "GPU": 1.0}]
    check_cluster(cfg(0.5), cfg(0.5).policies, nodes=one_gpu)  # default share 0.4 of the GPU each
    with pytest.raises(ResourceError, match=r"policy 'A': .*ray.num_gpus=0.5.*gpu_memory_utilization at most 0.4"):
        check_cluster(cfg(0.5, util=0.6), cfg(0.5, util=0.6).policies, nodes=one_gpu)
    with pytest.raises(ResourceError, match=r"ray.num_gpus=0.5 would share them, each vLLM engine's"):
        check_cluster(cfg(1.0), cfg(1.0).policies, nodes=one_gpu)


def test_a_sharded_vllm_policy_is_refused_a_fraction_of_a_gpu():
    """Issue 53: engines sharing a GPU take turns to start, sleep and wake (vllm_backend.gpu_turn); a sharded
    policy's engines start inside its collectives, where holding a turn could deadlock with another policy's
    ranks on the same GPUs. One line, naming both ways out."""
    from graft_rl.engine.config import load_config
    from graft_rl.engine.distributed import ResourceError, check_cluster

    pols = [{"name": n, "model": "x", "device": "cuda", "backend": "vllm", "world_size": 2} for n in ("A", "B")]
    cfg = load_config({"execution": "ray", "ray": {"num_cpus": 1, "num_gpus": 0.5}, "policies": pols})
    with pytest.raises(
        ResourceError,
        match=r"policy 'A': a vLLM policy with world_size=2 on ray.num_gpus=0.5: .*"
        r"set ray.num_gpus=1 \(a GPU per rank\) or world_size=1",
    ):
        check_cluster(cfg, cfg.policies, nodes=[{"CPU": 8.0, "GPU": 2.0}])
    hf = load_config(
        {
            "execution": "ray",
            "ray": {"num_cpus": 1, "num_gpus": 0.5},
            "policies": [{**p, "backend": "hf"} for p in pols],
        }
    )
    check_cluster(hf, hf.policies, nodes=[{"CPU": 8.0, "GPU": 2.0}])  # no engine, no turns


def test_a_rank_that_only_pushed_sleeps_too_so_every_rank_pushes_alike(fake_vllm):
    """Review of issue 32: after a push the KV cache still sleeps; `rest()` (rollout_on_rank0's other
    ranks) must still put the woken weights to sleep, or those ranks keep them on the GPU and disagree
    with rank 0 about the next push (a collective)."""
    rank0 = _backend(sleep=True)
    FakeLLM.usage = 0  # the other rank's engine lives in its own process
    rank1 = _backend(sleep=True)
    for b in (rank0, rank1):
        b.sync_weights()
    rank0.generate(PROMPTS, SP, 0)
    rank1.rest()
    assert rank0.needs_push and rank1.needs_push
    assert rank1.sleeping == {"weights", "kv_cache"} and rank1.llm.calls[-1] == ("sleep", 2)


def test_cuda_under_ray_without_a_gpu_per_rank_is_refused():
    from graft_rl.engine.config import load_config
    from graft_rl.engine.distributed import ResourceError, check_cluster

    pols = [{"name": n, "model": "x", "device": "cuda"} for n in ("A", "B")]
    cfg = load_config({"execution": "ray", "ray": {"num_cpus": 1}, "policies": pols})
    with pytest.raises(
        ResourceError, match=r"policy 'A': device cuda under execution: ray needs a GPU .*ray.num_gpus=1"
    ):
        check_cluster(cfg, cfg.policies, nodes=[{"CPU": 8.0, "GPU": 2.0}])


def test_a_lora_engine_keeps_its_start_push_and_digests_what_it_pushes(fake_vllm, tiny_pair, monkeypatch):
    """Issue 53: a LoRA engine is pushed the merged weights at start and sleeps at level 1, so the first
    generation needs no second push (it slept at level 2 and pushed again before); the pinned host cache
    of the level-1 backups is emptied at the first level-2 sleep; each push digests the merged tensors it
    streams (each made once), and a tensor changed after its digest is still refused."""
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    from graft_rl.policy import Policy, PolicyConfig
    from graft_rl.policy import vllm_backend as vb
    from graft_rl.policy.lora import MergedState

    emptied, made = [], []
    monkeypatch.setattr(vb, "_empty_host_cache", lambda: emptied.append(True))
    real_get = MergedState.__getitem__
    monkeypatch.setattr(MergedState, "__getitem__", lambda self, n: (made.append(n), real_get(self, n))[1])
    cfg = PolicyConfig("A", str(tiny_pair[0]), backend="vllm", vllm_kwargs={"sleep": True}, lora={"r": 4, "alpha": 8})
    pol = Policy(cfg)
    calls = pol.backend.llm.calls
    assert [c[0] for c in calls if c[0] in ("reload", "sleep")] == ["reload", "sleep"] and calls[-1] == ("sleep", 1)
    assert len(made) == len(set(made)) > 0  # the start push: each merged tensor made once, digest included
    prompts, sp = [("p1", "1+1=?")], SamplingParams(n=2, max_new_tokens=4)
    pol.generate(prompts, sp, seed=0)
    assert [c[0] for c in calls].count("reload") == 1  # the start push serves the first generation
    assert calls[-1] == ("sleep", 2) and emptied == [True]
    batch = pol.encode_texts(["Q"], ["1+1=2"], [True])
    pol.update(batch, lambda lp, mask, rows: (-(lp * mask).sum() / mask.sum(), {}))
    made.clear()
    pol.generate(prompts, sp, seed=1)
    assert [c[0] for c in calls].count("reload") == 2 and len(made) == len(set(made)) > 0
    assert emptied == [True]  # once: no level-1 sleep since
    stream = pol.backend.weights_fn

    def corrupt(*a):  # a fault that enters after each tensor's digest
        for n, t in stream(*a):
            yield n, (t + 1 if n.endswith("q_proj.weight") else t)

    pol.backend.weights_fn = corrupt
    try:
        with pytest.raises(vb.VLLMEngineError, match="after the push are not the trainer's"):
            pol.backend.sync_weights()
    finally:
        pol.close()
