"""``graft`` command line: ``graft train | eval | analyze | plan | preflight``."""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading

from graft_rl import __version__
from graft_rl.errors import DOCS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graft",
        description="graft-rl: cross-model RLVR with GRAFT (gated replacement of answer-failed groups).",
        epilog=f"Presets: graft config list. Documentation: {DOCS}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"graft-rl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("train", help="co-train policies with GRAFT, a baseline or an ablation")
    t.add_argument(
        "config", nargs="?", help="YAML config or preset name (graft config list; default: the built-in CPU demo)"
    )
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. method.delta=0.9 policies.0.lr=1e-5")
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its last complete checkpoint (overrides may raise steps/epochs)",
    )
    t.add_argument(
        "--allow-changed",
        metavar="WHAT",
        action="append",
        default=[],
        help="with --resume: go on although the reward's source (reward), a data file (data) or a plugin's source "
        "(plugin) changed since the checkpoint; the change is recorded (changes.jsonl) and graft analyze marks its step",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_eval(sub)
    _add_probe_seeds_plan(sub)
    _add_preflight_analyze(sub)
    c = sub.add_parser(
        "config",
        help="list: the presets that ship in the package; show: every config key with its default and meaning; "
        "init: a commented starter config for your task, or a preset copied out (--from)",
    )
    c.add_argument("action", choices=["show", "init", "list"])
    c.add_argument(
        "what",
        nargs="?",
        default=None,
        help="show: a section (run, data, validation, ray, tracking, method, policies, peers), a method name, a preset or a "
        "config file (its method, after importing its plugins); init: the file to write (default graft.yaml)",
    )
    c.add_argument(
        "--plugins",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="show: import these plugins first (module or file.py), so a method or part they register is listed",
    )
    c.add_argument("--data", default=None, help="init: your training data (file, folder or hf:ORG/NAME)")
    c.add_argument("--reward", default=None, help="init: your reward, path/to/file.py:function or module:function")
    c.add_argument("--models", nargs=2, default=None, metavar=("A", "B"), help="init: the two models")
    c.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="PRESET",
        help="init: copy a preset (graft config list) or config file into one self-contained file to edit",
    )
    c.add_argument("--force", action="store_true", help="init: replace an existing file")
    return parser


def _add_eval(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="pass@1 / pass@k on the paper's benchmarks or a run's own task (mean ± std over runs)",
        description="Settings not given come from a run directory's validation settings (its held-out task, sampling and "
        "lengths; the five benchmarks for math runs), else the paper's protocol: math500, aime24, aime25, "
        "amc23, minerva; 8 samples x 5 runs; T 0.6, top-p 0.95; 4096 new tokens.",
    )
    e.add_argument(
        "target", help="a run directory (its best checkpoints) or a model (directory, GGUF, zoo:NAME, hub id)"
    )
    e.add_argument(
        "--benchmarks",
        default=None,
        help="comma-separated built-in names, data files, hf:ORG/NAME or reasoning_gym:NAME (default: see above)",
    )
    e.add_argument(
        "--reward",
        default=None,
        help="scores benchmarks that name no reward: NAME or module:function (default: a built-in set's own "
        "verifier, else the run's data.reward)",
    )
    e.add_argument("--samples", type=int, default=None, help="responses per problem (default: 8)")
    e.add_argument("--runs", type=int, default=None, help="independent runs with different seeds (default: 5)")
    e.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (default: all)")
    e.add_argument("--temperature", type=float, default=None, help="default: the run's, else 0.6")
    e.add_argument("--top-p", type=float, default=None, help="default: the run's, else 0.95")
    e.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default: the run's, else 4096; clamped to each model's context",
    )
    e.add_argument("--policy", default=None, help="only this policy of a run directory")
    e.add_argument("--out", default=None, help="output directory (default RUN_DIR/eval or ./eval_results)")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    e.add_argument("--device", default=None)
    e.add_argument(
        "--backend", default=None, choices=["hf", "vllm"], help="rollout backend (default: the run's, else hf)"
    )
    e.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="W",
        help="Ray actors to spread the work over, one model and rollout engine each (one GPU each on a GPU "
        "machine; default: the devices the run trained on, all its policies' world_size, else 1)",
    )
    e.add_argument("--prompt-format", default=None, choices=["auto", "chat", "plain"])


