"""Verifier worker: ``python -m graft_rl.rewards._worker [PRELOAD_MODULE ...]``.

Reads one JSON request per line on stdin, ``{"fn": "module:function", "args": [...]}``, and
writes one JSON line per request on stdout: ``{"id": ID, "r": float}`` or ``{"id": ID, "err": "..."}``,
echoing the request's ``id``. Prints ``READY`` once its preload imports (and each preloaded
module's ``warm_up()``, if any) are done. Started by :class:`graft_rl.rewards.pool.VerifierPool`
as a plain subprocess, so it never re-imports the user's ``__main__``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def main() -> None:
    # The protocol gets a private copy of stdout; fd 1 and sys.stdout then point at stderr, so a
    # check that prints cannot put a stray line into the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
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


if __name__ == "__main__":
    main()
