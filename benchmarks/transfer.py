"""Capability transfer on the constructed testbed pair: does a model learn the family it lacks?

The transfer pair (``graft_rl.testbed``, ``PAIRS["transfer"]``) is *constructed to expose the
mechanism*: A solves two-digit chains ``a+b-c`` (``add3_hi``) about half the time and almost never
``a*b+c`` with ``b`` in 6-9 (``muladd_hi``); B the other way round. On its missing family nearly all
of a model's groups fail, so GRPO gets (almost) no gradient there, while the peer's groups are
mixed. Each method trains the pair for the same steps and seeds on the same 600-prompt pool (both
families), validating 256 held-out prompts × 4 samples every ``--every`` steps (the curves), then
the last checkpoint is evaluated on 256 held-out prompts × 16 samples *per family* (the table).

Writes ``OUT/results.md`` (per method, model and family: start and final pass@1, mean ± std over
seeds, Δ vs GRPO n=8, peer groups grafted and the admitted share), ``OUT/curves.png`` (per-family
held-out pass@1 vs step, mean over seeds) and every run under ``OUT/runs``.

Reproduce (5 methods × 3 seeds, 60 steps; about 40 minutes on 2 cores, one run at a time):
    python benchmarks/transfer.py
Finished runs are cached by their ``done.json``/``final.json``; delete ``OUT/runs`` after changing
the testbed or the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed import METHODS, run_one  # noqa: E402  (the natural-pair benchmark's methods and runner)

DEFAULT_METHODS = ["grpo_n8", "grpo_n32", "graft", "graft_no_gate", "sgt"]


def eval_by_family(tb, out: Path, samples: int, checkpoint: Path | None = None, threads: int | None = None) -> dict:
    """Per-family pass@1 of both models (the shipped pair, or a run's ``checkpoint`` directory) on the
    whole held-out set (T=1, top-p 1), cached in ``out``."""
    if out.is_file():
        return json.loads(out.read_text())
    if threads:
        import torch

        torch.set_num_threads(threads)
    from graft_rl.data import load_jsonl
    from graft_rl.engine.evaluation import evaluate_policy, pass1_by_family
    from graft_rl.policy import Policy, PolicyConfig

    held = load_jsonl(tb.eval_file)
    res: dict = {}
    for d in tb.policy_dicts():
        model = str(checkpoint / d["name"]) if checkpoint else d["model"]
        correct = evaluate_policy(
            Policy(PolicyConfig(**{**d, "model": model})), held, "gsm8k", samples, 1.0, 1.0, 40, seed=12345
        )["correct"]
        res[d["name"]] = pass1_by_family(held, correct, samples)
    out.write_text(json.dumps(res, indent=1))
    return res


def one(tb, out: Path, method: str, seed: int, args, threads: int | None) -> Path:
    run_dir = run_one(tb, out, method, seed, args.steps, args.val_prompts, args.val_samples, args.every, None, threads)
    eval_by_family(
        tb, run_dir / "final.json", args.eval_samples, run_dir / "checkpoints" / f"step_{args.steps:06d}", threads
    )
    return run_dir


def summarize(tb, out: Path, methods: list[str], seeds: list[int], settings: str, eval_samples: int = 16) -> None:
    from graft_rl.commands.report import family_summary

    start = json.loads((out / "start.json").read_text())
    fams = list(tb.families)
    done = {m: [s for s in seeds if (out / "runs" / f"{m}_s{s}" / "final.json").is_file()] for m in methods}
    methods = [m for m in methods if done[m]]
    final: dict = {}
    curves: dict = {}
    for m in methods:
        for s in done[m]:
            rd = out / "runs" / f"{m}_s{s}"
            fe = json.loads((rd / "final.json").read_text())
            val = [json.loads(x) for x in (rd / "validation.jsonl").read_text().splitlines() if x.strip()]
            counts = {(r["policy"], r["family"]): r for r in family_summary(rd)}
            for name in ("A", "B"):
                for f in fams:
                    final.setdefault((m, name, f), []).append((fe[name][f], counts.get((name, f), {})))
                    pts = [
                        (v["step"], v[k])
                        for v in val
                        if v["policy"] == name
                        for k in v
                        if k.startswith("val/") and k.endswith(f"/{f}")
                    ]
                    curves.setdefault((m, name, f), []).append(pts)
    lines = [
        settings,
        "",
        f"Seeds per method: {', '.join(f'{m} {done[m]}' for m in methods)}. Final held-out pass@1: the last "
        f"checkpoint, {tb.heldout_per_family} prompts × {eval_samples} samples per family, T=1; mean ± std over seeds. all-fail: the model's own "
        "groups on that family with no correct response (GRPO's zero-gradient groups); grafted / adm.: peer groups "
        "that replaced them per seed (SGT: prompts given one correct peer response as its NLL target), and the "
        "share of the grafted responses the gate admitted.",
        "",
        "| model | family | method | start | final (mean ± std) | Δ vs GRPO n=8 | all-fail | grafted | adm. |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("A", "B"):
        for f in fams:
            base = (
                statistics.fmean(x for x, _ in final[("grpo_n8", name, f)]) if ("grpo_n8", name, f) in final else None
            )
            for m in methods:
                vals = final[(m, name, f)]
                xs = [x for x, _ in vals]
                mean, std = statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)
                agg = {
                    k: sum(st.get(k, 0) for _, st in vals) / len(vals)
                    for k in ("groups", "all_fail", "grafted", "grafted_rows", "admitted_rows")
                }
                fail = f"{100 * agg['all_fail'] / agg['groups']:.0f}%" if agg["groups"] else "-"
                adm = f"{100 * agg['admitted_rows'] / agg['grafted_rows']:.1f}%" if agg["grafted_rows"] else "-"
                delta = f"{100 * (mean - base):+.1f}" if base is not None else "-"
                lines.append(
                    f"| {name} | {f} | {m} | {100 * start[name][f]:.1f} | {100 * mean:.1f} ± {100 * std:.1f} | "
                    f"{delta} | {fail} | {agg['grafted']:.0f} | {adm} |"
                )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(out, curves, methods, fams)


def _plot(out: Path, curves: dict, methods: list[str], fams: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(fams), figsize=(6 * len(fams), 8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for r, name in enumerate(("A", "B")):
        for c, f in enumerate(fams):
            ax = axes[r, c]
            for i, m in enumerate(methods):
                runs = curves.get((m, name, f))
                if not runs:
                    continue
                steps = [s for s, _ in runs[0]]
                means = [100 * statistics.fmean(run[j][1] for run in runs) for j in range(len(steps))]
                ax.plot(
                    steps, means, marker="o", color=cmap(i), linestyle="--" if m.startswith("grpo") else "-", label=m
                )
            ax.set_title(f"model {name} on {f}")
            ax.set_xlabel("training step")
            ax.set_ylabel("held-out pass@1 (%), mean over seeds")
            ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize=8)
    fig.suptitle("Transfer pair: each model's own family and the one it lacks (validation 128 prompts × 4 per family)")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS), metavar="METHOD")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="validation every N steps (the curves)")
    ap.add_argument("--val-prompts", type=int, default=256, help="validation prompts (balanced over the families)")
    ap.add_argument("--val-samples", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=16, help="final evaluation: samples per held-out prompt")
    ap.add_argument("--out", default="docs/transfer")
    ap.add_argument("--summarize-only", action="store_true")
    args = ap.parse_args()
    from tqdm import tqdm

    from graft_rl.testbed import shipped_testbed

    tb = shipped_testbed("transfer")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_by_family(tb, out / "start.json", args.eval_samples)  # every method's starting point
    if not args.summarize_only:
        # the costly n=32 runs last: a partial benchmark still covers every cheap method and seed
        todo = sorted(
            ((m, s) for s in args.seeds for m in args.methods), key=lambda t: (METHODS[t[0]].get("n", 8) > 8, t[1])
        )
        with tqdm(total=len(todo), desc="transfer runs", unit="run") as bar:
            for m, s in todo:
                t0 = time.perf_counter()
                one(tb, out, m, s, args, None)
                bar.update()
                tqdm.write(f"{m} seed {s}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    settings = (
        f"Transfer pair, {args.steps} steps of 32 prompts × n (8 unless named) on its 600-prompt pool "
        f"({args.steps * 32 / 600:.1f} epochs), lr 1e-4, paper defaults otherwise (δ 0.8, balanced exchange)."
    )
    summarize(tb, out, args.methods, args.seeds, settings, args.eval_samples)


if __name__ == "__main__":
    main()
