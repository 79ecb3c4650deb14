"""Weights from a policy's trainer to its generators (``rollout.mode: one_step_off``; docs/design.md,
"One step off").

A push streams the trainer's rollout weights (:meth:`Policy.rollout_state`: a LoRA policy's adapters
merged into its base; an FSDP2 policy's shards gathered, every rank taking part in each all-gather) one
tensor at a time, in the generators' order of names, each cast to the generator's dtype and
row-digested as it leaves (:func:`~graft_rl.policy.pushcheck.digesting`). Two ways to carry it:

- :class:`WeightLink`: a process group of trainer rank 0 (its rank 0) and the generator replicas, built
  apart from the trainer's own FSDP2 group; each tensor is broadcast from rank 0. ``gloo`` on CPU,
  ``nccl`` on a GPU. (Not vLLM's NCCL weight-transfer backend, which by vLLM's own source turns into a
  no-op off CUDA.)
- the Ray object store (``object_store``): trainer rank 0 puts one dict of the tensors, every replica
  reads it; a CPU fallback that needs no port between the actors.

A generator copies each tensor into its model and digests what it then holds
(:func:`received_digest`); the driver compares the two digests, so a tensor that did not arrive, or
arrived changed, is named (:func:`check_delivery`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch

__all__ = ["WeightLink", "check_delivery", "generator_stream", "manifest", "received_digest"]


def manifest(model: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of every tensor a push writes into ``model`` (its state dict; a tied
    alias is listed too and written twice with one value)."""
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in model.state_dict().items()]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def generator_stream(policy, names: list[tuple[str, str, tuple[int, ...]]], digests: dict) -> Iterator:
    """``(name, tensor)`` of the policy's rollout weights in the order of ``names`` (a generator's
    :func:`manifest`), each in the generator's dtype and its row digest recorded in ``digests``. A
    sharded policy: every rank calls, each tensor is an all-gather (its shard cast first), so all ranks
    iterate to the end; only rank 0's tensors are sent."""
    from graft_rl.policy.pushcheck import digesting

    dtypes = {n: _dtype(d) for n, d, _ in names}
    state = policy.rollout_state()
    gather = getattr(policy, "_gathered_one", None)
    sharded_plain = gather is not None and policy.lora is None  # a LoRA MergedState gathers as it is read

    def tensors():
        for n, _, _ in names:
            if n not in state:
                raise KeyError(
                    f"policy {policy.name!r}: the generators' model has tensor {n!r}, which the trainer's "
                    "rollout weights do not (the generators must load the policy's own architecture)"
                )
            t = state[n].detach()
            if sharded_plain:
                dt = dtypes[n]
                t = gather(t.to(dt) if t.is_floating_point() and t.dtype != dt else t).detach()
            yield n, t

    yield from digesting(tensors(), dtypes, digests)


def received_digest(model: torch.nn.Module, names: list[tuple[str, str, tuple[int, ...]]]) -> dict:
    """The row digests of what ``model`` holds after a push (the generator's side of the check)."""
    from graft_rl.policy.pushcheck import state_digest

    return state_digest(model.state_dict(), {n: _dtype(d) for n, d, _ in names})


def check_delivery(who: str, sent: Mapping[str, torch.Tensor], held: Mapping[str, torch.Tensor]) -> None:
    """One line naming the first tensor whose generator copy differs from what the trainer sent."""
    for name, digest in sent.items():
        got = held.get(name)
        if got is None or not torch.equal(got, digest):
            why = "never arrived" if got is None else "arrived changed"
            raise RuntimeError(f"{who}: the weight push is not verified: tensor {name!r} {why} (digest differs)")
    extra = sorted(set(held) - set(sent))
    if extra:
        raise RuntimeError(f"{who}: the weight push is not verified: tensor {extra[0]!r} was not sent")


class WeightLink:
    """A process group of a policy's trainer rank 0 (rank 0 here) and its ``world - 1`` generator
    replicas, apart from any group the trainer's ranks share; rendezvous at ``addr:port`` (rank 0 hosts
    the store). ``backend``: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors)."""

    def __init__(self, backend: str, addr: str, port: int, rank: int, world: int, timeout: float = 1800.0):
        import torch.distributed as dist

        self.rank, self.world, self.backend = rank, world, backend
        wait = timedelta(seconds=timeout)
        self.store = dist.TCPStore(addr, port, world, rank == 0, timeout=wait)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, rank, world, wait)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = wait
            self.group = dist.ProcessGroupNCCL(self.store, rank, world, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"WeightLink: backend must be gloo or nccl, got {backend!r}")

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def send(self, stream) -> None:
        """Rank 0: broadcast each ``(name, tensor)`` of ``stream`` in order."""
        for _, t in stream:
            self._broadcast(t.to(self.device).contiguous())

    def receive(self, names: list[tuple[str, str, tuple[int, ...]]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A generator: each tensor of ``names`` as rank 0 broadcasts it."""
        for n, d, shape in names:
            t = torch.empty(shape, dtype=_dtype(d), device=self.device)
            self._broadcast(t)
            yield n, t

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.group.shutdown()
