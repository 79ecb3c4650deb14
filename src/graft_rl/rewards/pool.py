"""A pool of verifier worker processes with a hard per-item wall-clock timeout.

Why not ``multiprocessing`` or math-verify's own timeout: math-verify's timer uses
``signal.alarm``, which only works on the main thread (not in a trainer thread or a Ray
actor's worker thread), and ``multiprocessing``'s spawn/forkserver start methods re-import
the user's ``__main__``, which breaks scripts without an ``if __name__ == "__main__"`` guard.
So each worker is a plain ``python -m graft_rl.rewards._worker`` subprocess speaking JSON
lines over pipes. An item that exceeds its timeout gets its worker killed (SIGKILL, then
reaped: no zombies) and replaced; a worker that dies mid-item (segfault, OOM kill, ``os._exit``)
is detected by end-of-file and replaced. Either way the item scores 0 and is counted.

Each worker leads its own session (process group), and it is the *group* that is killed: whatever
a reward started (a subprocess that hangs, a background job it left running) ends with its worker,
on a timeout, a crash, and when the pool closes (at the latest when the run's process exits). Only
a process that leaves the group itself (``setsid``, a daemon's double fork) escapes (docs/tasks.md).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["VerifierPool", "VerifyStats", "Outcome"]

#: Seconds a fresh worker may take to import its preload modules (sympy is slow to import).
STARTUP_TIMEOUT = 120.0


@dataclass(frozen=True)
class Outcome:
    """One item's result: ``score`` and how it ended (``ok``, ``timeout``, ``error``, ``crash``)."""

    score: float
    status: str
    detail: str = ""


@dataclass
class VerifyStats:
    """Counters of one or more verification calls; the trainer logs these per step."""

    total: int = 0
    ok: int = 0
    timeout: int = 0
    error: int = 0
    crash: int = 0
    skipped: int = 0  # decided without a worker (no boxed answer, exact match)
    budget: int = 0  # not checked: the batch's wall-clock budget ran out first (scored 0)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.total += 1
        setattr(self, o.status, getattr(self, o.status) + 1)
        if o.detail and len(self.errors) < 20:
            self.errors.append(o.detail)


class _Worker:
    def __init__(self, preload: Sequence[str]):
        env = dict(os.environ)
        # the child must import graft_rl exactly as this process does (installed, editable, or sys.path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["GRAFT_RL_POOL_PID"] = str(os.getpid())  # the worker ends its group once this process is gone
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "graft_rl.rewards._worker", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
            start_new_session=True,  # its own process group: killed whole, with what the reward started
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()

    def send(self, line: bytes) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def read_line(self) -> bytes | None:
        """Read what is available; return a complete line, ``b""`` on EOF, ``None`` if partial."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return b""
        self.buf += chunk
        if b"\n" in self.buf:
            line, _, self.buf = self.buf.partition(b"\n")
            return line + b"\n"
        return None

    def end_group(self) -> None:
        """SIGKILL the worker's whole process group: the worker and every process a reward started in it.
        Only while the worker is unreaped (its pid, the group's id, cannot be anyone else's then)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """End the worker's process group (:meth:`end_group`), then reap the worker."""
        self.end_group()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process that survives SIGKILL
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_POOLS):
        pool.close()


