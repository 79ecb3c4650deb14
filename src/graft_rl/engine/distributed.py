"""``execution: ray``: each policy a Ray actor, or a group of actors (docs/design.md, layer 5).

A policy with ``world_size: 1`` is one actor holding a :class:`~graft_rl.engine.worker.PolicyWorker`
(model, optimiser, rollout backend) on its own resources (``ray.num_cpus``/``num_gpus``, plus
per-policy options such as custom node resources). A policy with ``world_size: W > 1`` is an
:class:`ActorGroup`: ``W`` actors in a placement group (one bundle per rank, packed onto as few
nodes as possible), joined in one ``torch.distributed`` process group (NCCL on GPUs, gloo on
CPU), each running a :class:`~graft_rl.policy.fsdp.ShardedPolicy` (FSDP2). The driver calls a
method on every rank at once and takes rank 0's answer, so a group looks like one worker.

Resources (:func:`policy_bundles`): each rank asks for ``ray.num_cpus`` CPUs and ``ray.num_gpus``
GPUs; a policy's custom resources (``ray.resources: {NAME: {resources: {node_a: 1}}}``) are the
policy's *total*, split evenly over its ranks, so ``{node_a: 1}`` puts every rank of the policy on
the node started with ``--resources='{"node_a": 1}'``. Before anything is placed,
:func:`check_cluster` compares every bundle with the cluster's nodes and fails in one line naming
what is missing and the override that fits; a placement that fits but waits on busy resources
gives up after ``ray.placement_timeout`` seconds.

The driver only coordinates: it gathers groups (texts, token ids, generation log-probs),
verifies rewards, runs the exchange selection and sends each receiver its batch. Model weights
never cross the wire. Generation of all policies overlaps in time.

Run directories must be on a filesystem every node can write (checkpoints are written by
the actors). An actor that dies is reported with its policy name; resume with ``--resume``. An
error raised inside an actor (a model that does not load, a vLLM engine that cannot be built)
reaches the driver as one line naming the policy and rank (:class:`ActorError`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
import weakref
from typing import Any

__all__ = [
    "kill_actors",
    "start_actors",
    "start_replicas",
    "get",
    "completion_order",
    "check_cluster",
    "policy_bundles",
    "ActorError",
    "ActorDied",
    "ActorGroup",
    "RankWorker",
    "ResourceError",
]

#: Ray resources are counted to 1e-4; fractions are rounded down to this grid.
_GRID = 1e-4


class ActorError(RuntimeError):
    """An error raised inside a policy's actor, as one line naming the policy and rank."""


class ActorDied(ActorError):
    """A policy's actor died; the run can be resumed from its last checkpoint."""


class ResourceError(ActorError):
    """The Ray cluster cannot place what the config asks for; the message says what is missing."""


def _actor_options(cfg, pc) -> dict:
    """One policy's actor options: ``ray.num_cpus``/``num_gpus`` per rank, then the policy's own
    entry of ``ray.resources`` (which may override them and adds custom resources)."""
    opts = {"num_cpus": cfg.ray.num_cpus, "num_gpus": cfg.ray.num_gpus}
    opts.update(cfg.ray.resources.get(pc.name, {}))
    return opts


def policy_bundles(cfg, pc) -> list[dict]:
    """The resource bundle of each of the policy's ``world_size`` ranks (see the module docstring)."""
    opts = _actor_options(cfg, pc)
    W = pc.world_size
    bundle = {"CPU": float(opts.get("num_cpus") or 0)}
    if opts.get("num_gpus"):
        bundle["GPU"] = float(opts["num_gpus"])
    for key, val in (opts.get("resources") or {}).items():
        bundle[key] = math.floor(float(val) / W / _GRID) * _GRID if W > 1 else float(val)
    return [dict(bundle) for _ in range(W)]


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in res.items() if v) + "}"


