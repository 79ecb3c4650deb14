"""Resources fail fast (issue 21): a config the Ray cluster can never place stops before anything is
placed, in one line naming what is missing and the override that fits; errors raised inside an actor
reach the driver as one line naming the policy and rank."""

from __future__ import annotations

import time

import pytest

from graft_rl.engine.config import load_config
from graft_rl.engine.distributed import ResourceError, check_cluster, policy_bundles


def _cfg(num_cpus=8.0, num_gpus=1.0, world=2, resources=None, device="cuda"):
    pols = [{"name": n, "model": "x", "device": device, "world_size": world} for n in ("A", "B")]
    return load_config(
        {
            "execution": "ray",
            "ray": {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources or {}},
            "policies": pols,
        }
    )


def test_too_few_cpus_names_the_override_that_fits():
    cfg = _cfg()  # the paper preset's 8 CPUs per rank, 4 ranks, on a 4-GPU node with 16 CPUs
    with pytest.raises(ResourceError) as err:
        check_cluster(cfg, cfg.policies, nodes=[{"CPU": 16.0, "GPU": 4.0}])
    msg = str(err.value)
    assert "32 CPU" in msg and "has 16" in msg and "ray.num_cpus=4" in msg and "\n" not in msg
    fits = _cfg(num_cpus=4)
    check_cluster(fits, fits.policies, nodes=[{"CPU": 16.0, "GPU": 4.0}])


def test_too_few_gpus_and_a_bundle_no_node_holds():
    cfg = _cfg()
    with pytest.raises(ResourceError, match=r"4 GPU in all.*has 2.*world_size"):
        check_cluster(cfg, cfg.policies, nodes=[{"CPU": 64.0, "GPU": 2.0}])
    one = _cfg(num_cpus=32, world=1)
    with pytest.raises(
        ResourceError, match=r"no node .* can hold one rank's bundle \{CPU: 32, GPU: 1\}.*ray.num_cpus=16"
    ):
        check_cluster(one, one.policies, nodes=[{"CPU": 16.0, "GPU": 2.0}] * 4)


def test_unknown_custom_resource_is_named():
    cfg = _cfg(resources={"A": {"resources": {"node_a": 1}}})
    with pytest.raises(ResourceError, match=r"policy 'A' asks for custom resource 'node_a'.*ray start --resources"):
        check_cluster(cfg, cfg.policies, nodes=[{"CPU": 64.0, "GPU": 8.0}])


def test_custom_resources_are_the_policys_total_split_over_its_ranks():
    """The README's two-node recipe: {node_a: 1} pins both ranks of A to node_a (0.5 each)."""
    cfg = _cfg(num_cpus=0.5, resources={"A": {"resources": {"node_a": 1}}, "B": {"resources": {"node_b": 1}}})
    assert policy_bundles(cfg, cfg.policies[0]) == [{"CPU": 0.5, "GPU": 1.0, "node_a": 0.5}] * 2
    check_cluster(
        cfg, cfg.policies, nodes=[{"CPU": 8.0, "GPU": 2.0, "node_a": 1.0}, {"CPU": 8.0, "GPU": 2.0, "node_b": 1.0}]
    )


def test_a_pinned_policys_ranks_must_fit_the_nodes_that_hold_its_resource():
    """Two nodes of 2 CPUs; B (world 2, 2 CPUs a rank) pinned to node_b: its two ranks fit no node_b."""
    nodes = [{"CPU": 2.0, "node_a": 1.0}, {"CPU": 2.0, "node_b": 1.0}]
    cfg = _cfg(num_cpus=2, num_gpus=0, resources={"B": {"resources": {"node_b": 1}}}, device="cpu")
    with pytest.raises(ResourceError) as err:
        check_cluster(cfg, cfg.policies[1:], nodes=nodes)
    msg = str(err.value)
    assert "policy 'B'" in msg and "node_b" in msg and "hold only 1 of them" in msg and "ray.num_cpus=1" in msg
    fits = _cfg(num_cpus=1, num_gpus=0, resources={"B": {"resources": {"node_b": 1}}}, device="cpu")
    check_cluster(fits, fits.policies[1:], nodes=nodes)


def test_eval_replicas_fit_the_nodes_a_policy_is_pinned_to():
    from graft_rl.engine.distributed import fit_replicas

    nodes = [{"CPU": 2.0, "node_a": 1.0}, {"CPU": 2.0, "node_b": 1.0}]
    cfg = _cfg(num_cpus=1, num_gpus=0, world=1, resources={"A": {"resources": {"node_a": 1}}}, device="cpu")
    # 3 replicas (the run's 3 devices) of A, pinned to node_a's 2 CPUs: they share them
    assert fit_replicas(cfg, cfg.policies[0], 3, nodes) == (3, 0.6666)
    assert fit_replicas(cfg, cfg.policies[1], 3, nodes) == (3, 1.0)  # B is pinned nowhere: 4 CPUs
    gpu = _cfg(num_cpus=1, num_gpus=1, world=1, resources={"A": {"resources": {"node_a": 1}}})
    nodes = [{"CPU": 8.0, "GPU": 1.0, "node_a": 1.0}, {"CPU": 8.0, "GPU": 2.0, "node_b": 1.0}]
    assert fit_replicas(gpu, gpu.policies[0], 3, nodes) == (1, 1.0)  # one GPU where A may run: one replica
    assert fit_replicas(gpu, gpu.policies[1], 3, nodes) == (3, 1.0)


