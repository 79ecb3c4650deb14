"""Leave nothing behind when a driver dies: the local Ray instance's processes go with it.

``ray.init()`` without an address starts a local instance (GCS, raylet, their agents, workers) as
children of the driver. Ray's own fate-sharing handles most of a SIGKILL of the driver, but the
raylet's dashboard and runtime-env agents first try to report the raylet's death to the (dead) GCS
with a fixed 60 s timeout, holding ~170 MB meanwhile, and a driver killed while the instance starts
can leave more. :func:`watch` starts this module as a detached process that watches the driver
through a pipe: while the driver lives it notes the driver's descendants every second; when the
pipe closes (any exit: normal, SIGKILL, OOM) it waits a moment for Ray's own shutdown, then kills
what is left of the processes it noted. Only processes it saw as the driver's descendants, with the
same start time (so a reused pid is never touched), and only the instance this driver started:
:func:`watch` is not called for a cluster the driver joined by address.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

__all__ = ["watch"]

POLL_S = 1.0
GRACE_S = 2.0  # Ray's own shutdown (ray.shutdown, atexit) usually finishes in this


def watch() -> subprocess.Popen | None:
    """Start the watcher for this process (once); it outlives a SIGKILL of this process."""
    global _WATCHER
    if _WATCHER is not None and _WATCHER.poll() is None:
        return _WATCHER
    try:
        import psutil  # noqa: F401  (Ray depends on it)
    except ImportError:
        return None
    _WATCHER = subprocess.Popen(
        [sys.executable, "-m", "graft_rl.engine.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the terminal's process group does not stop it early
        close_fds=True,
    )
    return _WATCHER


_WATCHER: subprocess.Popen | None = None


def _descendants(driver, me: int) -> dict[int, float]:
    import psutil

    try:
        kids = driver.children(recursive=True)
    except psutil.Error:
        return {}
    seen = {}
    for p in kids:
        try:
            if p.pid != me and _is_ray(p.cmdline()):
                seen[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return seen


def _is_ray(cmdline: list[str]) -> bool:
    """A process of Ray's: its binaries and scripts live under ``.../ray/`` (``python -u .../ray/...py``
    for its agents and monitors: the script is the third word); its workers and agents rename
    themselves ``ray::...``."""
    return bool(cmdline) and (cmdline[0].startswith("ray::") or any("/ray/" in part for part in cmdline[:4]))


def _alive(pid: int, started: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(seen: dict[int, float]) -> int:
    import psutil

    killed = 0
    for pid, started in seen.items():
        if _alive(pid, started):
            try:
                psutil.Process(pid).kill()
                killed += 1
            except psutil.Error:
                pass
    return killed


def main(argv: list[str]) -> int:
    import psutil

    try:
        driver = psutil.Process(int(argv[0]))
    except (IndexError, ValueError, psutil.Error):
        return 2
    me, seen = os.getpid(), dict[int, float]()
    while True:
        # accumulated (a process that left its parent is still noted); those that ended are dropped
        seen = {pid: t for pid, t in seen.items() if _alive(pid, t)} | _descendants(driver, me)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the pipe closed: the driver is gone
    time.sleep(GRACE_S)
    _reap(seen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