def _check_gpu_share(cfg, pc) -> None:
    """A rank's GPU, in one line: cuda needs one; a vLLM rank on a fraction of one must leave the other
    process room, and only a one-rank policy may share (engines sharing a GPU take turns to start, sleep
    and wake: :func:`graft_rl.policy.vllm_backend.gpu_turn`)."""
    from graft_rl.policy.vllm_backend import VLLM_MEMORY_SHARE

    gpus = policy_bundles(cfg, pc)[0].get("GPU", 0.0)
    if pc.device.startswith("cuda") and gpus == 0:
        raise ResourceError(
            f"policy {pc.name!r}: device cuda under execution: ray needs a GPU per rank actor, and ray.num_gpus is 0 "
            f"(Ray would assign none); set ray.num_gpus=1"
        )
    share = float(pc.vllm_kwargs.get("gpu_memory_utilization", VLLM_MEMORY_SHARE))
    if pc.backend == "vllm" and 0 < gpus < 1 and share > gpus - 0.05:
        raise ResourceError(
            f"policy {pc.name!r}: a vLLM rank with ray.num_gpus={gpus:g} shares its GPU, and its engine asks for "
            f"gpu_memory_utilization={share:g} of it (vLLM refuses to start when another process holds that "
            f"much); set vllm_kwargs.gpu_memory_utilization at most {max(gpus - 0.1, 0.05):.2g}, or ray.num_gpus=1"
        )
    if pc.backend == "vllm" and 0 < gpus < 1 and pc.world_size > 1:
        raise ResourceError(
            f"policy {pc.name!r}: a vLLM policy with world_size={pc.world_size} on ray.num_gpus={gpus:g}: engines "
            f"sharing a GPU take turns to start, sleep and wake (vLLM measures the whole GPU around each), and a "
            f"sharded policy's engines start inside its collectives, where a turn could deadlock; set "
            f"ray.num_gpus=1 (a GPU per rank) or world_size=1"
        )


def check_cluster(cfg, policy_configs, nodes: list[dict] | None = None) -> None:
    """Fail fast, in one line, when the Ray cluster can never place the policies' bundles.

    ``nodes``: each alive node's total resources (default: from the running Ray cluster). Checks,
    per resource, the sum over every rank of every policy against the cluster, and each bundle
    against the largest node (a bundle never spans nodes); names the override that would fit.
    """
    for pc in policy_configs:
        _check_gpu_share(cfg, pc)
    if nodes is None:
        nodes = alive_nodes()
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + v
    need: dict[str, float] = {}
    ranks = 0
    _check_generators(cfg, policy_configs, nodes)
    for pc in policy_configs:
        bundles = policy_bundles(cfg, pc) + generator_bundles(cfg, pc)
        ranks += len(bundles)
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        for key in bundles[0]:
            if key not in ("CPU", "GPU") and bundles[0][key] > 0 and key not in total:
                kinds = ", ".join(
                    sorted(k for k in total if not k.startswith(("node:", "accelerator_type", "object_store")))
                )
                raise ResourceError(
                    f"policy {pc.name!r} asks for custom resource {key!r} (ray.resources.{pc.name}), which no node of the Ray "
                    f"cluster has (it has: {kinds}); start that node with ray start --resources='{{\"{key}\": 1}}'"
                )
    for key, want in need.items():  # the totals first: their hint fits every rank at once
        have = total.get(key, 0.0)
        if want > have + 1e-9:
            gens = sum(len(generator_bundles(cfg, pc)) for pc in policy_configs)
            per = f"{ranks} rank actors (sum of world_size" + (f", and {gens} generators)" if gens else ")")
            raise ResourceError(
                f"the policies need {want:g} {key} in all ({per} x their bundles), the Ray cluster has {have:g}; "
                f"{_fit_hint(cfg, {key: want / ranks}, {key: have}, ranks)}"
            )
    for pc in policy_configs:
        bundles = policy_bundles(cfg, pc)
        b = bundles[0]
        custom = [k for k, v in b.items() if k not in ("CPU", "GPU") and v > 0]
        held = [n for n in nodes if all(n.get(k, 0.0) > 0 for k in custom)]  # the nodes it is pinned to
        fits = sum(bundles_that_fit(n, b) for n in held)
        if custom and 0 < fits < len(bundles):
            raise ResourceError(
                f"policy {pc.name!r}: its {len(bundles)} rank bundles {_fmt(b)} must sit on the node(s) with "
                f"{', '.join(custom)}, which hold only {fits} of them ({' + '.join(_fmt(n_sub(n, b)) for n in held)}); "
                f"{_fit_hint(cfg, b, _summed(held), len(bundles))}"
            )
        if not any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for n in nodes):
            biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)))
            raise ResourceError(
                f"policy {pc.name!r}: no node of the Ray cluster can hold one rank's bundle {_fmt(b)} (largest node: "
                f"{_fmt({k: biggest.get(k, 0) for k in b})}); {_fit_hint(cfg, b, biggest, 1)}"
            )


