"""One interface to a policy's worker, wherever it runs (docs/design.md, "Engine").

The trainer, validation, checkpointing and ``graft probe`` call a policy's
:class:`~graft_rl.engine.worker.PolicyWorker` through a :class:`WorkerHandle`, one typed method per
worker call (``handle.train(batch, step, ...)``, ``handle.generate(...)``): each starts the call and
returns a :class:`Pending`, whose ``get()`` waits for it. In-process
(:class:`LocalHandle`) the call runs at submit; under Ray (:class:`RayHandle`) it runs in the
policy's actor, or on every rank of its actor group, while the driver goes on, so the policies'
devices work at the same time. :func:`start_workers` builds the handles a config asks for; the
trainer never asks which kind it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from graft_rl.engine.worker import PolicyWorker

__all__ = ["LocalHandle", "Pending", "RayHandle", "WorkerHandle", "completion_order", "start_workers"]


class Pending:
    """A submitted call: :meth:`get` waits for its result (an exception inside the call is raised there)."""

    __slots__ = ("handle", "ref")

    def __init__(self, handle: WorkerHandle, ref: Any):
        self.handle, self.ref = handle, ref

    def get(self) -> Any:
        return self.handle.result(self.ref)


class WorkerHandle:
    """A policy's worker as the driver sees it."""

    #: calls run while the driver goes on (so starting work early pays off)
    concurrent: bool = False

    def __init__(self, name: str, policy: Any):
        self.name = name
        self.policy = policy  # the in-process Policy, or (Ray) its PolicyConfig: the model lives in the actor

    def _submit(self, call: Callable, *args) -> Pending:
        """Start ``call`` (a :class:`PolicyWorker` method) with ``args`` where the worker lives."""
        return Pending(self, self._start(call.__name__, *args))

    # ------------------------------------------------------------------ the worker's calls, typed
    def generate(self, prompts, sampling, seed: int, lag: int | None = None) -> Pending:
        """``(groups, seconds)``: the policy's rollouts of ``prompts`` (:meth:`PolicyWorker.generate_timed`);
        ``lag``: from the weights of ``lag`` pushes earlier (``rollout.lag``, training generations only)."""
        return self._submit(PolicyWorker.generate_timed, prompts, sampling, seed, lag)

    def train(
        self,
        batch,
        step: int,
        seed: int,
        temperature: float,
        max_new_tokens: int | None,
        engine_logprobs: bool = True,
    ) -> Pending:
        """The receiver's update on its batch (:meth:`PolicyWorker.train`): a ``ReceiverUpdate``."""
        return self._submit(PolicyWorker.train, batch, step, seed, temperature, max_new_tokens, engine_logprobs)

    def weigh_peers(self, batch, seed: int, temperature: float, max_new_tokens: int | None) -> Pending:
        """What :meth:`train` computes for the peer rows, without updating (:meth:`PolicyWorker.weigh_peers`)."""
        return self._submit(PolicyWorker.weigh_peers, batch, seed, temperature, max_new_tokens)

    def evaluate(self, problems, reward, samples, temperature, top_p, max_new_tokens, seed, timeout, budget) -> Pending:
        """pass@1 of the policy on ``problems`` (:meth:`PolicyWorker.evaluate`)."""
        args = (problems, reward, samples, temperature, top_p, max_new_tokens, seed, timeout, budget)
        return self._submit(PolicyWorker.evaluate, *args)

    def save(self, path: str, lag: bool = True) -> Pending:
        """The policy's checkpoint (:meth:`PolicyWorker.save`); ``lag``: with its ``rollout.lag`` history."""
        return self._submit(PolicyWorker.save, path, lag)

    def load_state(self, path: str) -> Pending:
        return self._submit(PolicyWorker.load_state, path)

    def prompt_bound(self) -> Pending:
        return self._submit(PolicyWorker.prompt_bound)

    def vocab_digest(self) -> Pending:
        """The digest of the policy's vocabulary (:meth:`PolicyWorker.vocab_digest`)."""
        return self._submit(PolicyWorker.vocab_digest)

    def prompt_budget(self, problems, max_new_tokens: int) -> Pending:
        return self._submit(PolicyWorker.prompt_budget, problems, max_new_tokens)

    def rollout_check(self, prompts, max_new_tokens: int = 16, seed: int = 0, reference: dict | None = None) -> Pending:
        return self._submit(PolicyWorker.rollout_check, prompts, max_new_tokens, seed, reference)

    def lag_choice(self) -> Pending:
        """``(the lag-1 choice's weights_version, the live one)`` (:meth:`PolicyWorker.lag_choice`)."""
        return self._submit(PolicyWorker.lag_choice)

    def link_address(self) -> Pending:
        return self._submit(PolicyWorker.link_address)

    def push_generators(self, names, chosen: bool, transfer: str, link) -> Pending:
        """A push to the policy's generators (:meth:`PolicyWorker.push_generators`)."""
        return self._submit(PolicyWorker.push_generators, names, chosen, transfer, link)

    def _start(self, method: str, *args) -> Any:
        """Start ``PolicyWorker.<method>(*args)``; the reference :meth:`result` waits on."""
        raise NotImplementedError

    def result(self, ref: Any) -> Any:
        """Wait for a started call's reference; its exception is raised here."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the worker holds outside this process (Ray actors, placement groups)."""