class VerifierPool:
    """Run ``module:function`` checks in worker processes, each bounded by ``timeout`` seconds.

    Thread-safe (calls are serialised by a lock) and fork-aware (a forked child starts its
    own workers). Workers start lazily on first use and live until :meth:`close` or exit.

    Args:
        num_workers: parallel worker processes (default ``min(4, cpu_count)``, or the
            ``GRAFT_RL_VERIFY_WORKERS`` environment variable).
        preload: modules each worker imports before it reports ready.
    """

    def __init__(self, num_workers: int | None = None, preload: Sequence[str] = ("graft_rl.rewards.checks",)):
        if num_workers is None:
            num_workers = int(os.environ.get("GRAFT_RL_VERIFY_WORKERS", min(4, os.cpu_count() or 1)))
        if num_workers < 1:
            raise ValueError(f"VerifierPool: num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.preload = tuple(preload)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._pid = os.getpid()
        self.restarts = 0
        _POOLS.add(self)

    # -------------------------------------------------------------- lifecycle
    def _ensure(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's workers are not ours to use or kill
            self._workers, self._pid = [], os.getpid()
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.preload))

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        new = _Worker(self.preload)
        self._workers[self._workers.index(w)] = new
        return new

    def close(self) -> None:
        """Kill and reap every worker."""
        with self._lock:
            if self._pid == os.getpid():
                for w in self._workers:
                    w.kill()
            self._workers = []

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # -------------------------------------------------------------- work
    def _receive(self, w: _Worker, busy: dict, results: list) -> None:
        """Read one line from a readable worker: its start-up signal, an item's reward (or error), or
        its death (the item it held scores 0 as a crash); an out-of-step worker is replaced."""
        line = w.read_line()
        if line is None:
            return
        if line == b"":  # the worker died: end its group while its pid (the group's id) is still unreaped
            w.end_group()
            if w in busy:
                i, _ = busy.pop(w)
                code = w.proc.poll()
                results[i] = Outcome(0.0, "crash", f"worker exited with code {code}")
            elif time.monotonic() - w.started < 1.0 and self.restarts > 10 * self.num_workers:
                raise RuntimeError("VerifierPool: verifier workers die at start-up; is graft_rl importable?")
            self._replace(w)
            return
        if not w.ready:
            w.ready = line.strip() == b"READY"
            return
        if w not in busy:  # a line nobody asked for: the worker is out of step, replace it
            self._replace(w)
            return
        i, _ = busy.pop(w)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            reply = {}
        if not isinstance(reply, dict) or reply.get("id") != i:  # never take another item's answer
            results[i] = Outcome(0.0, "error", "verifier protocol out of step; worker replaced")
            self._replace(w)
        elif "err" in reply:
            results[i] = Outcome(0.0, "error", reply["err"])
        else:
            results[i] = Outcome(float(reply["r"]), "ok")

    def map(
        self, fn: str, arg_list: Sequence[Sequence], timeout: float = 5.0, budget: float | None = None
    ) -> list[Outcome]:
        """Run ``fn(*args)`` for each ``args``; each item gets at most ``timeout`` seconds, and the
        whole call at most ``budget`` seconds: items not finished by then score 0 (``budget``)."""
        if timeout <= 0:
            raise ValueError(f"VerifierPool.map: timeout must be > 0, got {timeout}")
        results: list[Outcome | None] = [None] * len(arg_list)
        if not arg_list:
            return []
        end = time.monotonic() + budget if budget is not None else float("inf")
        with self._lock:
            self._ensure()
            pending = deque(range(len(arg_list)))
            busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (item, deadline)
            while pending or busy:
                if time.monotonic() >= end:  # out of budget: what is left scores 0 and is counted
                    for w in list(busy):
                        i, _ = busy.pop(w)
                        results[i] = Outcome(0.0, "budget", f"batch budget {budget:g}s spent")
                        self._replace(w)
                    while pending:
                        results[pending.popleft()] = Outcome(0.0, "budget", f"batch budget {budget:g}s spent")
                    break
                for w in list(self._workers):
                    if not pending:
                        break
                    if w in busy or not w.ready:
                        continue
                    i = pending.popleft()
                    try:
                        w.send(json.dumps({"id": i, "fn": fn, "args": list(arg_list[i])}).encode() + b"\n")
                        busy[w] = (i, time.monotonic() + timeout)
                    except (BrokenPipeError, OSError):
                        pending.appendleft(i)
                        self._replace(w)
                waiting = [w for w in self._workers if w in busy or not w.ready]
                if not waiting:
                    continue
                now = time.monotonic()
                deadlines = [busy[w][1] if w in busy else w.started + STARTUP_TIMEOUT for w in waiting]
                readable, _, _ = select.select(
                    [w.fd for w in waiting], [], [], max(0.0, min(min(deadlines), end) - now)
                )
                by_fd = {w.fd: w for w in waiting}
                for fd in readable:
                    self._receive(by_fd[fd], busy, results)
                now = time.monotonic()
                for w in list(self._workers):
                    if w in busy and now >= busy[w][1]:
                        i, _ = busy.pop(w)
                        results[i] = Outcome(0.0, "timeout", f"over {timeout:g}s")
                        self._replace(w)
                    elif not w.ready and w not in busy and now >= w.started + STARTUP_TIMEOUT:
                        raise RuntimeError(f"VerifierPool: a verifier worker did not start within {STARTUP_TIMEOUT:g}s")
        return results  # type: ignore[return-value]