def generator_bundles(cfg, pc) -> list[dict]:
    """One step off (``rollout.mode: one_step_off``): the bundle of each of the policy's generator replicas
    (none for anything else, ``graft eval``'s replica settings included)."""
    if getattr(getattr(cfg, "rollout", None), "mode", None) != "one_step_off":
        return []
    return [generator_bundle(cfg, pc) for _ in range(cfg.rollout.generators.of(pc.name).replicas)]


def generator_bundle(cfg, pc) -> dict:
    """One generator replica's Ray bundle: ``rollout.generators`` (per policy) over ``ray.num_cpus`` /
    ``ray.num_gpus``; its custom resources are ``rollout.generators.resources`` (the node it is pinned to)."""
    g = cfg.rollout.generators.of(pc.name)
    rank = _actor_options(cfg, pc)  # the policy's own rank options (ray.resources.NAME over ray.*)
    bundle = {"CPU": float(rank.get("num_cpus") or 0 if g.num_cpus is None else g.num_cpus)}
    gpus = rank.get("num_gpus") or 0 if g.num_gpus is None else g.num_gpus
    if gpus:
        bundle["GPU"] = float(gpus)
    bundle.update({k: float(v) for k, v in (g.resources or {}).items()})
    return bundle


def generator_threads(cfg, pc) -> int:
    g = cfg.rollout.generators.of(pc.name)
    return g.torch_threads or cfg.ray.torch_threads or max(1, int(generator_bundle(cfg, pc)["CPU"]))


def _check_generators(cfg, policy_configs, nodes: list[dict]) -> None:
    """Each policy's generator replicas fit a node (custom resources: one of the nodes that has them)."""
    for pc in policy_configs:
        for b in generator_bundles(cfg, pc)[:1]:
            if not any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for n in nodes):
                custom = [k for k in b if k not in ("CPU", "GPU")]
                where = f" (rollout.generators.resources: {', '.join(custom)})" if custom else ""
                raise ResourceError(
                    f"policy {pc.name!r}: no node of the Ray cluster can hold one generator's bundle {_fmt(b)}{where}; "
                    "lower rollout.generators.num_cpus / num_gpus, or start a node that has them"
                )


