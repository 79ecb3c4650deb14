"""Verifier worker: ``python -m graft_rl.rewards._worker [PRELOAD_MODULE ...]``.

Reads one JSON request per line on stdin, ``{"fn": "module:function", "args": [...]}``, and
writes one JSON line per request on stdout: ``{"r": float}`` or ``{"err": "..."}``. Prints
``READY`` once its preload imports are done. Started by :class:`graft_rl.rewards.pool.VerifierPool`
as a plain subprocess, so it never re-imports the user's ``__main__``.
"""

from __future__ import annotations

import importlib
import json
import sys


def main() -> None:
    out = sys.stdout.buffer
    for mod in sys.argv[1:]:
        try:
            importlib.import_module(mod)
        except Exception:
            pass
    out.write(b"READY\n")
    out.flush()
    fns: dict = {}
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
            name = req["fn"]
            if name not in fns:
                mod, _, attr = name.partition(":")
                fns[name] = getattr(importlib.import_module(mod), attr)
            reply = {"r": float(fns[name](*req["args"]))}
        except Exception as exc:
            reply = {"err": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
