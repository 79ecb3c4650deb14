"""GRAFT vs baselines on the CPU testbed: held-out pass@1, training-pool coverage, wall time, rollouts.

Trains the testbed pair (graft_rl.testbed) on a fixed pool of prompts with each method for the
same number of steps and seeds, evaluates both models on held-out prompts (T=1, top-p 1,
``--eval-samples`` per prompt) before, during and after training, and writes:

- ``OUT/results.md``: per method and model, final held-out pass@1 mean ± std over seeds,
  Δ vs GRPO (n=8), training-pool coverage (prompts solved at least once), rollouts, wall time;
- ``OUT/curves.png``: held-out pass@1 vs step and vs wall time (mean over seeds);
- ``OUT/complementarity.md``: Fig. 1 at the start: fraction of one model's all-fail held-out
  prompts that the other solves at least once;
- ``OUT/runs/...``: every run directory (records, metrics, validation).

Reproduce (every method, 3 seeds, 5 epochs over a 256-prompt pool; 83 minutes measured on 2 cores
with two runs at a time, one thread each):
    python benchmarks/testbed.py --jobs 2
Methods available: see METHODS below (``--methods`` picks some). Finished runs are cached by
their ``done.json``; delete ``OUT/runs`` after changing the testbed or the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

METHODS: dict[str, dict] = {
    "grpo_n8": {"method": {"name": "grpo"}},
    "grpo_n16": {"method": {"name": "grpo"}, "n": 16},
    "grpo_n32": {"method": {"name": "grpo"}, "n": 32},
    "grpo_dynamic": {"method": {"name": "grpo", "dynamic_sampling": True}},
    "graft": {"method": {"name": "graft"}},
    "graft_stored": {"stored": True},  # each model replays the other's grpo_n8 records (same seed)
    "graft_no_gate": {"method": {"name": "graft", "gate": False}},
    "graft_no_floor": {"method": {"name": "graft", "floor": False}},
    "graft_no_balance": {"method": {"name": "graft", "balance": False}},
    "graft_seq_ratio": {"method": {"name": "graft", "ratio": "sequence"}},
    "graft_peer_first": {"method": {"name": "graft", "position": "first"}},
    "graft_per_char": {"method": {"name": "graft", "compatibility": "per_char"}},
    "sgt": {"method": {"name": "sgt"}},
    "hacpo": {"method": {"name": "hacpo", "kl_coef": 1e-3}},  # its recipe's KL; 4 minibatch updates per step
}


def run_one(
    tb,
    out: Path,
    method: str,
    seed: int,
    steps: int,
    eval_prompts: int,
    eval_samples: int,
    every: int,
    pool: int | None = None,
    threads: int | None = None,
) -> Path:
    if threads:
        import torch

        torch.set_num_threads(threads)
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    spec = METHODS[method]
    run_dir = out / "runs" / f"{method}_s{seed}"
    if (run_dir / "done.json").is_file():
        return run_dir
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    base = tb.train_config(run_dir=str(run_dir))
    base.update(seed=seed, steps=steps, checkpoint_every=steps)
    base["data"]["limit"] = pool
    base["validation"].update(every=every, samples=eval_samples, limit=eval_prompts, temperature=1.0, top_p=1.0)
    for k, v in spec.items():
        if k != "stored":
            base[k] = v
    t0 = time.perf_counter()
    if spec.get("stored"):
        peer_run = run_one(tb, out, "grpo_n8", seed, steps, eval_prompts, eval_samples, every, pool)
        policies = base["policies"]
        run_dir.mkdir(parents=True, exist_ok=True)
        for recv, peer in (("A", "B"), ("B", "A")):
            cfg = dict(
                base,
                run_dir=str(run_dir / recv),
                method={"name": "graft"},
                policies=[p for p in policies if p["name"] == recv],
                peers=[{"records": str(peer_run), "policy": peer}],
            )
            Trainer(load_config(cfg), show_progress=False).run()
    else:
        Trainer(load_config(base), show_progress=False).run()
    (run_dir / "done.json").write_text(json.dumps({"seconds": time.perf_counter() - t0}))
    return run_dir


def _logs(run_dir: Path, name: str) -> tuple[list[dict], list[dict], Path]:
    d = run_dir / name if (run_dir / name / "metrics.jsonl").is_file() else run_dir
    metrics = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = [json.loads(x) for x in (d / "validation.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in metrics if m["policy"] == name], [v for v in val if v["policy"] == name], d


def summarize(out: Path, methods: list[str], seeds: list[int], settings: str = "", epoch_steps: int = 8) -> None:
    from graft_rl.commands.analyze import PHASES
    from graft_rl.engine.store import RecordStore

    rows, curves = [], {}
    done_seeds = {m: [s for s in seeds if (out / "runs" / f"{m}_s{s}" / "done.json").is_file()] for m in methods}
    methods = [m for m in methods if done_seeds[m]]
    for method in methods:
        for name in ("A", "B"):
            finals, covs, walls, rolls, pool_r = [], [], [], [], []
            dynamic = METHODS[method].get("method", {}).get("dynamic_sampling", False)
            for seed in done_seeds[method]:
                m, v, d = _logs(out / "runs" / f"{method}_s{seed}", name)
                finals.append(v[-1]["val/score"])
                store = RecordStore(d)
                solved, seen = set(), set()
                for step in store.steps(name):
                    for g in store.read(name, step):
                        seen.add(g.prompt_id)
                        if any(r > 0 for r in g.rewards):
                            solved.add(g.prompt_id)
                if not dynamic:  # its records hold only kept groups
                    covs.append(len(solved) / max(len(seen), 1))
                walls.append(sum(x.get(k) or 0 for x in m for k in PHASES))
                rolls.append(sum(x["rollouts"] for x in m))
                # on-policy pool pass@1 over the last pass through the pool (own samples, T=1); not
                # comparable with dynamic sampling, whose logged batch is the filtered one
                if not dynamic:
                    pool_r.append(statistics.fmean(x["reward_mean"] for x in m[-epoch_steps:]))
                cum, wall_at = 0.0, {0: 0.0}
                for x in m:
                    cum += sum(x.get(k) or 0 for k in PHASES)
                    wall_at[x["step"]] = cum
                curves.setdefault((method, name), []).append(
                    [(x["step"], x["val/score"], wall_at.get(x["step"], cum)) for x in v]
                )
            rows.append((method, name, finals, covs, walls, rolls, pool_r))
    base = {name: statistics.fmean(f) for meth, name, f, *_ in rows if meth == "grpo_n8"}
    # before training, every method of a seed validates the same weights with the same sampling seed
    start = {
        name: statistics.fmean(curves[(methods[0], name)][i][0][1] for i in range(len(done_seeds[methods[0]])))
        for name in ("A", "B")
    }
    lines = [
        settings,
        "",
        f"Held-out pass@1 (T=1; seeds per method: {', '.join(f'{m} {done_seeds[m]}' for m in methods)}); start: "
        + ", ".join(f"{n} {100 * s:.1f}%" for n, s in start.items())
        + " (mean over seeds)",
        "",
        "| method | model | held-out pass@1 (mean ± std) | Δ vs GRPO n=8 | pool pass@1, last epoch | pool coverage | "
        "rollouts | train s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, name, finals, covs, walls, rolls, pool_r in rows:
        mean = statistics.fmean(finals)
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        delta = f"{100 * (mean - base[name]):+.1f}" if name in base else "-"
        lines.append(
            f"| {method} | {name} | {100 * mean:.1f} ± {100 * std:.1f} | {delta} | "
            f"{f'{100 * statistics.fmean(pool_r):.1f}%' if pool_r else '-'} | "
            f"{f'{100 * statistics.fmean(covs):.1f}%' if covs else '-'} | "
            f"{statistics.fmean(rolls):.0f} | {statistics.fmean(walls):.0f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(out, curves, rows)
    compatibility_summary(out, [m for m in ("graft", "graft_per_char") if m in methods], done_seeds)


def compatibility_summary(out: Path, methods: list[str], done_seeds: dict) -> None:
    """Token-mean vs per-character compatibility over every grafted peer response (mean over seeds)."""
    from graft_rl.commands.analyze import compatibility_stats
    from graft_rl.engine.store import RecordStore

    lines = [
        "| method (gate uses) | direction | peer responses / seed | s_token median [p10, p90] | s_char median [p10, p90] | "
        "s_token > 0.8 | s_char > 0.8 | admitted | admitted: correct / wrong |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method in methods:
        per_dir: dict = {}
        for seed in done_seeds[method]:
            rows = [r for r in RecordStore(out / "runs" / f"{method}_s{seed}").read_exchange() if not r["auxiliary"]]
            for d in sorted({(r["source"], r["receiver"]) for r in rows}):
                st = compatibility_stats([r for r in rows if (r["source"], r["receiver"]) == d])
                if st["n"]:
                    per_dir.setdefault(d, []).append(st)
        for (src, recv), sts in per_dir.items():

            def m(k, sts=sts):
                vals = [x[k] for x in sts if x[k] is not None]
                return statistics.fmean(vals) if vals else float("nan")

            rule = "per-char" if method == "graft_per_char" else "token-mean"
            lines.append(
                f"| {method} ({rule}) | {src}→{recv} | {m('n'):.0f} | {m('median_token'):.3f} [{m('p10_token'):.2f}, "
                f"{m('p90_token'):.2f}] | {m('median_char'):.3f} [{m('p10_char'):.2f}, {m('p90_char'):.2f}] | "
                f"{100 * m('pass_token'):.0f}% | {100 * m('pass_char'):.0f}% | {100 * m('admitted'):.0f}% | "
                f"{100 * m('admitted_correct'):.0f}% / {100 * m('admitted_wrong'):.0f}% |"
            )
    if len(lines) > 2:
        (out / "compatibility.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


def _plot(out: Path, curves: dict, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey="row")
    methods = list(dict.fromkeys(m for m, _ in curves))
    cmap = plt.get_cmap("tab20")
    color = {m: cmap(i % 20) for i, m in enumerate(methods)}
    for col, name in enumerate(("A", "B")):
        for (method, n), runs in curves.items():
            if n != name:
                continue
            style = {"color": color[method], "linestyle": "--" if method.startswith("grpo") else "-"}
            steps = [s for s, _, _ in runs[0]]
            means = [statistics.fmean(r[i][1] for r in runs) for i in range(len(steps))]
            walls = [statistics.fmean(r[i][2] for r in runs) for i in range(len(steps))]
            axes[0, col].plot(steps, [100 * m for m in means], marker="o", label=method, **style)
            axes[1, col].plot(walls, [100 * m for m in means], marker="o", label=method, **style)
        axes[0, col].set_title(f"model {name}: held-out pass@1 vs step")
        axes[0, col].set_xlabel("training step")
        axes[1, col].set_title(f"model {name}: held-out pass@1 vs training wall time")
        axes[1, col].set_xlabel("seconds (generate + reward + score + update, this model)")
        for row in range(2):
            axes[row, col].grid(alpha=0.3)
    for row in range(2):
        axes[row, 0].set_ylabel("pass@1 (%)")
    axes[0, 1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)


def complementarity(tb, out: Path, eval_prompts: int, eval_samples: int) -> None:
    from graft_rl.data import load_jsonl
    from graft_rl.engine.evaluation import evaluate_policy
    from graft_rl.policy import Policy, PolicyConfig

    held = load_jsonl(tb.eval_file)[:eval_prompts]
    correct = {}
    for d in tb.policy_dicts():
        pol = Policy(PolicyConfig(**d))
        correct[d["name"]] = evaluate_policy(pol, held, "gsm8k", eval_samples, 1.0, 1.0, 40)["correct"]
    lines = ["| receiver | all-fail prompts | peer solves ≥1 | fraction |", "|---|---:|---:|---:|"]
    for r, p in (("A", "B"), ("B", "A")):
        fails = [i for i, c in enumerate(correct[r]) if c == 0]
        solved = sum(1 for i in fails if correct[p][i] > 0)
        lines.append(f"| {r} (peer {p}) | {len(fails)} | {solved} | {solved / max(len(fails), 1):.2f} |")
    text = (
        f"Complementarity at the start (Fig. 1), {len(held)} held-out prompts × {eval_samples} samples, T=1:\n\n"
        + "\n".join(lines)
    )
    (out / "complementarity.md").write_text(text + "\n")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pool", type=int, default=256, help="training pool: the first N training prompts (0 = all 1000)")
    ap.add_argument("--every", type=int, default=20, help="validation every N steps")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cores/jobs torch threads)")
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--out", default="docs/testbed")
    ap.add_argument("--summarize-only", action="store_true")
    args = ap.parse_args()
    from graft_rl.testbed import shipped_testbed

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tb = shipped_testbed()  # the pair every machine shares
    if not args.summarize_only:
        if not (out / "complementarity.md").is_file():
            complementarity(tb, out, args.eval_prompts, args.eval_samples)
        run_all(tb, out, args)
    settings = (
        f"{args.steps} steps of 32 prompts x n (8 unless named) on a pool of {args.pool or 'all'} training prompts "
        f"({args.steps * 32 / (args.pool or 1000):.1f} epochs); held-out: {args.eval_prompts} prompts x "
        f"{args.eval_samples} samples every {args.every} steps."
    )
    summarize(out, args.methods, args.seeds, settings, epoch_steps=-(-(args.pool or 1000) // 32))


def run_all(tb, out: Path, args) -> None:
    """Every (method, seed) run, ``args.jobs`` at a time; a stored-peer run starts once its peer's run is done."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    from tqdm import tqdm

    pool = args.pool or None
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    common = (args.steps, args.eval_prompts, args.eval_samples, args.every, pool, threads)
    # costly runs first, so the last minutes are not one long run alone
    order = sorted(args.methods, key=lambda m: (m != "grpo_n8", -METHODS[m].get("n", 8)))
    waiting = [(m, s) for s in args.seeds for m in order if METHODS[m].get("stored")]
    ready = [(m, s) for m in order for s in args.seeds if not METHODS[m].get("stored")]
    with (
        cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex,
        tqdm(total=len(waiting) + len(ready), desc="testbed runs", unit="run") as bar,
    ):
        running = {ex.submit(run_one, tb, out, m, s, *common): (m, s, time.perf_counter()) for m, s in ready}
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                m, s, t0 = running.pop(fut)
                fut.result()
                bar.update()
                tqdm.write(f"{m} seed {s}: {time.perf_counter() - t0:.0f}s (queued + run)", file=sys.stderr)
                if m == "grpo_n8":
                    for wm, ws in [w for w in waiting if w[1] == s]:
                        waiting.remove((wm, ws))
                        running[ex.submit(run_one, tb, out, wm, ws, *common)] = (wm, ws, time.perf_counter())
        for wm, ws in waiting:  # grpo_n8 not among --methods: run_one trains it first
            run_one(tb, out, wm, ws, *common)
            bar.update()


if __name__ == "__main__":
    main()