@pytest.mark.slow
def test_misfit_fails_in_seconds_with_one_line(make_cfg, ray_local, tiny_pair, capsys, tmp_path):
    """8 CPUs per rank on a 2-CPU Ray cluster: one line from `graft train`, no 600 s wait."""
    import yaml

    from graft_rl.commands.cli import main

    cfg = make_cfg(
        {"name": "graft"},
        execution="ray",
        ray={"num_cpus": 8},
        policies=[
            {"name": "A", "model": str(tiny_pair[0]), "world_size": 2},
            {"name": "B", "model": str(tiny_pair[1])},
        ],
    )
    from graft_rl.engine.config import to_dict

    path = tmp_path / "misfit.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    t0 = time.perf_counter()
    rc = main(["train", str(path), "--no-progress"])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert rc == 2 and took < 10, (rc, took)
    assert err.count("\n") == 0 and "24 CPU" in err and "ray.num_cpus=0.6666" in err, err


@pytest.mark.slow
def test_error_inside_an_actor_is_one_line_naming_policy_and_rank(make_cfg, ray_local, tiny_pair):
    from graft_rl.engine.distributed import ActorError
    from graft_rl.engine.trainer import Trainer
    from graft_rl.policy import PolicyError

    # a rank whose model cannot be found: graft-rl's own error class, naming the policy
    bad = make_cfg(
        {"name": "graft"},
        run="bad",
        execution="ray",
        ray={"num_cpus": 0.5},
        policies=[
            {"name": "A", "model": str(tiny_pair[0]) + "-missing", "world_size": 2},
            {"name": "B", "model": str(tiny_pair[1])},
        ],
    )
    with pytest.raises(PolicyError, match=r"^policy 'A'.*does not exist") as err:
        Trainer(bad, show_progress=False)
    assert "\n" not in str(err.value)
    # a rollout engine that cannot be built inside the actor (vLLM missing, or failing to start)
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here: its engine would build")
    except ImportError:
        pass
    eng = make_cfg(
        {"name": "graft"},
        run="eng",
        execution="ray",
        ray={"num_cpus": 0.5},
        policies=[
            {"name": "A", "model": str(tiny_pair[0])},
            {"name": "B", "model": str(tiny_pair[1]), "backend": "vllm", "world_size": 2},
        ],
    )
    with pytest.raises(
        ActorError, match=r"^policy 'B' rank [01]: ImportError: rollout backend 'vllm' needs vLLM"
    ) as err:
        Trainer(eng, show_progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rank_joins_its_process_group_with_the_configured_collective_timeout(monkeypatch, device):
    """Issue 22: ray.collective_timeout reaches torch.distributed (NCCL's default would abort a rank
    that waits 10 minutes for its peers' generation shares). Issue 32: a CUDA rank pins its Ray GPU
    first and passes it to NCCL as ``device_id``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import graft_rl.engine.distributed as distributed
    from graft_rl.engine.distributed import RankWorker
    from graft_rl.policy import PolicyConfig

    seen = {}

    class Joined(Exception):
        pass

    def fake_init(backend, **kw):
        seen.update(kw, backend=backend)
        raise Joined

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(distributed, "pin_actor_gpu", lambda name, rank: seen.setdefault("pinned", (name, rank)))
    with pytest.raises(Joined):
        RankWorker(1, 2).setup("127.0.0.1", 1234, (PolicyConfig("A", "m", world_size=2, device=device),), 5400.0)
    assert seen["timeout"] == timedelta(seconds=5400) and seen["rank"] == 1
    if device == "cuda":
        assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 0) and seen["pinned"] == ("A", 1)
    else:
        assert seen["backend"] == "gloo" and seen["device_id"] is None and "pinned" not in seen


def test_the_engine_wakes_one_memory_tag_at_a_time_after_emptying_the_cache(monkeypatch):
    """Issue 22: torch.cuda.empty_cache() before each wake_up (weights, then KV cache), as verl does."""
    import torch

    from graft_rl.policy.vllm_backend import VLLMBackend

    calls = []

    class FakeLLM:
        def wake_up(self, tags):
            calls.append(("wake", tuple(tags)))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    backend = object.__new__(VLLMBackend)
    backend.llm, backend.sleeping, backend.gpu = FakeLLM(), {"weights", "kv_cache"}, None
    backend._wake(("weights",))  # the weight push wakes the weights only
    backend._wake()
    assert calls == [("empty_cache",), ("wake", ("weights",)), ("empty_cache",), ("wake", ("kv_cache",))]
    assert backend.sleeping == set()


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("remembered", [True, False])
def test_killed_actors_are_gone_before_kill_actors_returns(ray_local, remembered):
    """Issue 32: ray.kill only asks (the process exits later); eval and preflight built new engines on
    the same GPUs right after it. kill_actors returns once each actor's process has exited (where its
    pid was recorded at start) or Ray reports it dead."""
    import os

    import ray

    from graft_rl.engine.distributed import _remember, kill_actors

    class Worker:
        def pid(self):
            return os.getpid()

    actors = [ray.remote(Worker).options(num_cpus=0).remote() for _ in range(2)]
    pids = ray.get([a.pid.remote() for a in actors])
    if remembered:
        _remember(actors)
        kill_actors(actors)
        assert not any(_alive(p) for p in pids)
    else:
        kill_actors(actors)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actors[0].pid.remote(), timeout=5)


def test_ray_address_null_starts_a_local_instance_whatever_a_stale_cluster_file_says(monkeypatch):
    """`ray.address: null` is a new local instance ("local"), not Ray's own None, which joins whatever
    /tmp/ray/ray_current_cluster names: a cluster killed without shutdown leaves that file, and every
    later run on the machine then failed joining a dead address. RAY_ADDRESS (ray job submit) still wins."""
    from graft_rl.engine.distributed import ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(None) == "local"
    assert ray_address("auto") == "auto" and ray_address("10.0.0.1:6379") == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_address(None) == "10.0.0.2:6379" and ray_address("auto") == "auto"