def bundles_that_fit(node: dict, bundle: dict) -> int:
    """How many copies of ``bundle`` one node's total resources hold."""
    need = {k: v for k, v in bundle.items() if v > 0}
    if not need:
        return 1 << 30
    return min(int((node.get(k, 0.0) + 1e-9) // v) for k, v in need.items())


def n_sub(node: dict, bundle: dict) -> dict:
    """``node``'s totals of the resources ``bundle`` asks for."""
    return {k: node.get(k, 0.0) for k in bundle}


def _summed(nodes: list[dict]) -> dict:
    out: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            out[k] = out.get(k, 0.0) + v
    return out


def alive_nodes() -> list[dict]:
    """Each alive node's total resources, from the running Ray cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def short_resource(bundle: dict) -> str:
    """What keeps ``bundle`` from being placed now: the resources no alive node has free enough of."""
    import ray

    free = ray.available_resources()
    short = [
        f"{k} (needs {v:g}, {free.get(k, 0.0):g} free in the cluster)"
        for k, v in bundle.items()
        if v > free.get(k, 0.0) + 1e-9
    ]
    return ", ".join(short) if short else f"no single node has {_fmt(bundle)} free at once"


def place(bundles: list[dict], name: str, timeout: float, strategy: str = "PACK"):
    """A placement group of ``bundles``, ready within ``timeout`` seconds (``ray.placement_timeout``), or one
    :class:`ResourceError` line naming the resource that is short; every actor is started in one."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ResourceError(
            f"{name}: the Ray cluster did not place {len(bundles)} x {_fmt(bundles[0])} within {timeout:g} s "
            f"(ray.placement_timeout); short: {short_resource(bundles[0])} (ray status shows what is free)"
        ) from None
    return pg


def _fit_hint(cfg, bundle: dict, have: dict, ranks: int) -> str:
    """The override that makes ``ranks`` bundles fit ``have``, for the resource that is short (never a
    shared GPU when a policy rolls out with vLLM: its rank needs the whole device)."""
    for key, what in (("GPU", "ray.num_gpus"), ("CPU", "ray.num_cpus")):
        if bundle.get(key, 0) > have.get(key, 0) / ranks + 1e-9:
            if key == "GPU":
                share = math.floor(have.get(key, 0) / ranks / _GRID) * _GRID
                vllm = any(pc.backend == "vllm" for pc in cfg.policies)
                return f"lower policies.N.world_size (each rank takes {bundle[key]:g} GPU) or add GPUs" + (
                    ""
                    if share <= 0
                    else f" ({what}={share:g} would share them"
                    + (", each vLLM engine's gpu_memory_utilization below it)" if vllm else ")")
                )
            fit = math.floor(have.get(key, 0) / ranks / _GRID) * _GRID
            return (
                f"set {what}={fit:g} (fits {ranks} rank actors on {have.get(key, 0):g} CPUs)" if fit > 0 else "add CPUs"
            )
    return "lower the custom resource or add a node that has it"


_NAMES: dict = {}
_PLACED: dict = {}  # actor id -> the release (a weakref.finalize) of a one-rank actor's own placement group
_WHERE: dict = {}  # actor id -> (node id, pid), recorded at start: kill_actors waits for that process


def _where(_actor) -> tuple[str, int]:
    """Run inside an actor (``__ray_call__``): its node and process."""
    import ray

    return ray.get_runtime_context().get_node_id(), os.getpid()


def _remember(actors: list) -> None:
    """Record each started actor's node and pid (one round trip), for :func:`kill_actors`."""
    import ray

    for a, where in zip(actors, ray.get([a.__ray_call__.remote(_where) for a in actors]), strict=True):
        _WHERE[a._actor_id.hex()] = where


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # exited but not yet reaped by its raylet: its memory (GPU included) is released
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:
        return False


def _actor_dead(actor) -> bool:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        ray.get(actor.__ray_ready__.remote(), timeout=1.0)
    except RayActorError:
        return True
    except GetTimeoutError:
        return False
    return False


def kill_actors(actors: list, timeout: float = 60.0) -> None:
    """``ray.kill`` each actor and wait until it is gone: its process has exited where it ran on this
    node (else Ray reports it dead). ``ray.kill`` only asks; an engine built next on the same GPUs
    before the old process exits would find its memory still held. Waits ``timeout`` seconds at most."""
    import ray

    for a in actors:
        ray.kill(a)
    here = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout
    for a in actors:
        node, pid = _WHERE.pop(a._actor_id.hex(), (None, None))
        local = pid is not None and node == here
        while time.monotonic() < deadline and not (_process_gone(pid) if local else _actor_dead(a)):
            time.sleep(0.05)
        release = _PLACED.pop(a._actor_id.hex(), None)
        if release is not None:  # a one-rank actor's own placement group: its reservation goes with it
            release()


def ray_address(address: str | None) -> str:
    """What ``ray.address`` means to ``ray.init``. ``None`` starts a new local instance
    (``"local"``): Ray's own ``None`` would join whatever ``/tmp/ray/ray_current_cluster`` names, and
    a cluster killed without shutdown leaves that file behind, so every later run would try to join a
    dead address. ``RAY_ADDRESS`` (set by ``ray job submit``) still wins over ``None``."""
    if address is not None:
        return address
    return os.environ.get("RAY_ADDRESS") or "local"


def init_ray(address: str | None, **kw) -> None:
    """``ray.init`` (no dashboard) at :func:`ray_address`; a local instance this process starts is
    watched by :mod:`graft_rl.engine.reaper`, so a SIGKILL of this process leaves none of its processes."""
    import ray

    if ray.is_initialized():
        return
    address = ray_address(address)
    kw = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True, **kw}
    import signal
    import threading

    handler = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, **kw)
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)  # ray.init installs sys.exit on SIGTERM; keep the command's own
    if address == "local":
        from graft_rl.engine import reaper

        reaper.watch()


