"""One OS file lock (``flock``) for the layers that need one: ``graft eval``'s read-modify-write of
``eval.json`` (:func:`graft_rl.commands.results.locked`) and the per-GPU turns of vLLM engines
(:func:`graft_rl.policy.vllm_backend.gpu_turn`). The OS releases it if its holder dies."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["flocked"]


@contextlib.contextmanager
def flocked(lock_file: str | Path, mode: int = 0o644) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (created if missing) for the block."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
