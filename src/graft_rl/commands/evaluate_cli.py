"""``graft eval``: pass@1 (and pass@k) on the paper's benchmarks, mean ± std over runs.

Paper Section 5.1 / Appendix B: temperature 0.6, top-p 0.95, 8 samples per problem, pass@1
averaged over samples then problems, the aggregate is the unweighted mean of the five
benchmarks, and each model is evaluated over 5 runs with different seeds (mean ± std).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from graft_rl.data import (
    BENCHMARKS,
    BUILTIN,
    TESTBED_DATA,
    DatasetError,
    check_answers,
    default_reward,
    load_dataset,
    verifier_for,
)
from graft_rl.engine.evaluators import close_evaluators, evaluate_benchmarks, start_evaluators
from graft_rl.engine.rundir import manifest_problem
from graft_rl.policy import PolicyConfig, saved_policy_config
from graft_rl.rewards import Reward, resolve_reward

__all__ = ["resolve_targets", "run_eval", "eval_defaults", "default_replicas", "PAPER"]


def _run_dir_of(model_dir: Path) -> tuple[Path, str] | None:
    """``(run directory, policy name)`` for ``RUN/best/NAME`` or ``RUN/checkpoints/step_N/NAME``."""
    parent = model_dir.parent
    if parent.name == "best":
        run = parent.parent
    elif parent.name.startswith("step_") and parent.parent.name == "checkpoints":
        run = parent.parent.parent
    else:
        return None
    return (run, model_dir.name) if (run / "config.yaml").is_file() else None


def resolve_targets(target: str, policy: str | None = None, **overrides) -> list[PolicyConfig]:
    """Policy configs to evaluate, each run as one process (``world_size`` 1; spreading over devices is
    ``replicas``' job): a run directory (its best checkpoints, else the latest) with each policy's own
    prompt format, lengths, dtype and rollout backend; a checkpoint directory, with the settings it was
    saved with (``graft_policy.json``, else its run's config); or a model."""
    # absolute: a Ray replica works in the directory its raylet was started from, not this one
    path = Path(target).expanduser().resolve() if Path(target).expanduser().exists() else Path(target).expanduser()
    one = {"gguf_file": None, "tokenizer": None, "world_size": 1, "reference_model": None, "reference_gguf_file": None}
    if (path / "config.yaml").is_file():
        from graft_rl.engine.config import load_config

        cfg = load_config(path / "config.yaml", [f"run_dir={path}"], saved=True)
        out = [
            replace(pc, **{**one, "model": str(_run_checkpoint(path, pc.name)), **overrides})
            for pc in cfg.policies
            if not policy or pc.name == policy
        ]
        if not out:
            raise DatasetError(f"{path}: no policy named {policy!r} (have: {', '.join(p.name for p in cfg.policies)})")
        return out
    if path.is_dir():  # a checkpoint's policy directory, or best/<policy>, named by the user: its files as
        # written? (one without a manifest, from before manifests existed, is evaluated as given)
        problem = manifest_problem(path) or manifest_problem(path.parent, only=path.name)
        if problem is not None:
            raise DatasetError(f"{path}: {problem}; not evaluated")
    saved = saved_policy_config(path, **{k: v for k, v in one.items() if k != "world_size"}, **overrides)
    if saved is not None:
        return [replace(saved, name=policy or saved.name)]
    owner = _run_dir_of(path) if path.is_dir() else None
    if owner is not None:  # a checkpoint saved before graft_policy.json existed: its run's config
        run, name = owner
        from graft_rl.engine.config import load_config

        pcs = [
            pc for pc in load_config(run / "config.yaml", [f"run_dir={run}"], saved=True).policies if pc.name == name
        ]
        if pcs:
            return [replace(pcs[0], **{**one, "model": str(path), **overrides})]
    return [PolicyConfig(name=policy or Path(target).name or target, model=target, **overrides)]


def _run_checkpoint(run: Path, name: str) -> Path:
    """The checkpoint of policy ``name`` a run directory is evaluated with: its ``best/<name>`` when the
    run validated it, else (a run without validation) its latest checkpoint. Never another one in its
    place: a best/ that is missing, damaged, a symbolic link or of another step than ``best.json``
    names is one line naming what to evaluate instead."""
    from graft_rl.engine.rundir import manifest_step, run_identity

    best = run / "best" / name
    try:
        named = json.loads((run / "best" / "best.json").read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        named = None
    ckpts = sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())
    instead = (
        f"evaluate an intact checkpoint explicitly, e.g. graft eval {ckpts[-1] / name}" if ckpts else "resume the run"
    )
    rid = run_identity(run, create=False)
    if best.is_symlink():
        raise DatasetError(f"{best} is a symbolic link, not the best checkpoint the run wrote; {instead}")
    if best.exists() or named:
        step = named.get("step") if isinstance(named, dict) else None
        if not (best / "config.json").is_file() and not (best / "adapter_config.json").is_file():
            what = f"best.json names step {step}, but best/{name} is missing or incomplete"
            raise DatasetError(f"{run}: {what}; not evaluated ({instead})")
        problem = manifest_problem(best, required=True, run=rid)
        if problem is None and step is not None and manifest_step(best) not in (None, step):
            problem = f"it holds step {manifest_step(best)}'s weights, best.json names step {step}"
        if problem is not None:
            raise DatasetError(f"{best}: {problem}; not evaluated ({instead})")
        return best
    if not ckpts:
        raise DatasetError(f"{run}: run has no checkpoint of policy {name!r} to evaluate")
    problem = manifest_problem(ckpts[-1], only=name, required=True, run=rid)
    if problem is not None:  # weights that are not what the run wrote are never evaluated
        raise DatasetError(
            f"{ckpts[-1] / name}: {problem}; not evaluated (evaluate an intact checkpoint directory instead)"
        )
    return ckpts[-1] / name


def default_replicas(target: str, policy: PolicyConfig) -> int:
    """The devices a run trained on (the sum of its policies' ``world_size`` under ``execution: ray``):
    evaluation runs one policy at a time, so each may use all of them. Else 1 (in-process)."""
    cfg_file = Path(target).expanduser() / "config.yaml"
    if not cfg_file.is_file():
        return 1
    from graft_rl.engine.config import load_config

    cfg = load_config(cfg_file, [f"run_dir={target}"], saved=True)
    return cfg.devices


def _benchmarks(items: list, target: str, reward=None) -> dict[str, dict]:
    """Each benchmark as ``label -> {data, reward, columns}``. Items: built-in names, paths,
    ``hf:``/``reasoning_gym:`` specs, or a run's validation sets (mappings). A set's reward: its own,
    else ``reward`` (given to ``run_eval``/``--reward``), else its dataset's verifier, else the run's
    ``data.reward`` (``target`` a run directory), else math. A file without columns of its own is read
    with the run's ``data.columns`` (a held-out file with the training file's column names)."""
    from graft_rl.engine.config import ValidationConfig, load_config

    cfg_file = Path(target).expanduser() / "config.yaml"
    run = load_config(cfg_file, [f"run_dir={Path(target)}"], saved=True).data if cfg_file.is_file() else None
    named = {**BUILTIN, **TESTBED_DATA}
    out: dict[str, dict] = {}
    for vs in ValidationConfig(data=list(items)).sets():
        name = vs["data"]
        local = Path(name).expanduser()
        if not (name in named or name.startswith(("reasoning_gym:", "hf:")) or local.suffix or local.is_dir()):
            raise DatasetError(
                f"unknown benchmark {name!r}; available: {', '.join(named)}, or a path to a data file, hf:ORG/NAME, "
                "or reasoning_gym:NAME"
            )
        spec = vs["reward"] or reward or default_reward(name)
        if spec is None and run is not None and run.reward != "auto":
            spec = run.reward
        if isinstance(spec, str) and spec.startswith("python:"):
            raise DatasetError(
                f"{target}: its reward {spec} was a Python function; evaluate from Python with run_eval(..., reward=FUNCTION)"
            )
        threshold = run.success_threshold if run is not None else 1.0
        # a file of the user's own named on the command line, without our column names: the run's
        fallback = run.columns if run is not None and name not in named and not vs["columns"] else None
        out[vs["name"]] = {
            "data": name,
            "reward": resolve_reward(spec or "math", threshold),
            "columns": vs["columns"],
            "run_columns": fallback or None,
        }
    return out


def _load_benchmarks(items, target, reward, limit) -> tuple[dict, dict]:
    """The benchmarks (:func:`_benchmarks`) and their problems, each checked against its reward."""
    bench = _benchmarks(items, target, reward)
    data = {}
    for label, b in bench.items():
        try:
            data[label] = load_dataset(b["data"], limit, b["columns"])
        except DatasetError as exc:
            if not b["run_columns"] or "row has no" not in str(exc):
                raise
            data[label] = load_dataset(b["data"], limit, b["run_columns"])  # the training file's column names
    for label, b in bench.items():
        if b["reward"].builtin:
            check_answers(data[label], b["reward"].target, b["data"])
    return bench, data


#: The paper's evaluation protocol (Section 5.1 / Appendix B): what `graft eval MODEL` uses.
PAPER = {
    "benchmarks": list(BENCHMARKS),
    "samples": 8,
    "runs": 5,
    "temperature": 0.6,
    "top_p": 0.95,
    "max_new_tokens": 4096,
}


def eval_defaults(target: str) -> tuple[dict, str]:
    """Settings `graft eval` uses when not given: a run directory's own validation task and lengths
    (its held-out set, sampling and ``max_new_tokens``; the paper's five benchmarks for math runs),
    else the paper's protocol. Returns ``(settings, where they came from)``."""
    cfg_file = Path(target).expanduser() / "config.yaml"
    if not cfg_file.is_file():
        return dict(PAPER), "the paper's protocol"
    from graft_rl.engine.config import load_config

    cfg = load_config(cfg_file, [f"run_dir={Path(target)}"], saved=True)
    v = cfg.validation
    out = dict(PAPER)
    reward = cfg.data.reward if cfg.data.reward != "auto" else verifier_for(cfg.data.train)
    if not v.data and reward != "math":
        out["benchmarks"] = None  # run_eval asks for --benchmarks: the math benchmarks do not fit this task
        return out, (
            f"{target} was trained without validation (validation.data is empty) on {cfg.data.train}, scored by "
            f"{reward}, so the paper's math benchmarks do not fit it: name what to evaluate on with "
            f"--benchmarks (a held-out file, hf:..., or a built-in name)"
        )
    if v.data:
        out.update(benchmarks=list(v.data), temperature=v.temperature, top_p=v.top_p, max_new_tokens=v.max_new_tokens)
    return out, f"the run's validation settings ({cfg_file})"


def _print_header(target: str, labels: list[str], settings: str, source: str, targets: list[PolicyConfig]) -> None:
    """What is evaluated: the benchmarks' labels (a run's validation sets may be mappings), the settings
    and where they came from, and for a run directory the checkpoint each policy is evaluated with."""
    print(f"graft eval: {', '.join(labels)}; {settings} (defaults: {source})")
    if (Path(target).expanduser() / "config.yaml").is_file():
        for pc in targets:
            print(f"graft eval: {pc.name}: {_which_checkpoint(Path(pc.model))}")


def _which_checkpoint(model: Path) -> str:
    """Which of a run's checkpoints a policy is evaluated with, and why, for the header."""
    step = _checkpoint_step(str(model))
    at = f" (step {step})" if step is not None else ""
    if model.parent.name == "best":
        return f"{model}{at}, the best validation checkpoint"
    return f"{model}{at}, the latest checkpoint: the run has no best/ (it did not validate)"


def _checkpoint_step(model: str) -> int | None:
    """The training step of a checkpoint's weights (its manifest's, or its directory's name), else None."""
    from graft_rl.engine.rundir import manifest_step

    path = Path(model)
    if not path.is_dir():
        return None
    step = manifest_step(path) if (path / "manifest.json").exists() else manifest_step(path.parent)
    if step is None and path.parent.name.startswith("step_") and path.parent.name[5:].isdigit():
        step = int(path.parent.name[5:])
    return step


def _default_benchmarks(defaults: dict, source: str) -> list[str]:
    if defaults["benchmarks"] is None:  # a run without validation on a task the math benchmarks do not fit
        raise DatasetError(source)
    return defaults["benchmarks"]


def _check_counts(**counts: int | None) -> None:
    """Each count given is >= 1 (0 would silently mean "the default", or one problem): one line naming the flag."""
    for key, value in counts.items():
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")


def run_eval(
    target: str,
    benchmarks: Sequence[str] | None = None,
    samples: int | None = None,
    runs: int | None = None,
    limit: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    policy: str | None = None,
    out_dir: str | None = None,
    policy_overrides: dict | None = None,
    show: bool = True,
    replicas: int | None = None,
    reward: str | Callable | Reward | None = None,
) -> dict:
    """Evaluate every target policy; write ``eval.json`` and ``eval.md``; return the results.

    ``reward``: how responses are scored where a benchmark names no reward of its own (a name,
    ``module:function``, or a Python function ``(responses, problems) -> list[float]``; docs/tasks.md);
    default: a built-in set's own verifier, else the run's ``data.reward``.

    Settings left ``None`` come from :func:`eval_defaults`. A ``max_new_tokens`` beyond a model's
    context is clamped to what its longest prompt leaves, with one line saying so. ``replicas``
    (default: the devices the run trained on, :func:`default_replicas`) spreads the work
    over that many Ray actors, each a whole model with its own rollout engine (one GPU each): the
    problems go out in chunks of :data:`~graft_rl.engine.evaluation.EVAL_CHUNK`, each sampled with the seed
    one process would give it, so the scores do not depend on how many replicas ran them.
    """
    from tqdm.auto import tqdm

    _check_counts(samples=samples, runs=runs, limit=limit, max_new_tokens=max_new_tokens, world_size=replicas)
    defaults, source = eval_defaults(target)
    benchmarks = list(benchmarks) if benchmarks else _default_benchmarks(defaults, source)
    samples = samples or defaults["samples"]
    runs = runs or defaults["runs"]
    temperature = defaults["temperature"] if temperature is None else temperature
    top_p = defaults["top_p"] if top_p is None else top_p
    max_new_tokens = max_new_tokens or defaults["max_new_tokens"]
    bench, data = _load_benchmarks(benchmarks, target, reward, limit)
    targets = resolve_targets(target, policy, **(policy_overrides or {}))
    if show:
        header = f"{samples} samples x {runs} runs, T={temperature}, top-p={top_p}, max_new_tokens={max_new_tokens}"
        _print_header(target, list(bench), header + (f", first {limit} problems" if limit else ""), source, targets)
    out = (
        Path(out_dir)
        if out_dir
        else (Path(target) / "eval" if (Path(target) / "config.yaml").is_file() else Path("eval_results"))
    )
    _check_writable(out)  # before any evaluation: results are never computed only to be lost
    results: dict = {
        "target": target,
        "samples": samples,
        "runs": runs,
        "temperature": temperature,
        "top_p": top_p,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "complete": False,
        "policies": {},
    }
    try:
        _evaluate_targets(
            targets,
            target,
            replicas,
            data,
            bench,
            samples,
            runs,
            temperature,
            top_p,
            max_new_tokens,
            show,
            tqdm,
            results,
            out,
        )
    except KeyboardInterrupt:
        done = ", ".join(results["policies"]) or "none"
        raise EvalInterrupted(f"interrupted; finished policies ({done}) written to {out / 'eval.json'}") from None
    results["complete"] = True
    _write_results(out, results, list(data), show)
    results.pop("_said", None)
    results.pop("_written", None)
    if show:
        _print(results, list(data))
        print(f"written: {out / 'eval.json'}, {out / 'eval.md'}")
    return results


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``graft eval``: what finished is written; the message says where."""


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (eval.json and eval.md are written in it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"cannot write results to {out} ({exc.strerror or exc}); give another directory with --out"
        ) from None


def _write_results(out: Path, results: dict, labels: list[str], show: bool = True) -> None:
    """eval.json and eval.md, each whole or not at all (written after every finished policy), merged
    under a lock with what an earlier or concurrent ``graft eval`` wrote there (:func:`merge_eval`):
    every policy and benchmark evaluated is kept; what this call replaces is said once."""
    from graft_rl.commands.results import locked, merge_eval, read_results
    from graft_rl.engine.rundir import write_text_atomic

    path = out / "eval.json"
    with locked(path):
        old, unreadable = read_results(path)
        written = results.setdefault("_written", set())  # the policies this command wrote here already
        merged, notes = merge_eval(old, results, written)
        written.update(results["policies"])
        others = [b for e in merged["policies"].values() for b in e["benchmarks"] if b not in labels]
        write_text_atomic(path, json.dumps(merged, indent=1))
        write_text_atomic(out / "eval.md", _markdown(merged, [*labels, *dict.fromkeys(others)]))
    said = results.setdefault("_said", set())  # this call's notes, printed once
    for note in ([unreadable] if unreadable else []) + notes:
        if note not in said and show:
            print(f"graft eval: {out / 'eval.json'}: {note}")
        said.add(note)


def _evaluate_targets(
    targets, target, replicas, data, bench, samples, runs, temperature, top_p, max_new_tokens, show, tqdm, results, out
) -> None:
    for pc in targets:
        if pc.backend == "vllm" and "sleep" not in pc.vllm_kwargs:
            # nothing trains beside an eval engine: it never sleeps, so vLLM's one sleep-mode engine per
            # process does not bind, and policies evaluated one after another in this process each get one
            pc = replace(pc, vllm_kwargs={**pc.vllm_kwargs, "sleep": False})
        W = replicas or default_replicas(target, pc)
        workers, actors = start_evaluators(target, pc, W)
        W = len(workers)  # the replicas that fit the nodes the policy is pinned to
        if show and actors:
            print(f"graft eval: {pc.name} on {W} Ray actors ({pc.backend} backend, device {pc.device})")
        try:
            per = evaluate_benchmarks(
                pc, workers, actors, data, bench, samples, runs, temperature, top_p, max_new_tokens, show, tqdm
            )
        finally:
            close_evaluators(workers, actors)  # gone before the next policy's engines start on the same devices
        means = [v["pass@1_mean"] for v in per.values()]
        agg_runs = [statistics.fmean(v["pass@1_runs"][r] for v in per.values()) for r in range(runs)]
        results["policies"][pc.name] = {
            "model": pc.model,
            "step": _checkpoint_step(pc.model),  # with the model, which weights these are (merge_eval)
            "backend": pc.backend,
            "replicas": W,
            "benchmarks": per,
            "average": statistics.fmean(means),
            "average_std": statistics.stdev(agg_runs) if runs > 1 else 0.0,
        }
        _write_results(out, results, list(data), show)  # a later interruption keeps this policy's results


def _markdown(res: dict, labels: list[str]) -> str:
    head = "| policy | " + " | ".join(labels) + " | average |"
    lines = [
        f"pass@1 (%), mean ± std over {res['runs']} runs of {res['samples']} samples per problem, "
        f"T={res['temperature']}, top-p={res['top_p']}" + (f", first {res['limit']} problems" if res["limit"] else ""),
        "",
        head,
        "|---|" + "---:|" * (len(labels) + 1),
    ]
    for name, p in res["policies"].items():
        cells = [
            f"{100 * p['benchmarks'][b]['pass@1_mean']:.2f} ± {100 * p['benchmarks'][b]['pass@1_std']:.2f}"
            if b in p["benchmarks"]
            else "—"
            for b in labels
        ]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {100 * p['average']:.2f} ± {100 * p['average_std']:.2f} |"
        )
    from graft_rl.commands.results import SETTINGS, settings_text

    top = {k: res.get(k) for k in SETTINGS}
    for name, p in res["policies"].items():
        if p.get("settings", top) != top:
            lines.append(f"\n{name} was evaluated with other settings: {settings_text(p['settings'])}.")
    lines += ["", "pass@k (%) pooled over all samples of all runs:", ""]
    for name, p in res["policies"].items():
        for b in [b for b in labels if b in p["benchmarks"]]:
            pk = p["benchmarks"][b]["pass@k"]
            lines.append(f"- {name} / {b}: " + ", ".join(f"pass@{k} {100 * v:.1f}" for k, v in pk.items()))
    return "\n".join(lines) + "\n"


def _print(res: dict, labels: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"graft eval: pass@1 (%), {res['runs']} runs × {res['samples']} samples")
    t.add_column("policy")
    for b in labels:
        t.add_column(b, justify="right")
    t.add_column("average", justify="right")
    for name, p in res["policies"].items():
        t.add_row(
            name,
            *[
                f"{100 * p['benchmarks'][b]['pass@1_mean']:.2f} ± {100 * p['benchmarks'][b]['pass@1_std']:.2f}"
                for b in labels
            ],
            f"{100 * p['average']:.2f} ± {100 * p['average_std']:.2f}",
        )
    Console().print(t)


# --------------------------------------------------------------------------- across training runs (Table 4)
def _eval_json(run: str | Path) -> dict:
    """A run's ``graft eval`` results: ``RUN/eval/eval.json`` (or an eval.json / its directory)."""
    p = Path(run)
    for cand in (p / "eval" / "eval.json", p / "eval.json", p):
        if cand.is_file():
            try:
                res = json.loads(cand.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"{cand}: not a readable eval.json ({exc})") from None
            if not res.get("complete"):
                raise ValueError(f"{cand}: an interrupted evaluation (complete: false); run graft eval {run} again")
            return res
    raise ValueError(f"{run}: no eval/eval.json (run `graft eval {run}` first)")


def across_runs(runs: Sequence[str | Path], baseline: Sequence[str | Path] = ()) -> dict:
    """Table 4: each policy's pass@1 as the mean and sample standard deviation over independent
    training runs (one ``graft eval`` per run: its best checkpoints), per benchmark and for the
    five-benchmark average; with ``baseline`` runs (GRPO n=8 in the paper), the same for them and Δ,
    the difference of the mean averages. Runs must have been evaluated on the same benchmarks."""

    def block(dirs):
        results = [_eval_json(d) for d in dirs]
        labels = None
        per: dict[str, dict[str, list[float]]] = {}
        for d, res in zip(dirs, results, strict=True):
            for name, p in res["policies"].items():
                bench = list(p["benchmarks"])
                if labels is None:
                    labels = bench
                elif set(bench) != set(labels):  # the order merged files keep may differ
                    raise ValueError(
                        f"{d}: policy {name} was evaluated on {', '.join(bench)}, the first run on {', '.join(labels)}"
                    )
                row = per.setdefault(name, {})
                for b in bench:
                    row.setdefault(b, []).append(p["benchmarks"][b]["pass@1_mean"])
                row.setdefault("average", []).append(p["average"])
        out = {}
        for name, row in per.items():
            n = len(row["average"])
            out[name] = {
                k: {"mean": statistics.fmean(v), "std": statistics.stdev(v) if n > 1 else 0.0, "runs": n}
                for k, v in row.items()
            }
        return out, labels or []

    if len(runs) < 1:
        raise ValueError("give at least one run directory")
    from graft_rl.commands.results import check_comparable

    check_comparable(runs, "the runs", [_eval_json(d) for d in runs])
    if baseline:
        check_comparable(baseline, "the baseline runs", [_eval_json(d) for d in baseline])
        both = [*runs, *baseline]
        check_comparable(both, "the runs and the baseline runs", [_eval_json(d) for d in both], ignore=("method",))
    method, labels = block(list(runs))
    res = {"runs": [str(r) for r in runs], "labels": labels, "policies": method}
    if baseline:
        base, base_labels = block(list(baseline))
        if set(base_labels) != set(labels):
            raise ValueError(
                f"the baseline runs were evaluated on {', '.join(base_labels)}, the runs on {', '.join(labels)}"
            )
        res["baseline_runs"] = [str(r) for r in baseline]
        res["baseline"] = base
        res["delta"] = {
            name: method[name]["average"]["mean"] - base[name]["average"]["mean"] for name in method if name in base
        }
    return res


def print_across_runs(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    labels = res["labels"] + ["average"]
    t = Table(title="pass@1 (%), mean ± sample std over training runs (Table 4)")
    t.add_column("policy")
    t.add_column("runs", justify="right")
    for b in labels:
        t.add_column(b, justify="right")
    if "delta" in res:
        t.add_column("Δ avg", justify="right")
    blocks = [("", res["policies"])] + ([(" (baseline)", res["baseline"])] if "baseline" in res else [])
    for suffix, block in blocks:
        for name, row in block.items():
            cells = [f"{100 * row[b]['mean']:.2f} ± {100 * row[b]['std']:.2f}" for b in labels]
            delta = (
                [f"{100 * res['delta'][name]:+.2f}" if not suffix and name in res["delta"] else ""]
                if "delta" in res
                else []
            )
            t.add_row(name + suffix, str(row["average"]["runs"]), *cells, *delta)
    Console().print(t)
