"""``execution: ray``: each policy a Ray actor, or a group of actors (SPEC §4 layer 5, "Execution").

A policy with ``world_size: 1`` is one actor holding a :class:`~graft_rl.worker.PolicyWorker`
(model, optimiser, rollout backend) on its own resources (``ray.num_cpus``/``num_gpus``, plus
per-policy options such as custom node resources). A policy with ``world_size: W > 1`` is an
:class:`ActorGroup`: ``W`` actors in a placement group (one bundle per rank, packed onto as few
nodes as possible), joined in one ``torch.distributed`` process group (NCCL on GPUs, gloo on
CPU), each running a :class:`~graft_rl.policy.fsdp.ShardedPolicy` (FSDP2). The driver calls a
method on every rank at once and takes rank 0's answer, so a group looks like one worker.

The driver only coordinates: it gathers groups (texts, token ids, generation log-probs),
verifies rewards, runs the exchange selection and sends each receiver its batch. Model weights
never cross the wire. Generation of all policies overlaps in time.

Run directories must be on a filesystem every node can write (checkpoints are written by
the actors). An actor that dies is reported with its policy name; resume with ``--resume``.
"""

from __future__ import annotations

__all__ = ["start_actors", "get", "ActorDied", "ActorGroup", "RankWorker"]


class ActorDied(RuntimeError):
    """A policy's actor died; the run can be resumed from its last checkpoint."""


_NAMES: dict = {}


def start_actors(cfg, policy_configs) -> dict:
    import ray

    from graft_rl.worker import PolicyWorker

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
    need = sum((cfg.ray.num_gpus or 0) * pc.world_size for pc in policy_configs)
    have = ray.cluster_resources().get("GPU", 0)
    if need > have:
        raise ActorDied(f"the policies need {need:g} GPUs (ray.num_gpus x world_size), the Ray cluster has {have:g}")
    remote_cls = ray.remote(PolicyWorker)
    actors = {}
    for pc in policy_configs:
        opts = {"num_cpus": cfg.ray.num_cpus, "num_gpus": cfg.ray.num_gpus, "name": None, "max_restarts": 0}
        opts.update(cfg.ray.resources.get(pc.name, {}))
        threads = cfg.ray.torch_threads or max(1, int(cfg.ray.num_cpus))
        worker_args = (pc, cfg.method, cfg.minibatch, cfg.nonfinite_loss, None, None, threads)
        if pc.world_size > 1:
            actors[pc.name] = ActorGroup.start(pc.name, pc.world_size, opts, worker_args)
            for a in actors[pc.name].actors:
                _NAMES[a._actor_id.hex()] = pc.name
            continue
        actor = remote_cls.options(**{k: v for k, v in opts.items() if v is not None}).remote(*worker_args)
        actors[pc.name] = actor
        _NAMES[actor._actor_id.hex()] = pc.name
    # fail early (with the policy's name) if an actor cannot build its model (groups were checked in start)
    for name, actor in actors.items():
        if not isinstance(actor, ActorGroup):
            get(actor.name.remote(), name)
    return actors


class RankWorker:
    """One rank of a sharded policy: joins the process group, then holds a ``PolicyWorker``."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.worker = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, addr: str, port: int, worker_args: tuple) -> None:
        import torch
        import torch.distributed as dist

        from graft_rl.worker import PolicyWorker

        pc = worker_args[0]
        if pc.device.startswith("cuda"):
            torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
        backend = "nccl" if pc.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world)
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
    def start(cls, name: str, world: int, opts: dict, worker_args: tuple) -> ActorGroup:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": float(opts.get("num_cpus") or 0)}
        if opts.get("num_gpus"):
            bundle["GPU"] = float(opts["num_gpus"])
        bundle.update(opts.get("resources") or {})
        pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise ActorDied(f"policy {name!r}: the cluster cannot place {world} x {bundle} for world_size={world}") from None
        extra = {k: v for k, v in opts.items() if k not in ("num_cpus", "num_gpus", "resources", "name") and v is not None}
        remote_cls = ray.remote(RankWorker)
        actors = [
            remote_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r), **extra,
            ).remote(r, world)
            for r in range(world)
        ]
        addr, port = get(actors[0].address.remote(), name)
        get(GroupRef([a.setup.remote(addr, port, worker_args) for a in actors], name))
        return cls(name, actors, pg)

    def shutdown(self) -> None:
        """Kill the ranks and release the placement group's reserved resources."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.placement_group)
        self.actors = []

    def __getattr__(self, method: str) -> _GroupMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _GroupMethod(self, method)


def get(ref, name: str | None = None):
    """``ray.get`` that names the policy whose actor died; a group's call returns rank 0's result."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        if isinstance(ref, GroupRef):  # fail on the first rank that fails (the others may wait in a collective)
            pending = list(ref)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(ref[0])
        return ray.get(ref)
    except RayActorError as exc:
        who = name or _NAMES.get(getattr(exc, "actor_id", None) or "", "?")
        raise ActorDied(
            f"the Ray actor of policy {who!r} died ({type(exc).__name__}); resume the run with `graft train --resume RUN_DIR`"
        ) from exc
    except RayTaskError as exc:
        raise exc.as_instanceof_cause() from None