def start_actors(cfg, policy_configs) -> dict:
    """Start every policy's actor (``world_size`` 1) or actor group, after :func:`check_cluster`."""
    import ray

    from graft_rl.engine.provenance import run_plugins
    from graft_rl.methods.registry import plugin_sources

    init_ray(cfg.ray.address, log_to_driver=True)
    check_cluster(cfg, policy_configs)
    remote_cls = ray.remote(pinned_worker_class())
    # a user's parts reach every actor as the driver read them: a file plugin travels as its source, so
    # a node without the file (or with another copy) imports the driver's; a module must be importable there
    plugins = plugin_sources(run_plugins(cfg))
    actors = {}
    for pc in policy_configs:
        opts = {**_actor_options(cfg, pc), "max_restarts": 0}
        threads = cfg.ray.torch_threads or max(1, int(cfg.ray.num_cpus))
        worker_args = (pc, cfg.method, cfg.minibatch, cfg.nonfinite_loss, threads, plugins)
        if pc.world_size > 1:
            actors[pc.name] = ActorGroup.start(
                pc.name,
                policy_bundles(cfg, pc),
                opts,
                worker_args,
                cfg.ray.placement_timeout,
                cfg.ray.collective_timeout,
            )
            for r, a in enumerate(actors[pc.name].actors):
                _NAMES[a._actor_id.hex()] = (pc.name, r)
            continue
        actor = _start_placed(
            remote_cls, policy_bundles(cfg, pc)[0], opts, worker_args, pc.name, cfg.ray.placement_timeout
        )
        actors[pc.name] = actor
        _NAMES[actor._actor_id.hex()] = (pc.name, None)
    # fail early (with the policy's name) if an actor cannot build its model (groups were checked in start)
    for name, actor in actors.items():
        if not isinstance(actor, ActorGroup):
            get(actor.name.remote(), name)
    _remember([a for a in actors.values() if not isinstance(a, ActorGroup)])
    return actors


