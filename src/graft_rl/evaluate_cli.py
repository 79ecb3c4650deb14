"""``graft eval``: pass@1 (and pass@k) on the paper's benchmarks, mean ± std over runs.

Paper Section 5.1 / Appendix B: temperature 0.6, top-p 0.95, 8 samples per problem, pass@1
averaged over samples then problems, the aggregate is the unweighted mean of the five
benchmarks, and each model is evaluated over 5 runs with different seeds (mean ± std).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from graft_rl.data import BENCHMARKS, BUILTIN, TESTBED_DATA, DatasetError, load_dataset, verifier_for
from graft_rl.evaluation import evaluate_policy, pass_at_k
from graft_rl.policy import Policy, PolicyConfig

__all__ = ["resolve_targets", "run_eval", "eval_defaults", "PAPER"]


def resolve_targets(target: str, policy: str | None = None, **overrides) -> list[PolicyConfig]:
    """Policy configs to evaluate: a run directory (its best checkpoints, else the latest), or one model."""
    path = Path(target).expanduser()
    if (path / "config.yaml").is_file():
        from graft_rl.config import load_config

        cfg = load_config(path / "config.yaml", [f"run_dir={path}"])
        ckpts = sorted(p for p in (path / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())
        out = []
        for pc in cfg.policies:
            if policy and pc.name != policy:
                continue
            best = path / "best" / pc.name
            model = best if (best / "config.json").is_file() else (ckpts[-1] / pc.name if ckpts else None)
            if model is None:
                raise DatasetError(f"{path}: run has no checkpoint of policy {pc.name!r} to evaluate")
            out.append(replace(pc, model=str(model), gguf_file=None, tokenizer=None, backend="hf", **overrides))
        if not out:
            raise DatasetError(f"{path}: no policy named {policy!r} (have: {', '.join(p.name for p in cfg.policies)})")
        return out
    return [PolicyConfig(name=policy or Path(target).name or target, model=target, **overrides)]


def _benchmarks(names: list[str]) -> dict[str, str]:
    out = {}
    named = {**BUILTIN, **TESTBED_DATA}
    for name in names:
        if name in named or Path(name).expanduser().suffix == ".jsonl" or name.startswith("reasoning_gym:"):
            out[Path(name).stem if name not in named else name] = name
        else:
            raise DatasetError(f"unknown benchmark {name!r}; available: {', '.join(named)}, or a path to a .jsonl file")
    return out


#: The paper's evaluation protocol (Section 5.1 / Appendix B): what `graft eval MODEL` uses.
PAPER = {"benchmarks": list(BENCHMARKS), "samples": 8, "runs": 5, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 4096}


def eval_defaults(target: str) -> tuple[dict, str]:
    """Settings `graft eval` uses when not given: a run directory's own validation task and lengths
    (its held-out set, sampling and ``max_new_tokens``; the paper's five benchmarks for math runs),
    else the paper's protocol. Returns ``(settings, where they came from)``."""
    cfg_file = Path(target).expanduser() / "config.yaml"
    if not cfg_file.is_file():
        return dict(PAPER), "the paper's protocol"
    from graft_rl.config import load_config

    v = load_config(cfg_file, [f"run_dir={Path(target)}"]).validation
    out = dict(PAPER)
    if v.data:
        out.update(benchmarks=list(v.data), temperature=v.temperature, top_p=v.top_p, max_new_tokens=v.max_new_tokens)
    return out, f"the run's validation settings ({cfg_file})"


def _context_length(pol: Policy) -> int | None:
    c = getattr(getattr(pol, "model", None), "config", None)
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


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
) -> dict:
    """Evaluate every target policy; write ``eval.json`` and ``eval.md``; return the results.

    Settings left ``None`` come from :func:`eval_defaults`. A ``max_new_tokens`` beyond a model's
    context is clamped to what its longest prompt leaves, with one line saying so.
    """
    from tqdm.auto import tqdm

    defaults, source = eval_defaults(target)
    benchmarks = list(benchmarks) if benchmarks else defaults["benchmarks"]
    samples = samples or defaults["samples"]
    runs = runs or defaults["runs"]
    temperature = defaults["temperature"] if temperature is None else temperature
    top_p = defaults["top_p"] if top_p is None else top_p
    max_new_tokens = max_new_tokens or defaults["max_new_tokens"]
    if show:
        print(f"graft eval: {', '.join(benchmarks)}; {samples} samples x {runs} runs, T={temperature}, top-p={top_p}, "
              f"max_new_tokens={max_new_tokens}" + (f", first {limit} problems" if limit else "") + f" (defaults: {source})")
    bench = _benchmarks(benchmarks)
    data = {label: load_dataset(name, limit) for label, name in bench.items()}
    targets = resolve_targets(target, policy, **(policy_overrides or {}))
    results: dict = {"target": target, "samples": samples, "runs": runs, "temperature": temperature, "top_p": top_p,
                     "limit": limit, "max_new_tokens": max_new_tokens, "policies": {}}
    for pc in targets:
        pol = Policy(pc)
        per: dict = {}
        bar = tqdm(total=len(data) * runs, desc=f"graft eval {pc.name}", unit="run", disable=not show)
        for label, problems in data.items():
            name = bench[label]
            budget = max_new_tokens
            ctx = _context_length(pol)
            if ctx is not None:
                longest = max(len(pol.prompt_token_ids(p.problem, p.id)) for p in problems)
                if longest + max_new_tokens > ctx:
                    budget = ctx - longest
                    if budget < 1:
                        raise ValueError(f"{pc.name}: {label} has a {longest}-token prompt, over the model's {ctx}-token context")
                    bar.write(f"graft eval: {pc.name} has a {ctx}-token context: max_new_tokens {max_new_tokens} -> {budget} "
                              f"on {label} (longest prompt {longest} tokens)")
            run_scores, pooled = [], [0] * len(problems)
            for r in range(runs):
                res = evaluate_policy(pol, problems, verifier_for(name, problems[0]), samples, temperature, top_p,
                                      budget, seed=1000 * r)
                bar.update(1)
                run_scores.append(res["pass@1"])
                pooled = [a + b for a, b in zip(pooled, res["correct"], strict=True)]
            total = samples * runs
            ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, total) if k <= total})
            per[label] = {
                "pass@1_mean": statistics.fmean(run_scores),
                "pass@1_std": statistics.stdev(run_scores) if runs > 1 else 0.0,
                "pass@1_runs": run_scores,
                "pass@k": {k: statistics.fmean(pass_at_k(total, c, k) for c in pooled) for k in ks},
                "problems": len(problems),
            }
        bar.close()
        means = [v["pass@1_mean"] for v in per.values()]
        agg_runs = [statistics.fmean(v["pass@1_runs"][r] for v in per.values()) for r in range(runs)]
        results["policies"][pc.name] = {
            "model": pc.model,
            "benchmarks": per,
            "average": statistics.fmean(means),
            "average_std": statistics.stdev(agg_runs) if runs > 1 else 0.0,
        }
    out = Path(out_dir) if out_dir else (Path(target) / "eval" if (Path(target) / "config.yaml").is_file() else Path("eval_results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(results, indent=1))
    md = _markdown(results, list(data))
    (out / "eval.md").write_text(md)
    if show:
        _print(results, list(data))
        print(f"written: {out / 'eval.json'}, {out / 'eval.md'}")
    return results


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
        cells = [f"{100 * p['benchmarks'][b]['pass@1_mean']:.2f} ± {100 * p['benchmarks'][b]['pass@1_std']:.2f}" for b in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * p['average']:.2f} ± {100 * p['average_std']:.2f} |")
    lines += ["", "pass@k (%) pooled over all samples of all runs:", ""]
    for name, p in res["policies"].items():
        for b in labels:
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
            *[f"{100 * p['benchmarks'][b]['pass@1_mean']:.2f} ± {100 * p['benchmarks'][b]['pass@1_std']:.2f}" for b in labels],
            f"{100 * p['average']:.2f} ± {100 * p['average_std']:.2f}",
        )
    Console().print(t)
