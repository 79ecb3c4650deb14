"""``graft`` command line: ``graft train | eval | analyze``."""

from __future__ import annotations

import argparse
import sys

from graft_rl import __version__

_NOT_BUILT = {
    "train": "co-training with GRAFT and its baselines (issue: trainer)",
    "eval": "pass@1 on MATH500, AIME24/25, AMC23, Minerva (issue: evaluation)",
    "analyze": "diagnostics and plots from a run's records (issue: evaluation)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graft",
        description="graft-rl: cross-model RLVR with GRAFT (gated replacement of answer-failed groups).",
    )
    parser.add_argument("--version", action="version", version=f"graft-rl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, what in _NOT_BUILT.items():
        p = sub.add_parser(name, help=what)
        p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        ns.command = "train"  # the main job runs on its built-in default
    print(f"graft {ns.command}: not built yet — {_NOT_BUILT[ns.command]}.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