def _start_placed(remote_cls, bundle: dict, opts: dict, args: tuple, name: str, timeout: float):
    """One actor in a placement group of its own bundle: if the cluster cannot place it within
    ``timeout`` seconds, one :class:`ResourceError` line naming what is short (a plain actor would wait
    for ever). The group is removed when :func:`kill_actors` kills the actor."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = place([bundle], f"policy {name!r}", timeout)
    extra = {k: v for k, v in opts.items() if k not in ("num_cpus", "num_gpus", "resources") and v is not None}
    actor = remote_cls.options(
        num_cpus=bundle["CPU"],
        num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        **extra,
    ).remote(*args)
    # the group goes with the actor however it ends: kill_actors, or its last handle dropped (as a plain
    # actor's resources would); a weakref finalizer runs once
    _PLACED[actor._actor_id.hex()] = weakref.finalize(actor, _remove_group, pg)
    return actor


def _remove_group(pg) -> None:
    import ray

    if not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):  # already removed, or the cluster is going down
        remove_placement_group(pg)


def fit_replicas(cfg, pc, replicas: int, nodes: list[dict] | None = None) -> tuple[int, float]:
    """``(replicas, CPUs each)`` that the nodes a policy is pinned to hold (``ray.resources``' custom
    resources; every node when it has none): on CPUs the replicas share those nodes' cores, the most
    per replica that still places every one (at most ``ray.num_cpus``); replicas that cannot be placed
    at all (too few GPUs there) are dropped. ``graft eval`` says so when it runs fewer."""
    nodes = alive_nodes() if nodes is None else nodes
    rank = policy_bundles(cfg, pc)[0]
    custom = [k for k, v in rank.items() if k not in ("CPU", "GPU") and v > 0]
    held = [n for n in nodes if all(n.get(k, 0.0) > 0 for k in custom)] or nodes
    gpus = rank.get("GPU", 0.0)
    if gpus:
        fit = sum(int((n.get("GPU", 0.0) + 1e-9) // gpus) for n in held)
        return max(1, min(replicas, fit)), float(rank["CPU"])
    cpus = [n.get("CPU", 0.0) for n in held]
    # the largest share c <= num_cpus with sum_n floor(cpu_n / c) >= replicas: one of cpu_n / k
    best = 0.0
    for c in sorted({min(rank["CPU"], cpu / k) for cpu in cpus for k in range(1, replicas + 1)}, reverse=True):
        c = round(math.floor(c / _GRID) * _GRID, 4)
        if c > 0 and sum(int((cpu + 1e-9) // c) for cpu in cpus) >= replicas:
            best = c
            break
    if best == 0.0:  # not even a grid step each: as many replicas as hold the smallest share
        return max(1, min(replicas, int(sum(cpus) // max(rank["CPU"], _GRID)))), float(rank["CPU"])
    return replicas, best


def start_replicas(cfg, pc, replicas: int) -> list:
    """``replicas`` independent one-rank actors of one policy, each on one rank's resources (``graft
    eval`` over a run's devices: data parallel, each with its own model and rollout engine), each placed
    within ``ray.placement_timeout`` or one line naming what is short. Fit them first (:func:`fit_replicas`)."""
    from dataclasses import replace

    import ray

    init_ray(cfg.ray.address)
    spread = replace(pc, world_size=replicas)
    check_cluster(cfg, [spread])
    opts = {**_actor_options(cfg, pc), "max_restarts": 0}
    threads = cfg.ray.torch_threads or max(1, int(cfg.ray.num_cpus))
    remote_cls = ray.remote(pinned_worker_class())
    actors: list = []
    try:
        for r, b in enumerate(policy_bundles(cfg, spread)):
            args = (replace(pc, world_size=1), None, 1, "skip", threads)  # an evaluator: no method, no KL reference
            actors.append(_start_placed(remote_cls, b, opts, args, pc.name, cfg.ray.placement_timeout))
            _NAMES[actors[-1]._actor_id.hex()] = (pc.name, r)
        get(GroupRef([a.name.remote() for a in actors], pc.name))
    except BaseException:
        kill_actors(actors)
        raise
    _remember(actors)
    return actors


def pin_actor_gpu(name: str, rank: int | None = None) -> None:
    """Make this actor's one Ray-assigned GPU the only visible CUDA device (device 0, which torch, NCCL
    and vLLM's single in-process worker all use). Ray sets ``CUDA_VISIBLE_DEVICES`` to the assigned GPU
    unless ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is set, when every rank would otherwise land
    on GPU 0; then it is set here, from ``ray.get_gpu_ids()``, before CUDA starts. One line when the
    actor has not exactly one GPU."""
    import ray
    import torch

    who = f"policy {name!r}" + (f" rank {rank}" if rank is not None else "")
    ids = [str(i) for i in ray.get_gpu_ids()]
    if len(ids) != 1:
        raise ActorError(f"{who}: a rank actor needs exactly one GPU, Ray assigned it {len(ids)} (ray.num_gpus=1)")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible != ids:
        if torch.cuda.is_initialized():
            raise ActorError(
                f"{who}: CUDA started before its GPU ({ids[0]}) was pinned; this is a bug, please report it"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[0]
    if torch.cuda.device_count() != 1:
        raise ActorError(f"{who}: sees {torch.cuda.device_count()} CUDA devices after pinning GPU {ids[0]}; expected 1")
    torch.cuda.set_device(0)


def pinned_worker_class():
    """What a one-rank policy actor runs: a ``PolicyWorker`` whose GPU is pinned first (:func:`pin_actor_gpu`)."""
    from graft_rl.engine.worker import PolicyWorker

    class PinnedPolicyWorker(PolicyWorker):
        def __init__(self, policy, *args, **kwargs):
            if str(getattr(policy, "device", "")).startswith("cuda"):
                pin_actor_gpu(policy.name)
            super().__init__(policy, *args, **kwargs)

    PinnedPolicyWorker.__qualname__ = PinnedPolicyWorker.__name__ = "PolicyWorker"  # as Ray names the actor
    return PinnedPolicyWorker


class RankWorker:
    """One rank of a sharded policy: joins the process group, then holds a ``PolicyWorker``."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.worker: Any = None  # the PolicyWorker, once setup() ran

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, addr: str, port: int, worker_args: tuple, timeout: float = 3600.0) -> None:
        """Join the policy's process group (``timeout``: seconds a collective may wait, ``ray.collective_timeout``)."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from graft_rl.engine.worker import PolicyWorker

        pc = worker_args[0]
        cuda = pc.device.startswith("cuda")
        if cuda:
            pin_actor_gpu(pc.name, self.rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=timeout),
            device_id=torch.device("cuda", 0) if cuda else None,  # NCCL's communicator binds this rank's GPU
        )
        self.worker = PolicyWorker(*worker_args)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class _GroupMethod:
    def __init__(self, group: ActorGroup, method: str):
        self.group, self.method = group, method

    def remote(self, *args) -> GroupRef:
        return GroupRef([a.call.remote(self.method, *args) for a in self.group.actors], self.group.policy)


class GroupRef(list):
    """The futures of one call on every rank of a group; :func:`get` returns rank 0's result."""

    def __init__(self, refs, name: str):
        super().__init__(refs)
        self.name = name


