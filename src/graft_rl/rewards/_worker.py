"""Verifier worker: ``python -m graft_rl.rewards._worker [PRELOAD_MODULE ...]``.

Reads one JSON request per line on stdin, ``{"fn": "module:function", "args": [...]}``, and
writes one JSON line per request on stdout: ``{"id": ID, "r": float}`` or ``{"id": ID, "err": "..."}``,
echoing the request's ``id``. Prints ``READY`` once its preload imports (and each preloaded
module's ``warm_up()``, if any) are done. Started by :class:`graft_rl.rewards.pool.VerifierPool`
as a plain subprocess, so it never re-imports the user's ``__main__``.

It leads its own process group. When its stdin closes (the pool closed, or the trainer exited) or
its parent dies (checked each second, whatever the worker is doing), it ends that whole group, so nothing a reward started
outlives it; a timed-out or crashed worker's group is killed by the pool.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys


def _end_group(*_args) -> None:
    """SIGKILL this worker's process group: every process a reward started in it, and the worker."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _die_with_parent(parent: int) -> None:
    """End the group once the process that started this worker has died (by SIGKILL too: it is then
    no longer this worker's parent), even while a reward call hangs; checked every second."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        _end_group()

    threading.Thread(target=watch, name="graft-parent-watch", daemon=True).start()


def main() -> None:
    # The protocol gets a private copy of stdout; fd 1 and sys.stdout then point at stderr, so a
    # check that prints cannot put a stray line into the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if os.getpgrp() == os.getpid():  # the pool started it as a group leader: the group is ours to end
        signal.signal(signal.SIGTERM, _end_group)
        _die_with_parent(int(os.environ.get("GRAFT_RL_POOL_PID", os.getppid())))
    for mod in sys.argv[1:]:
        try:
            m = importlib.import_module(mod)
            if callable(getattr(m, "warm_up", None)):  # first-use costs off the first item's clock
                m.warm_up()
        except Exception:
            pass
    out.write(b"READY\n")
    out.flush()
    fns: dict = {}
    for raw in sys.stdin.buffer:
        req: dict = {}
        try:
            req = json.loads(raw)
            name = req["fn"]
            if name not in fns:
                mod, _, attr = name.partition(":")
                fns[name] = getattr(importlib.import_module(mod), attr)
            reply = {"id": req.get("id"), "r": float(fns[name](*req["args"]))}
        except Exception as exc:
            reply = {
                "id": req.get("id") if isinstance(req, dict) else None,
                "err": f"{type(exc).__name__}: {exc}"[:500],
            }
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    if os.getpgrp() == os.getpid():  # stdin closed: the pool is done with this worker
        _end_group()


if __name__ == "__main__":
    main()
