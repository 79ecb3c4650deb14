"""``graft`` command line: ``graft train | eval | analyze``."""

from __future__ import annotations

import argparse
import sys

from graft_rl import __version__

_NOT_BUILT = {
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
    t = sub.add_parser("train", help="co-train policies with GRAFT, a baseline or an ablation")
    t.add_argument("config", nargs="?", help="YAML config (default: the built-in CPU demo)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. method.delta=0.9 policies.0.lr=1e-5")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, what in _NOT_BUILT.items():
        p = sub.add_parser(name, help=what)
        p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _train(ns) -> int:
    from graft_rl.config import ConfigError, load_config
    from graft_rl.data import DatasetError
    from graft_rl.policy import PolicyError
    from graft_rl.store import RecordError
    from graft_rl.trainer import Trainer

    overrides = list(ns.overrides)
    config = ns.config
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # `graft train key=value` with the default config
        config = None
    try:
        if ns.resume:
            trainer = Trainer.resume(ns.resume, show_progress=not ns.no_progress)
        else:
            if config is None:
                from graft_rl.defaults import default_config

                cfg = default_config(overrides)
            else:
                cfg = load_config(config, overrides)
            trainer = Trainer(cfg, show_progress=not ns.no_progress)
        trainer.run()
    except (ConfigError, DatasetError, PolicyError, RecordError) as exc:
        print(f"graft train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    from graft_rl.report import print_run_summary

    print_run_summary(trainer.run_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        ns = parser.parse_args(["train", *(argv or [])])
    if ns.command == "train":
        return _train(ns)
    print(f"graft {ns.command}: not built yet — {_NOT_BUILT[ns.command]}.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