def _add_probe_seeds_plan(sub) -> None:
    pr = sub.add_parser(
        "probe",
        help="will GRAFT help this pair? complementarity and compatibility before any training",
        description="Each policy samples the config's n responses for --limit training prompts (default: one "
        "prompt_batch); rewards are verified and a training step's selection, balanced exchange and "
        "compatibility gate run on them, without any update. Prints per policy and direction the all-fail "
        "rate, complementary candidates, groups grafted per step, compatibility and the share the gate "
        "admits (per prompt family where the data has them), and a verdict; writes probe.json and probe.png.",
    )
    pr.add_argument(
        "config",
        nargs="?",
        help="YAML config or preset name (the one you would train; default: graft train's built-in)",
    )
    pr.add_argument("overrides", nargs="*", help="key=value overrides, as for graft train")
    pr.add_argument("--limit", type=int, default=None, help="training prompts to probe (default: prompt_batch)")
    pr.add_argument("--out", default=None, help="output directory (default probe/<run_dir name>)")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    sd = sub.add_parser(
        "seeds",
        help="mean ± std of graft eval results over independent training runs (Table 4)",
        description="Each RUN_DIR must have been evaluated (graft eval RUN_DIR writes RUN_DIR/eval/eval.json). Prints "
        "each policy's pass@1 per benchmark and average as mean ± sample std over the runs; with --baseline, "
        "the baseline runs' too and Δ, the difference of the mean averages (Table 4: GRAFT vs GRPO n=8).",
    )
    sd.add_argument("runs", nargs="+", metavar="RUN_DIR")
    sd.add_argument(
        "--baseline", nargs="*", default=[], metavar="RUN_DIR", help="e.g. the GRPO n=8 runs of the same seeds"
    )
    sd.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    pl = sub.add_parser("plan", help="memory per GPU and GPUs per policy for a config (nothing is loaded)")
    pl.add_argument("config", help="YAML config or preset name (graft config list)")
    pl.add_argument("overrides", nargs="*", help="key=value overrides, e.g. policies.0.world_size=4")
    pl.add_argument("--gpu-memory", type=float, default=141.0, help="GiB per GPU (default 141, an H200)")
    pl.add_argument("--gpus", type=int, default=None, help="GPUs to split between the policies (default: the config's)")


def _add_preflight_analyze(sub) -> None:
    pf = sub.add_parser(
        "preflight",
        help="rehearse a config's own code path at toy size on this machine, stage by stage",
        description="Runs CONFIG's code path (placement, model build, generate, verify, exchange, update, weight push, "
        "validation, checkpoint, resume, graft eval, graft analyze) with tiny models of the same architecture "
        "families and toy sizes, keeping what the config decides (method, execution, world sizes, backend, "
        "precision); on a machine without the GPUs it needs, ranks become CPU processes. Prints a checklist "
        "and graft plan's verdict for the real config. Exit 0 when every stage passed.",
    )
    pf.add_argument("config", help="YAML config or preset name (graft config list)")
    pf.add_argument("overrides", nargs="*", help="key=value overrides of the real config")
    pf.add_argument("--run-dir", default=None, help="keep the toy run here (default: a temporary directory, removed)")
    pf.add_argument("--gpu-memory", type=float, default=141.0, help="GiB per GPU for the plan (default 141, an H200)")
    pf.add_argument("--json", default=None, metavar="FILE", help="also write the checklist as JSON")
    a = sub.add_parser("analyze", help="the paper's diagnostics and plots from a run's records and metrics")
    a.add_argument("run_dir")
    a.add_argument("--compare", nargs="*", default=[], metavar="RUN_DIR", help="runs to overlay on the curves")
    a.add_argument("--out", default=None, help="output directory (default RUN_DIR/analysis)")
    a.add_argument("--cases", type=int, default=3, help="case studies to include")
    x = sub.add_parser(
        "export",
        help="a trained policy as a plain Hugging Face model directory (a LoRA policy's adapter merged)",
        description="Writes the policy of RUN_DIR (a run directory: its best checkpoint, else its latest; or a "
        "checkpoint's policy directory) as a save_pretrained directory that transformers loads without graft-rl or "
        "peft; a LoRA policy's adapters are merged into its base (W + alpha/r B A, in float32, cast to the base's "
        "dtype). Several policies go to OUT/<name>.",
    )
    x.add_argument("target", metavar="RUN_DIR")
    x.add_argument("--policy", default=None, help="only this policy")
    x.add_argument("--merged", required=True, metavar="OUT", help="the directory to write (new or empty)")


