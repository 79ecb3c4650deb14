"""Rollouts that lag the trainer (``rollout.lag: k``): the engine samples from the weights the policy had
``k`` pushes earlier, as an asynchronous trainer's engine would (docs/design.md, "Engine and trainer").

A push is a training generation after the weights changed (a step whose updates were all skipped pushes
nothing new). :class:`RolloutLag` keeps the trainable parameters of the last ``k + 1`` pushes on the host
(for a LoRA policy its adapters, for an FSDP2 rank its shards), the newest being the live weights. For a
lagged generation the snapshot ``k`` pushes back is copied *into the live parameters*
(:meth:`RolloutLag.swapped`), so everything that reads them reads the snapshot: the ``hf`` backend that
samples from the live module, a vLLM push and its trainer-side digest, a LoRA policy's merged weights,
an FSDP2 rank's gathered tensors. Afterwards the live weights are copied back, bit for bit, before any
update. A checkpoint holds the history (:meth:`RolloutLag.save`), so a resumed run samples as the
uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["LAG_FILE", "RolloutLag", "trainable"]

#: the history's file in a policy's checkpoint directory (an FSDP2 rank's: ``rollout_lag.rank{r}.safetensors``)
LAG_FILE = "rollout_lag.safetensors"


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the parameters an update changes, as local tensors (an FSDP2 rank's shard)."""
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            out.append((name, p.to_local() if hasattr(p, "to_local") else p))
    return out


class RolloutLag:
    """The last ``k + 1`` pushed weights of one policy (oldest first), and which one a lagged generation
    samples from."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"RolloutLag: k must be >= 1, got {k}")
        self.k = k
        self.history: list[dict[str, torch.Tensor]] = []  # host copies of the trainable parameters
        self.tags: list[int] = []  # one per entry: what the engine holds is named ("lag", tag)
        self.versions: list[int | None] = []  # one per entry: its weights_version (None: from an old checkpoint)
        self.seen_version: int | None = None  # weights_version at the newest entry (None: not yet)
        self._next = 0

    def observe(self, params: list[tuple[str, torch.Tensor]], version: int) -> None:
        """A training generation at ``version``: the live weights join the history if they changed."""
        if self.history and self.seen_version == version:
            return
        self.history.append({n: t.detach().to("cpu", copy=True) for n, t in params})
        self.tags.append(self._next)
        self.versions.append(version)
        self._next += 1
        self.seen_version = version
        drop = max(0, len(self.history) - (self.k + 1))
        del self.history[:drop], self.tags[:drop], self.versions[:drop]

    def chosen(self) -> int | None:
        """The history index a lagged generation samples from: ``k`` pushes back, or during the warm-up the
        oldest held, so the lag ramps 0, 1, ..., k over a run's first ``k + 1`` pushes; None when that is
        the live weights (the first push)."""
        i = max(0, len(self.history) - 1 - self.k)
        return None if i == len(self.history) - 1 else i

    def chosen_version(self) -> int | None:
        """The weights_version a lagged generation samples now (:meth:`chosen`'s entry, or the newest)."""
        i = self.chosen()
        return self.versions[-1 if i is None else i] if self.history else None

    @contextlib.contextmanager
    def swapped(self, params: list[tuple[str, torch.Tensor]], index: int) -> Iterator[tuple[str, int]]:
        """Within the block the live parameters hold entry ``index``; the live weights (the newest entry)
        are copied back after it. Yields the engine tag of the entry."""
        with torch.no_grad():
            _load(params, self.history[index])
            try:
                yield ("lag", self.tags[index])
            finally:
                _load(params, self.history[-1])

    def resized(self, k: int) -> RolloutLag:
        """The same history for a lag of ``k`` (a run resumed with another ``rollout.lag``)."""
        out = RolloutLag(k)
        keep = max(1, min(len(self.history), k + 1))
        out.history, out.tags, out.versions = self.history[-keep:], self.tags[-keep:], self.versions[-keep:]
        out.seen_version, out._next = self.seen_version, self._next
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for entry in self.history for t in entry.values())

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: Path, version: int) -> None:
        """The history (each entry's tensors under ``i/name``), and whether its newest entry is the
        weights saved beside it (``version``: the live weights_version)."""
        from safetensors.torch import save_file

        tensors = {f"{i}/{n}": t.contiguous() for i, entry in enumerate(self.history) for n, t in entry.items()}
        meta = {
            "k": str(self.k),
            "entries": str(len(self.history)),
            "live": str(int(self.seen_version == version)),
            "versions": json.dumps(self.versions),
        }
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)

    def load(self, path: Path, version: int) -> None:
        """Restore :meth:`save`'s history; the live weights are ``version`` (after a resume)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            n = int(meta["entries"])
            entries: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                i, _, name = key.partition("/")
                entries[int(i)][name] = f.get_tensor(key)
        keep = self.k + 1 if meta["live"] == "1" else self.k  # what a run with this k keeps
        self.history = entries[-keep:] if keep < len(entries) else entries
        self.tags = list(range(len(self.history)))
        versions = json.loads(meta.get("versions", "null")) or [None] * n  # None: saved before versions were kept
        self.versions = versions[-len(self.history) :] if self.history else []
        self._next = len(self.history)
        self.seen_version = version if meta["live"] == "1" else None


def _load(params: list[tuple[str, torch.Tensor]], entry: dict[str, torch.Tensor]) -> None:
    for name, t in params:
        t.copy_(entry[name])