class ActorGroup:
    """The ``W`` rank actors of one sharded policy, called like a single ``PolicyWorker`` actor."""

    def __init__(self, policy: str, actors: list, placement_group):
        self.policy, self.actors, self.placement_group = policy, actors, placement_group

    @classmethod
    def start(
        cls,
        name: str,
        bundles: list[dict],
        opts: dict,
        worker_args: tuple,
        timeout: float = 120.0,
        collective_timeout: float = 3600.0,
    ) -> ActorGroup:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = len(bundles)
        pg = place(bundles, f"policy {name!r}", timeout)
        extra = {
            k: v for k, v in opts.items() if k not in ("num_cpus", "num_gpus", "resources", "name") and v is not None
        }
        remote_cls = ray.remote(RankWorker)
        actors: list[Any] = [
            remote_cls.options(
                num_cpus=bundles[r]["CPU"],
                num_gpus=bundles[r].get("GPU", 0),
                resources={k: v for k, v in bundles[r].items() if k not in ("CPU", "GPU")} or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
                **extra,
            ).remote(r, world)
            for r in range(world)
        ]
        group = cls(name, actors, pg)
        try:
            addr, port = get(actors[0].address.remote(), name)
            get(GroupRef([a.setup.remote(addr, port, worker_args, collective_timeout) for a in actors], name))
            _remember(actors)
        except BaseException:
            group.shutdown()
            raise
        return group

    def shutdown(self) -> None:
        """Kill the ranks (waiting until they are gone) and release the placement group's reserved resources."""
        from ray.util.placement_group import remove_placement_group

        kill_actors(self.actors)
        remove_placement_group(self.placement_group)
        self.actors = []

    def __getattr__(self, method: str) -> _GroupMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _GroupMethod(self, method)


