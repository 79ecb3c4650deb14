"""One step off: generation of step t+1 on generators of its own while step t updates
(``rollout.mode: one_step_off``; docs/design.md, "One step off"; layer 5).

Each policy keeps its trainer group (:class:`~graft_rl.engine.worker.PolicyWorker` ranks) and gets a
:class:`GeneratorGroup`: ``rollout.generators.replicas`` Ray actors (:class:`GeneratorWorker`), each a copy
of the policy's model with its own rollout engine on devices of its own, sampling its share of the
prompts (replica ``r`` takes prompts ``r, r + R, ...`` with :func:`~graft_rl.seeding.rank_seed`, as an
FSDP2 rank does). :class:`OneStepOff` is the schedule :class:`~graft_rl.engine.rollouts.Rollouts` follows.
Each step t, all policies in lockstep:

1. take step t's batch: the one in flight, if it was sampled from the weights a ``rollout.lag: 1`` run
   samples at step t (:meth:`Policy.lag_choice`); else (a run's first step, a resume without a saved
   batch, a step after one whose updates were all skipped) push that choice and sample it now;
2. verify it; a rollout filter's refills sample on the generators, which still hold the same weights;
3. push the trainer's live weights θ(t-1), verified (:mod:`graft_rl.policy.transfer`), and start step
   t+1's generation;
4. exchange and update step t while it runs.

So a one-step-off run samples what the ``rollout.lag: 1`` run samples, step for step (equal bit for bit
on CPU with the same thread count where sampling happens). Validation and ``graft eval`` sample the
trainer's current weights, never a generator's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch

from graft_rl.engine.distributed import generator_bundle, generator_threads
from graft_rl.engine.handles import Pending, WorkerHandle
from graft_rl.engine.timing import PhaseTimer
from graft_rl.policy import Policy, PolicyConfig
from graft_rl.policy.transfer import WeightLink, check_delivery, manifest, received_digest
from graft_rl.seeding import rank_seed

__all__ = ["GeneratorGroup", "GeneratorWorker", "OneStepOff", "generator_config", "transfer_of"]


def transfer_of(cfg, pc: PolicyConfig) -> str:
    """``rollout.transfer`` resolved: ``auto`` is ``nccl`` for a GPU policy, ``gloo`` on CPU."""
    if cfg.rollout.transfer != "auto":
        return cfg.rollout.transfer
    return "nccl" if pc.device.startswith("cuda") else "gloo"


def generator_config(cfg, pc: PolicyConfig) -> PolicyConfig:
    """What a generator replica loads: the policy's own model (a LoRA policy's base, which receives the
    merged weights), one rank, no KL reference; a vLLM engine that never sleeps (nothing trains there),
    with ``rollout.generators.vllm_kwargs`` over the policy's own."""
    g = cfg.rollout.generators.of(pc.name)
    vllm = {**pc.vllm_kwargs, **g.vllm_kwargs}
    if pc.backend == "vllm":
        vllm.setdefault("sleep", False)
    return dataclasses.replace(pc, world_size=1, lora=None, vllm_kwargs=vllm, gradient_checkpointing=False)


class GeneratorWorker:
    """One generator replica (a Ray actor): the policy's model and rollout engine, weights pushed by its
    trainer, sampling replica ``replica`` of ``replicas``' share of each batch."""

    def __init__(self, pc: PolicyConfig, threads: int, replica: int, replicas: int):
        if threads:
            torch.set_num_threads(threads)
        if pc.device.startswith("cuda"):
            from graft_rl.engine.distributed import pin_actor_gpu

            pin_actor_gpu(f"{pc.name} generator", replica)
        self.policy = Policy(pc)
        self.policy._synced_version = None  # type: ignore[assignment]  # the engine gets the first push, whatever it is
        self.replica, self.replicas = replica, replicas
        self.link: WeightLink | None = None

    def name(self) -> str:
        return self.policy.name

    def manifest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return manifest(self.policy.model)

    def receive(self, names, version: int | None, transfer: str, source: Any) -> dict:
        """Take a push: from the trainer's link (``source``: ``(backend, addr, port, world)``) or from the
        object store (``source``: ``[ref]``), into the model; returns the row digests of what it now holds.
        A vLLM engine gets them at the next generation, through its own verified push."""
        state = self.policy.model.state_dict()
        if transfer == "object_store":
            import ray

            tensors = ray.get(source[0])
            stream: Iterator[tuple[str, torch.Tensor]] = ((n, tensors[n]) for n, _, _ in names)
        else:
            if self.link is None:
                backend, addr, port, world = source
                self.link = WeightLink(backend, addr, port, self.replica + 1, world)
            stream = self.link.receive(names)
        with torch.no_grad():
            for n, t in stream:
                state[n].copy_(t)
        # the engine's copy is pushed (and verified) before sampling; a version an old checkpoint's lag history did
        # not record (None) makes it push regardless
        if version is None:
            self.policy._synced_version = None  # type: ignore[assignment]
        else:
            self.policy.weights_version = version
        return received_digest(self.policy.model, names)

    def generate(self, prompts, sampling, seed: int):
        """``(groups, seconds)`` of this replica's share of ``prompts`` (all of them with one replica)."""
        share = prompts[self.replica :: self.replicas]
        timer = PhaseTimer()
        with timer("generate"):
            groups = self.policy.generate(share, sampling, seed=rank_seed(seed, self.replica, self.replicas))
        return groups, timer.seconds["generate"]

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.policy.close()