class LocalHandle(WorkerHandle):
    """A :class:`~graft_rl.engine.worker.PolicyWorker` in this process: a call runs when it is submitted."""

    def __init__(self, worker, owns: bool = False):
        super().__init__(worker.policy.name, worker.policy)
        self.worker = worker
        self.owns = owns  # the policy was built for this handle: close() shuts its rollout engine down

    def _start(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)

    def result(self, ref: Any) -> Any:
        return ref

    def close(self) -> None:
        if self.owns:
            self.worker.policy.close()


class RayHandle(WorkerHandle):
    """A policy's Ray actor (``world_size`` 1) or :class:`~graft_rl.engine.distributed.ActorGroup`."""

    concurrent = True

    def __init__(self, name: str, policy_config, actor):
        super().__init__(name, policy_config)
        self.actor = actor

    def _start(self, method: str, *args) -> Any:
        return getattr(self.actor, method).remote(*args)

    def result(self, ref: Any) -> Any:
        from graft_rl.engine.distributed import get

        return get(ref)

    def close(self) -> None:
        from graft_rl.engine.distributed import ActorGroup, kill_actors

        if isinstance(self.actor, ActorGroup):
            self.actor.shutdown()
        else:
            kill_actors([self.actor])


def completion_order(pending: dict[str, Pending]) -> Iterator[str]:
    """The names of ``pending`` calls in the order they finish (in-process: as submitted, all done)."""
    remote = {name: p.ref for name, p in pending.items() if p.handle.concurrent}
    yield from (name for name in pending if name not in remote)
    if remote:
        from graft_rl.engine.distributed import completion_order as ray_order

        yield from ray_order(remote)


def start_workers(cfg, policy_configs) -> dict[str, WorkerHandle]:
    """A handle per policy: in this process (``execution: local``) or in Ray actors (``execution: ray``)."""
    if cfg.execution == "ray":
        from graft_rl.engine.distributed import start_actors

        actors = start_actors(cfg, policy_configs)
        return {pc.name: RayHandle(pc.name, pc, actors[pc.name]) for pc in policy_configs}
    from graft_rl.policy import Policy

    handles: dict[str, WorkerHandle] = {}
    for pc in policy_configs:
        policy = Policy(pc, with_reference=cfg.method.kl_coef > 0)
        handles[pc.name] = LocalHandle(PolicyWorker(policy, cfg.method, cfg.minibatch, cfg.nonfinite_loss), owns=True)
    return handles