def completion_order(handles: dict):
    """Yield the names of ``handles`` (an actor call's future, or a group's :class:`GroupRef`) as
    their calls finish (a group's when every rank's has); a failed call counts as finished
    (:func:`get` raises its error)."""
    import ray

    left = {name: list(h) if isinstance(h, GroupRef) else [h] for name, h in handles.items()}
    while left:
        refs = [r for rs in left.values() for r in rs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not any(all(r in ready for r in rs) for rs in left.values()):
            ray.wait(refs, num_returns=min(len(refs), len(ready) + 1))  # block until one more call is done
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for name in [n for n, rs in left.items() if all(r in ready for r in rs)]:
            del left[name]
            yield name


def get(ref, name: str | None = None):
    """``ray.get`` that names the policy (and rank) whose actor failed; a group's call returns rank 0's
    result. An error raised inside an actor comes back as one line: re-raised as its own class when
    that is one of graft-rl's input errors (a bad model path: ``PolicyError``), else as
    :class:`ActorError`; a dead actor as :class:`ActorDied`."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    refs = list(ref) if isinstance(ref, GroupRef) else [ref]
    name = name or getattr(ref, "name", None)
    pending, current = list(refs), refs[0]
    try:
        while pending:  # fail on the first rank that fails (the others may wait in a collective)
            ready, pending = ray.wait(pending, num_returns=1)
            current = ready[0]
            ray.get(current)
        return ray.get(refs[0])
    except RayActorError as exc:
        who, rank = _who(exc, name, refs, current)
        if getattr(exc, "actor_init_failed", False):
            raise _one_line(who, rank, _cause_from_text(str(exc))) from None
        raise ActorDied(
            f"the Ray actor of policy {who!r}{_rank(rank)} died ({type(exc).__name__}); resume the run with "
            f"`graft train --resume RUN_DIR`"
        ) from exc
    except RayTaskError as exc:
        who, rank = _who(exc, name, refs, current)
        cause = exc.cause if getattr(exc, "cause", None) is not None else _cause_from_text(str(exc))
        raise _one_line(who, rank, cause) from None


def _rank(rank) -> str:
    return f" rank {rank}" if rank is not None else ""


def _who(exc, name, refs, current) -> tuple[str, int | None]:
    rank = refs.index(current) if len(refs) > 1 and current in refs else None
    actor = getattr(exc, "actor_id", None)
    known = _NAMES.get(actor.hex() if actor is not None and hasattr(actor, "hex") else actor or "")
    if known:
        return (name or known[0]), (rank if rank is not None else known[1])
    return name or "?", rank


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\w*): (.*)$")


def _cause_from_text(text: str) -> BaseException:
    """The exception a creation-task traceback ends with (``ValueError: message``), rebuilt."""
    lines = text.splitlines()
    for line in reversed(lines):  # the last one: with chained exceptions, the one that was raised
        m = _ERROR_LINE.match(line.strip())
        if m and not line.startswith(" "):
            return ActorError(f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}")
    return ActorError(lines[-1] if lines else "unknown error")


def _one_line(who: str, rank, cause: BaseException) -> BaseException:
    from graft_rl.engine.config import ConfigError
    from graft_rl.policy import PolicyError

    text = str(cause).strip().splitlines()
    first = text[0] if text else ""
    own = f"policy {who!r}: "
    if first.startswith(own):  # graft-rl's errors name the policy already: add the rank
        first = first[len(own) :]
    if isinstance(cause, (PolicyError, ConfigError, FloatingPointError, OSError)):
        try:
            return type(cause)(f"policy {who!r}{_rank(rank)}: {first}")
        except Exception:  # an exception class with a different constructor
            pass
    if isinstance(cause, ActorError):  # rebuilt from a traceback's last line: already "Type: message"
        return ActorError(f"policy {who!r}{_rank(rank)}: {first}")
    return ActorError(f"policy {who!r}{_rank(rank)}: {type(cause).__name__}: {first}")