class GeneratorGroup:
    """The driver's handle on one policy's generator replicas: pushes from its trainer, and generations
    (a :class:`~graft_rl.engine.handles.Pending` whose result is the whole batch in prompt order)."""

    concurrent = True

    def __init__(self, cfg, pc: PolicyConfig, trainer: WorkerHandle):
        import ray

        from graft_rl.engine.distributed import _NAMES, _remember, _start_placed, get

        self.cfg, self.name, self.trainer = cfg, pc.name, trainer
        self.transfer = transfer_of(cfg, pc)
        self.replicas = cfg.rollout.generators.of(pc.name).replicas
        gpc = generator_config(cfg, pc)
        bundle = generator_bundle(cfg, pc)
        threads = generator_threads(cfg, pc)
        remote_cls = ray.remote(GeneratorWorker)
        self.actors: list = []
        try:
            for r in range(self.replicas):
                who = f"policy {pc.name!r} generator {r}"
                args = (gpc, threads, r, self.replicas)
                actor = _start_placed(remote_cls, bundle, {"max_restarts": 0}, args, who, cfg.ray.placement_timeout)
                _NAMES[actor._actor_id.hex()] = (f"{pc.name} generator", r)
                self.actors.append(actor)
            self.names = get(self.actors[0].manifest.remote(), f"{pc.name} generator")
        except BaseException:
            self.close()  # the replicas started so far go too
            raise
        _remember(self.actors)
        self.version: int | None = None  # the weights_version the replicas hold (None: as loaded)
        self.link: tuple | None = None

    def push(self, chosen: bool, version: int | None) -> float:
        """Push the trainer's weights (the live ones, or with ``chosen`` the lag-1 choice), whose weights_version
        is ``version``, to every replica and verify each replica's copy; returns the seconds it took."""
        from graft_rl.engine.distributed import get

        t0 = time.perf_counter()
        who = f"policy {self.name!r} generator"
        if self.transfer != "object_store" and self.link is None:
            addr, port = self.trainer.link_address().get()
            self.link = (self.transfer, addr, port, self.replicas + 1)
        sent = self.trainer.push_generators(self.names, chosen, self.transfer, self.link)
        if self.transfer == "object_store":
            out = sent.get()
            held = [a.receive.remote(self.names, version, self.transfer, out["tensors"]) for a in self.actors]
        else:  # the trainer's rank 0 and the replicas meet in the link's broadcasts
            held = [a.receive.remote(self.names, version, self.transfer, self.link) for a in self.actors]
            self._first_error(sent, held, who)
            out = sent.get()
        if out["version"] != version:
            raise RuntimeError(f"{who}: pushed weights_version {out['version']}, expected {version}; this is a bug")
        for r, ref in enumerate(held):
            check_delivery(f"{who} {r}", out["digests"], get(ref, who))
        self.version = version
        return time.perf_counter() - t0

    def _first_error(self, sent: Pending, held: list, who: str) -> None:
        """Wait for both sides of a link push at once: an error on either is raised as soon as it comes. A
        replica that failed is killed with the others, so the trainer's broadcast ends instead of waiting for
        the link's timeout (the trainer's own error leaves the replicas to :meth:`close`)."""
        import ray

        from graft_rl.engine.distributed import get

        refs = list(sent.ref) if isinstance(sent.ref, list) else [sent.ref]
        waiting = [*refs, *held]
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            try:
                get(ready[0], who)
            except BaseException:
                if ready[0] in held:
                    self.close()
                raise

    def generate(self, prompts, sampling, seed: int) -> Pending:
        return Pending(self, [a.generate.remote(prompts, sampling, seed) for a in self.actors])  # type: ignore[arg-type]

    def result(self, refs) -> tuple[list, float]:
        """The replicas' shares back in prompt order, and the slowest replica's seconds."""
        from graft_rl.engine.distributed import get

        parts = [get(ref, f"{self.name} generator") for ref in refs]
        n = sum(len(g) for g, _ in parts)
        R = len(parts)
        return [parts[i % R][0][i // R] for i in range(n)], max(s for _, s in parts)

    def close(self) -> None:
        from graft_rl.engine.distributed import kill_actors

        kill_actors(self.actors)
        self.actors = []


@dataclasses.dataclass
class InFlight:
    """A batch sampled ahead: its step, the generation, and the weights_version it was sampled from."""

    step: int
    pending: Pending
    version: int | None
    saved: bool = False  # read back from a checkpoint


class OneStepOff:
    """The one-step-off schedule (module docstring) over every live policy's :class:`GeneratorGroup`:
    what :class:`~graft_rl.engine.rollouts.Rollouts` calls instead of a worker's generation."""

    def __init__(self, cfg, workers: dict[str, WorkerHandle], groups: dict[str, GeneratorGroup] | None = None):
        """``groups``: each policy's generators; default: started here, from the run's own policy configs (a
        resumed trainer loads its checkpoint, a LoRA one only the adapter; a generator loads the model the run
        started from and is pushed the trainer's weights before it samples)."""
        self.cfg, self.workers = cfg, workers
        self.groups: dict[str, GeneratorGroup] = {} if groups is None else groups
        if groups is None:
            try:
                for pc in cfg.policies:
                    self.groups[pc.name] = GeneratorGroup(cfg, pc, workers[pc.name])
            except BaseException:
                self.close()
                raise
        self.inflight: dict[str, InFlight] = {}
        self.notes: dict[str, dict] = {}  # per policy, this step's push seconds and the version its batch sampled

    def _note(self, name: str, **kw) -> None:
        line = self.notes.setdefault(name, {"time_push": 0.0})
        line["time_push"] += kw.pop("time_push", 0.0)
        line.update(kw)

    def take_notes(self, name: str) -> dict:
        return self.notes.pop(name, {"time_push": 0.0})

    def batch(self, name: str, step: int, prompts, sampling, seed: int) -> Pending:
        """Step ``step``'s batch of policy ``name``: the one in flight when it was sampled from the weights the
        rollout.lag: 1 run samples now, else sampled now from them (pushed first)."""
        choice, _ = self.workers[name].lag_choice().get()
        held = self.inflight.pop(name, None)
        if held is not None and held.step == step and held.version == choice and _same_prompts(held, prompts):
            self._note(name, sample_version=choice)
            return held.pending
        self._hold(name, choice)
        self._note(name, sample_version=choice)
        return self.groups[name].generate(prompts, sampling, seed)

    def _hold(self, name: str, choice: int | None) -> None:
        """Push the lag-1 choice to the generators unless they hold it."""
        group = self.groups[name]
        if group.version != choice:
            self._note(name, time_push=group.push(chosen=True, version=choice))

    def refill(self, name: str, prompts, sampling, seed: int) -> Pending:
        """A rollout filter's refill: sampled on the generators from the step's weights (pushed first when the
        step's batch was read from a checkpoint, so they hold other weights)."""
        self._hold(name, self.workers[name].lag_choice().get()[0])
        return self.groups[name].generate(prompts, sampling, seed)

    def advance(self, name: str, step: int, prompts, sampling, seed: int) -> None:
        """Push the live weights (before this step's update) and start ``step``'s generation."""
        _, live = self.workers[name].lag_choice().get()
        group = self.groups[name]
        if group.version != live:
            self._note(name, time_push=group.push(chosen=False, version=live))
        self.inflight[name] = InFlight(step, group.generate(prompts, sampling, seed), live)

    def adopt(self, name: str, step: int, groups: list, seconds: float, version: int | None) -> None:
        """A batch a checkpoint saved in flight: step ``step``'s, sampled from ``version``."""
        self.inflight[name] = InFlight(step, _Done((groups, seconds)), version, saved=True)

    def overlap(self, lines: dict[str, dict], wall: float) -> None:
        """A step's overlap in each policy's metric line: ``time_push`` (its pushes to the generators),
        ``sample_version`` (the weights_version its batch was sampled from), and each side's idle fraction
        of the step's wall time: the trainer waiting for its batch (``time_wait_generation``), the
        generators not generating (the batch's ``time_generate``, sampled beside the previous step's
        update, against this step's wall time)."""
        wall = max(wall, 1e-9)
        for name, line in lines.items():
            line.update(self.take_notes(name))
            line["trainer_idle_frac"] = min(1.0, line.get("time_wait_generation", 0.0) / wall)
            line["generator_idle_frac"] = max(0.0, 1.0 - line.get("time_generate", 0.0) / wall)

    def save(self, checkpoint, step: int) -> None:
        """At a checkpoint: step ``step``'s batch in flight, in it (``rollout.inflight_at_checkpoint: save``)."""
        if self.cfg.rollout.inflight_at_checkpoint == "save":
            save_inflight(checkpoint / INFLIGHT, self, step)

    def restore(self, checkpoint, step: int) -> None:
        """On resume: the batch the checkpoint saved in flight is step ``step``'s (else it is sampled again)."""
        if self.cfg.rollout.inflight_at_checkpoint != "save":
            return
        saved = load_inflight(checkpoint / INFLIGHT, step, self.workers)
        for name, (groups, seconds, version) in (saved or {}).items():
            self.adopt(name, step, groups, seconds, version)

    def drop(self) -> None:
        """Forget the batches in flight (the end of a ``Trainer.run`` call: the next call samples again)."""
        self.inflight.clear()

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups = {}


def _same_prompts(held: InFlight, prompts) -> bool:
    """A batch read back from a checkpoint answers the step's prompts (``allow_changed: data`` may change them)."""
    if not held.saved:
        return True  # sampled in this run for these very prompts
    same = [g.prompt_id for g in held.pending.get()[0]] == [pid for pid, _ in prompts]
    if not same:
        print(f"graft train: step {held.step}'s saved batch answers other prompts (the data changed); sampled again")
    return same


class _Done(Pending):
    """A result already here (a batch read back from a checkpoint)."""

    concurrent = False

    def __init__(self, value):
        super().__init__(None, None)  # type: ignore[arg-type]
        self.value = value

    def get(self):
        return self.value


#: a checkpoint's batch in flight: ``checkpoints/step_N/inflight`` (records in the store's Parquet format,
#: ``inflight.json`` with the step and each policy's weights_version, its own manifest)
INFLIGHT = "inflight"


def save_inflight(directory, one_step: OneStepOff, step: int) -> None:
    """Wait for step ``step``'s batches in flight and write them to ``directory`` (atomically, with their
    weights_version): a resume trains on them rather than sampling them again."""
    import json
    from pathlib import Path

    from graft_rl.engine.rundir import replace_dir, write_manifest
    from graft_rl.engine.store import RecordStore

    held = {n: f for n, f in one_step.inflight.items() if f.step == step}
    if not held:
        return
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    store = RecordStore(tmp)
    meta: dict = {"step": step, "policies": {}}
    for name, f in held.items():
        groups, seconds = f.pending.get()
        store.write(step, groups)
        meta["policies"][name] = {"version": f.version, "seconds": seconds}
    (tmp / "inflight.json").write_text(json.dumps(meta))
    write_manifest(tmp, step)
    replace_dir(tmp, directory)


def load_inflight(directory, step: int, names) -> dict[str, tuple[list, float, int | None]] | None:
    """The batches :func:`save_inflight` wrote for ``step``: ``{policy: (groups, seconds, version)}``, or None
    (none saved, or not whole: then they are sampled again, from the same weights)."""
    import json
    from pathlib import Path

    from graft_rl.engine.rundir import manifest_problem
    from graft_rl.engine.store import RecordStore

    directory = Path(directory)
    if not directory.is_dir():
        return None
    problem = manifest_problem(directory, required=True, step=step)
    if problem is not None:
        print(f"graft train: {directory}: {problem}; step {step}'s batch is sampled again")
        return None
    meta = json.loads((directory / "inflight.json").read_text())
    if set(meta["policies"]) != set(names):
        return None
    store = RecordStore(directory)
    return {n: (store.read(n, step), float(m["seconds"]), m["version"]) for n, m in meta["policies"].items()}
