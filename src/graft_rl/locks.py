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
    """Hold an exclusive ``flock`` on ``lock_file`` for the block; the file is created with ``mode``
    (set with ``fchmod``, so the umask does not narrow it) if it is missing.

    The file is opened read-only: ``flock`` needs no write access, so a lock file another user created
    (mode ``0o644`` or ``0o666``) locks as well as one's own. An existing file is opened without
    ``O_CREAT``, which ``fs.protected_regular`` refuses for another user's file in a sticky, world-writable
    directory such as ``/tmp``."""
    fd = _open_lock_file(Path(lock_file), mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _open_lock_file(path: Path, mode: int) -> int:
    """A read-only descriptor of ``path``, created (exclusively, then ``fchmod`` to ``mode``) if missing."""
    for _ in range(3):  # another process may create or remove it between the two opens
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            continue
        # the umask applied at creation: every user the mode names may open it (a filesystem without
        # modes, some network mounts, refuses: the lock still works here)
        with contextlib.suppress(OSError):
            os.fchmod(fd, mode)
        return fd
    return os.open(path, os.O_RDONLY)