def _train(ns) -> int:
    from graft_rl.data import DatasetError
    from graft_rl.engine.config import ConfigError, load_config
    from graft_rl.engine.rundir import RunDirError
    from graft_rl.engine.store import RecordError
    from graft_rl.engine.trainer import DynamicSamplingError, Trainer
    from graft_rl.policy import PolicyError
    from graft_rl.rewards import RewardError

    overrides = list(ns.overrides)
    config = ns.config
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # `graft train key=value` with the default config
        config = None
    trainer = None
    try:
        if ns.resume:
            if config is not None:  # `graft train --resume RUN_DIR steps=200`: the first override landed in `config`
                overrides.insert(0, config)
            trainer = Trainer.resume(
                ns.resume, show_progress=not ns.no_progress, overrides=overrides, allow_changed=ns.allow_changed
            )
        else:
            if ns.allow_changed:
                raise ConfigError("--allow-changed goes with --resume RUN_DIR (a new run has nothing to compare)")
            if config is None:
                from graft_rl.commands.defaults import default_config

                cfg = default_config(overrides)
            else:
                cfg = load_config(config, overrides)
            trainer = Trainer(cfg, show_progress=not ns.no_progress)
        trainer.run()
    except (
        ConfigError,
        DatasetError,
        PolicyError,
        RecordError,
        RunDirError,
        FloatingPointError,
        DynamicSamplingError,
        RewardError,
    ) as exc:
        print(f"graft train: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # read-only run directory, disk full, ...: the file, else the run directory
        if not exc.filename and exc.errno in _WRITE_ERRNOS and (trainer is not None or ns.resume):
            exc.filename = str(trainer.run_dir if trainer is not None else ns.resume)
        print(f"graft train: {_write_failed(exc)}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:
        from graft_rl.engine.distributed import ActorError, ResourceError

        if _out_of_memory(exc) is not None and not isinstance(exc, ActorError):
            print(f"graft train: {_out_of_memory(exc)}", file=sys.stderr)
            return 2
        if not isinstance(exc, ActorError):
            raise
        print(f"graft train: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ResourceError) else 3
    except KeyboardInterrupt as exc:
        return 128 + getattr(exc, "signum", signal.SIGINT)
    finally:
        if trainer is not None:
            trainer.close()
    from graft_rl.commands.report import print_run_summary

    print_run_summary(trainer.run_dir)
    return 0


def _eval(ns) -> int:
    from graft_rl.commands.evaluate_cli import run_eval
    from graft_rl.data import DatasetError
    from graft_rl.policy import PolicyError

    overrides = {
        k: v
        for k, v in (
            ("dtype", ns.dtype),
            ("device", ns.device),
            ("backend", ns.backend),
            ("prompt_format", ns.prompt_format),
        )
        if v is not None
    }
    try:
        benchmarks = [b.strip() for b in ns.benchmarks.split(",") if b.strip()] if ns.benchmarks else None
        run_eval(
            ns.target,
            benchmarks,
            ns.samples,
            ns.runs,
            ns.limit,
            ns.temperature,
            ns.top_p,
            ns.max_new_tokens,
            ns.policy,
            ns.out,
            overrides,
            replicas=ns.world_size,
            reward=ns.reward,
        )
    except (DatasetError, PolicyError, ValueError) as exc:
        print(f"graft eval: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk under --out: what was written before stays whole
        print(f"graft eval: {_write_failed(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: what finished is on disk (EvalInterrupted says where)
        print(f"\ngraft eval: {exc or 'interrupted'}", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as exc:
        from graft_rl.engine.distributed import ActorError

        if _out_of_memory(exc) is not None and not isinstance(exc, ActorError):
            print(f"graft eval: {_out_of_memory(exc)}", file=sys.stderr)
            return 2
        if not isinstance(exc, ActorError):
            raise
        print(f"graft eval: {exc}", file=sys.stderr)
        return 3
    return 0


def _probe(ns) -> int:
    from graft_rl.commands.probe import ProbeError, format_probe, probe
    from graft_rl.data import DatasetError
    from graft_rl.engine.config import ConfigError, load_config
    from graft_rl.policy import PolicyError
    from graft_rl.rewards import RewardError

    overrides, config = list(ns.overrides), ns.config
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # `graft probe key=value` with the default config
        config = None
    try:
        if config is None:
            from graft_rl.commands.defaults import default_config

            cfg = default_config(overrides)
        else:
            cfg = load_config(config, overrides)
        res = probe(cfg, ns.limit, ns.out, show=not ns.no_progress)
    except (ConfigError, DatasetError, PolicyError, ProbeError, RewardError) as exc:
        print(f"graft probe: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngraft probe: interrupted (nothing written)", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as exc:
        if _out_of_memory(exc) is None:
            raise
        print(f"graft probe: {_out_of_memory(exc)}", file=sys.stderr)
        return 2
    print(format_probe(res))
    print(f"written: {', '.join(res['written'])}")
    return 0


def _preflight(ns) -> int:
    import json
    from pathlib import Path

    from graft_rl.commands.preflight import format_checklist, run_preflight
    from graft_rl.engine.config import ConfigError

    try:
        result = run_preflight(ns.config, ns.overrides, ns.run_dir, gpu_memory=ns.gpu_memory)
    except ConfigError as exc:
        print(f"graft preflight: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngraft preflight: interrupted (its temporary directory and Ray processes are removed)", file=sys.stderr)
        return 130
    print()
    print(format_checklist(result))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


#: libgomp (torch's OpenMP on Linux) spins 300,000 iterations by default before a worker thread
#: sleeps. With two jobs on the same cores the spinning threads steal each other's time: on 2 cores,
#: two default runs took 13.6 s/step each instead of 1.4 (docs/benchmarks.md, "Two jobs at once").
#: 5,000 keeps a lone run's speed and makes two concurrent runs 2.4x slower instead of ~10x. Set
#: before torch is imported; a value in the environment wins.
GOMP_SPINCOUNT = "5000"


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`graft train cfg.yaml --no-progress n=16`)
        if ns.command in ("train", "plan", "preflight", "probe") and all(
            "=" in e and not e.startswith("-") for e in extra
        ):
            ns.overrides = [*ns.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command is None:
        ns = parser.parse_args(["train", *(argv or [])])
    commands = {
        "train": _train,
        "eval": _eval,
        "probe": _probe,
        "seeds": _seeds,
        "plan": _plan,
        "preflight": _preflight,
        "config": _config,
        "analyze": _analyze,
        "export": _export,
    }
    if ns.command not in commands:
        parser.error(f"unknown command {ns.command!r}")
    if ns.command == "train" or threading.current_thread() is not threading.main_thread():
        return commands[ns.command](ns)  # graft train handles SIGTERM itself (the step finishes, then a checkpoint)
    # SIGTERM as Ctrl-C: each command's interrupt handling runs (one line, temporary directories removed)
    previous = signal.signal(signal.SIGTERM, _terminated)
    _Signal.received = None
    try:
        return _exit_code(commands[ns.command](ns))
    except KeyboardInterrupt:  # one that arrived outside a command's own handling (e.g. while printing)
        print(f"\ngraft {ns.command}: interrupted", file=sys.stderr)
        return _exit_code(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Signal:
    """The signal that interrupted a command (SIGTERM raises KeyboardInterrupt, as Ctrl-C does)."""

    received: int | None = None


def _terminated(signum, frame):
    _Signal.received = signum
    raise KeyboardInterrupt("terminated (SIGTERM)")


def _exit_code(rc: int) -> int:
    """A command's exit code; an interrupted one exits 128 + the signal (143 for SIGTERM, 130 for
    SIGINT), which batch schedulers (Slurm requeue, Kubernetes) read."""
    if rc == 130 and _Signal.received is not None:
        return 128 + _Signal.received
    return rc


_OOM = ("can't allocate memory", "Cannot allocate memory", "out of memory", "CUDA out of memory")


def _out_of_memory(exc: BaseException) -> str | None:
    """One line for a process out of memory (``MemoryError``, or torch's allocator failing), else None."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not isinstance(exc, MemoryError) and not any(k in str(exc) for k in _OOM):
        return None
    return (
        f"out of memory ({text[:160]}); lower prompt_batch, n, max_new_tokens or policies.N.micro_batch_tokens, "
        "or run where more memory is free (written results and checkpoints are intact)"
    )


def _seeds(ns) -> int:
    import json
    from pathlib import Path

    from graft_rl.commands.evaluate_cli import across_runs, print_across_runs

    try:
        res = across_runs(ns.runs, ns.baseline)
    except ValueError as exc:
        print(f"graft seeds: {exc}", file=sys.stderr)
        return 2
    print_across_runs(res)
    if ns.json:
        from graft_rl.engine.rundir import write_text_atomic

        try:
            write_text_atomic(Path(ns.json), json.dumps(res, indent=1))
        except OSError as exc:
            print(f"graft seeds: {_write_failed(exc)}", file=sys.stderr)
            return 2
    return 0


#: OS errors of a write that failed (a full disk, a read-only directory, a quota, a file too large).
_WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG)


def _write_failed(exc: OSError) -> str:
    """One line for an OSError: for a write that failed (a full disk, a read-only directory), where and why."""
    where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
    if exc.errno not in _WRITE_ERRNOS:
        return f"{where}{exc.strerror or exc}"
    return f"cannot write {where}{exc.strerror or exc}; free space or write elsewhere (earlier results are intact)"


def _plan(ns) -> int:
    from graft_rl.commands.plan import eval_estimate, format_pace, format_plan, plan
    from graft_rl.engine.config import ConfigError, load_config

    try:
        cfg = load_config(ns.config, ns.overrides)
        if ns.gpus is not None and ns.gpus < len(cfg.policies):
            raise ConfigError(f"--gpus must be at least the number of policies ({len(cfg.policies)}), got {ns.gpus}")
        print(format_plan(plan(cfg), ns.gpu_memory, shared=cfg.execution == "local"))
        print("\n" + format_pace(cfg, ns.gpus, ns.gpu_memory))
        if ns.gpus is not None:
            from graft_rl.commands.pace import format_schedules

            print("\n" + format_schedules(cfg, ns.gpus, ns.gpu_memory))
        line = eval_estimate(cfg)
        if line:
            print("\n" + line)
    except ConfigError as exc:
        print(f"graft plan: {exc}", file=sys.stderr)
        return 2
    return 0


def _config(ns) -> int:
    from graft_rl.commands.keys import show
    from graft_rl.errors import ConfigError

    try:
        if ns.action == "list":
            from graft_rl.commands.keys import preset_listing

            print(preset_listing())
        elif ns.action == "init" and ns.source is not None:
            from graft_rl.commands.starter import write_from_preset

            if ns.data or ns.reward or ns.models:
                raise ConfigError(
                    "graft config init: --from copies a preset as it is; edit --data/--reward/--models in it"
                )
            out = write_from_preset(ns.what or "graft.yaml", ns.source, ns.force)
            print(f"graft config init: wrote {out} from {ns.source}; edit it, then: graft train {out}")
        elif ns.action == "init":
            from graft_rl.commands.starter import write_starter

            out = write_starter(ns.what or "graft.yaml", ns.data, ns.reward, ns.models, ns.force)
            print(f"graft config init: wrote {out}; edit it, then: graft probe {out}")
        else:
            print(show(ns.what, ns.plugins))
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    return 0


def _analyze(ns) -> int:
    from graft_rl.commands.analyze import AnalysisError, analyze, print_summary
    from graft_rl.engine.rundir import RunDirError
    from graft_rl.engine.store import RecordError

    try:
        print_summary(analyze(ns.run_dir, ns.compare, ns.out, ns.cases))
    except (AnalysisError, RunDirError, RecordError) as exc:  # e.g. a damaged log line or record file
        print(f"graft analyze: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk under --out (the run's own files are only read)
        print(f"graft analyze: {_write_failed(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngraft analyze: interrupted (the run is untouched; its analysis may be incomplete)", file=sys.stderr)
        return 130
    return 0


def _export(ns) -> int:
    from graft_rl.commands.export import export_merged
    from graft_rl.data import DatasetError
    from graft_rl.policy import PolicyError

    try:
        for name, where in export_merged(ns.target, ns.merged, ns.policy):
            print(f"graft export: {name} -> {where}")
    except (PolicyError, DatasetError) as exc:
        print(f"graft export: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"graft export: {_write_failed(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
