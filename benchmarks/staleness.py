"""What staleness costs, and what the corrections buy back: ``rollout.lag`` 0 / 1 / 2 x
``method.correction`` none / tis / icepop, GRAFT on the lookup and the transfer pairs.

At ``lag: k`` every training generation samples from the weights of k pushes earlier (an asynchronous
trainer's engine), so the sampling distribution mu and the trainer's pi_old differ by k steps of
training; the run measures that gap every step (``mismatch_kl``) and the correction reweights or
masks own tokens by pi_old / mu. Per pair, lag, correction and seed the script trains GRAFT for the
pair's steps and reads from the run: each policy's held-out pass@1 at the end (``validation.jsonl``),
the gap (mean ``mismatch_kl`` over steps 2 on, where a lag can show), the share of own tokens
outside the correction's bounds and masked by it, and the wall time.

Writes ``OUT/results.md`` (mean ± std over seeds) and ``OUT/staleness.png`` (the gap per step at each
lag; held-out pass@1 per policy by lag and correction); every run under ``OUT/runs``, cached by its
``done.json`` (delete ``OUT/runs`` after changing the code or the settings).

Reproduce (2 pairs x 9 settings x 3 seeds = 54 runs, one at a time on 2 cores):
    python benchmarks/staleness.py [--pairs lookup transfer] [--seeds 0 1 2] [--out docs/staleness]
    python benchmarks/staleness.py --toy     # 2 steps, 1 seed: the code path only (tests/test_benchmarks_run.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

LAGS = (0, 1, 2)
CORRECTIONS = ("none", "tis", "icepop")

#: per pair: its steps and held-out validation (pass@1 at T=1, top-p 1, at the last step)
PAIRS = {
    # configs/lookup/graft.yaml as shipped: 40 steps of 16 prompts, 128 held-out prompts x 8 samples
    "lookup": {"steps": 40, "val_prompts": 128, "val_samples": 8},
    # the transfer benchmark's settings (benchmarks/transfer.py) for a third of its steps
    "transfer": {"steps": 20, "val_prompts": 128, "val_samples": 4},
}

#: --toy: the code path only
TOY = {"steps": 2, "val_prompts": 16, "val_samples": 1}


def config(pair: str, run_dir: Path, seed: int, lag: int, correction: str, settings: dict):
    from graft_rl.engine.config import load_config

    steps, every = settings["steps"], settings["steps"]
    keys = [
        f"run_dir={run_dir}",
        f"seed={seed}",
        f"steps={steps}",
        f"checkpoint_every={steps}",
        f"validation.every={every}",
        f"validation.limit={settings['val_prompts']}",
        f"validation.samples={settings['val_samples']}",
        f"rollout.lag={lag}",
        f"method.correction={correction}",
    ]
    if pair == "lookup":
        return load_config(ROOT / "configs" / "lookup" / "graft.yaml", keys)
    from graft_rl.testbed import shipped_testbed

    base = shipped_testbed(pair).train_config(run_dir=str(run_dir))
    base["method"] = {"name": "graft"}
    base["validation"].update(temperature=1.0, top_p=1.0)
    return load_config(base, keys)


def run(pair: str, lag: int, correction: str, seed: int, out: Path, settings: dict) -> dict:
    """One run's figures (cached in its ``done.json``)."""
    import shutil

    from graft_rl.engine.trainer import Trainer

    run_dir = out / "runs" / pair / f"lag{lag}_{correction}_s{seed}"
    done = run_dir / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    tr = Trainer(config(pair, run_dir, seed, lag, correction, settings), show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    seconds = time.perf_counter() - t0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = [json.loads(x) for x in (run_dir / "validation.jsonl").read_text().splitlines() if x.strip()]
    res: dict = {"seconds": seconds, "policies": {}}
    for name in dict.fromkeys(ln["policy"] for ln in lines):
        mine = [ln for ln in lines if ln["policy"] == name]
        last = [v for v in val if v["policy"] == name][-1]
        res["policies"][name] = {
            "heldout": last["val/score"],
            "gap": {ln["step"]: ln.get("mismatch_kl") for ln in mine},
            "out": _mean(ln.get("mismatch_out") for ln in mine if ln["step"] > 1),
            "masked": _mean(ln.get("correction_masked") for ln in mine if ln["step"] > 1),
        }
    done.write_text(json.dumps(res))
    return res


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _ms(xs, scale: float = 100.0, fmt: str = ".1f") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{scale * statistics.fmean(xs):{fmt}} ± {scale * sd:{fmt}}"


def summarize(results: dict, out: Path, header: str) -> str:
    lines = [
        header,
        "",
        "| pair | lag | correction | A held-out % | B held-out % | mismatch_kl, steps ≥ 2 | outside bounds % | "
        "masked % | s / run |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (pair, lag, corr), runs in results.items():
        if not runs:
            continue

        def pol(name, key, runs=runs):
            return [r["policies"][name][key] for r in runs if name in r["policies"]]

        gaps = [_mean(g for s, g in r["policies"][p]["gap"].items() if int(s) > 1) for r in runs for p in r["policies"]]
        gaps = [g for g in gaps if g is not None]
        gap = f"{statistics.fmean(gaps):.1e}" if gaps else "-"
        outs = [x for p in ("A", "B") for x in pol(p, "out")]
        masked = [x for p in ("A", "B") for x in pol(p, "masked")]
        lines.append(
            f"| {pair} | {lag} | {corr} | {_ms(pol('A', 'heldout'))} | {_ms(pol('B', 'heldout'))} | {gap} | "
            f"{_ms(outs, fmt='.2f')} | {_ms(masked, fmt='.2f') if corr != 'none' else '-'} | "
            f"{statistics.fmean(r['seconds'] for r in runs):.0f} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def plot(results: dict, pairs: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({lag for (_, lag, _), runs in results.items() if runs})
    corrections = [c for c in CORRECTIONS if any(runs and k[2] == c for k, runs in results.items())]
    fig, axes = plt.subplots(len(pairs), 3, figsize=(16, 4.2 * len(pairs)), squeeze=False)
    for r, pair in enumerate(pairs):
        ax = axes[r, 0]
        for i, lag in enumerate(lags):
            runs = results.get((pair, lag, "none")) or []
            per_step: dict[int, list[float]] = {}
            for run_ in runs:
                for p in run_["policies"].values():
                    for s, g in p["gap"].items():
                        if g is not None:
                            per_step.setdefault(int(s), []).append(g)
            if per_step:
                steps = sorted(per_step)
                ax.plot(
                    steps,
                    [max(statistics.fmean(per_step[s]), 1e-16) for s in steps],
                    marker=".",
                    color=f"C{i}",
                    label=f"lag {lag}",
                )
        ax.set_yscale("log")
        ax.set_title(f"{pair}: engine-trainer gap of own tokens (correction none)")
        ax.set_xlabel("step")
        ax.set_ylabel("mismatch_kl (mean over seeds and policies)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        for c, name in enumerate(("A", "B"), start=1):
            ax = axes[r, c]
            width = 0.8 / len(corrections)
            top = 1.0
            for j, corr in enumerate(corrections):
                xs, ys, es = [], [], []
                for lag in lags:
                    vals = [x["policies"][name]["heldout"] for x in results.get((pair, lag, corr)) or []]
                    if vals:
                        xs.append(lag + (j - (len(corrections) - 1) / 2) * width)
                        ys.append(100 * statistics.fmean(vals))
                        es.append(100 * statistics.stdev(vals) if len(vals) > 1 else 0.0)
                ax.bar(xs, ys, width, yerr=es, capsize=3, color=f"C{j + 3}", label=corr)
                top = max([top] + [y + e for y, e in zip(ys, es, strict=True)])
            ax.set_xticks(lags, [f"lag {lag}" for lag in lags])
            ax.set_title(f"{pair}: policy {name}, held-out pass@1 after training")
            ax.set_ylabel("% (mean ± std over seeds)")
            ax.set_ylim(0, 1.25 * top)  # room for the legend above the error bars
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8, title="correction", ncol=len(corrections), loc="upper center")
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default="runs/staleness")
    ap.add_argument("--toy", action="store_true", help="lookup, 2 steps, seed 0, lag 0 / 1, none / tis")
    args = ap.parse_args()
    import torch
    from build_testbed import cpu_model
    from tqdm import tqdm

    pairs, seeds = (["lookup"], [0]) if args.toy else (args.pairs, args.seeds)
    lags, corrections = ((0, 1), ("none", "tis")) if args.toy else (LAGS, CORRECTIONS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(p, lag, c, s) for p in pairs for lag in lags for c in corrections for s in seeds]
    results: dict = {(p, lag, c): [] for p in pairs for lag in lags for c in corrections}
    with tqdm(total=len(todo), desc="staleness runs", unit="run", file=sys.stderr) as bar:
        for p, lag, c, s in todo:
            results[(p, lag, c)].append(run(p, lag, c, s, out, TOY if args.toy else PAIRS[p]))
            bar.update()
    header = (
        f"# staleness: GRAFT, rollout.lag x method.correction ({', '.join(pairs)}; seeds {seeds}; "
        f"{torch.get_num_threads()} threads, {cpu_model()}, torch {torch.__version__})\n\n"
        + "; ".join(
            f"{p}: {(TOY if args.toy else PAIRS[p])['steps']} steps, held-out pass@1 on "
            f"{(TOY if args.toy else PAIRS[p])['val_prompts']} prompts x {(TOY if args.toy else PAIRS[p])['val_samples']} "
            "samples at the last step"
            for p in pairs
        )
    )
    print(summarize(results, out, header))
    plot(results, pairs, out)
    print(f"table and plot: {out / 'results.md'}, {out / 'staleness.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
