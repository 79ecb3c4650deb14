"""Every way to share between policies, under one protocol: GRPO, GRAFT, SGT, LUFFY, HACPO (the
paper's) and SAPO, PRP, XGRPO, F-TIS (published after it), on the same work, the same rollout budget
and the same seeds.

The work:

- ``transfer``: the transfer pair (``zoo:transfer-a`` / ``zoo:transfer-b``), each model solving one
  of the pool's two families about half the time and failing the other (docs/benchmarks.md);
- ``lookup``: the lookup pair (``configs/lookup/graft.yaml``), where A's every group fails;
- ``swarm``: a swarm of four of one vocabulary (two ``zoo:transfer-a``, two ``zoo:testbed-a``) on the
  transfer pool, for the methods of N policies (F-TIS needs one vocabulary; on the pairs, whose two
  models have two tokenizers, it is refused, and the table says so).

The budget: every policy of every method samples ``prompt_batch`` x ``n`` responses a step for the
same steps, from the same seeds. SAPO draws its own ``prompt_batch`` questions (I) and takes
J = I external data points (the paper's best split, 4 / 4). HACPO is run as its preset (the paper's
KL 1e-3 and its clip schedule).

Per run the script reads: each policy's held-out pass@1 at the end, overall and per prompt family
(``validation.jsonl``); what moved into each receiver over the run (exchange records: peer groups,
responses and their tokens; XGRPO's peer rewards); the wall time. Writes ``OUT/results.md`` (mean ±
std over seeds) and ``OUT/methods.png``; every run under ``OUT/runs``, cached by its ``done.json``
(delete ``OUT/runs`` after changing the code or the settings).

Reproduce (one at a time on 2 cores; docs/benchmarks.md has the command's timing):
    python benchmarks/methods.py [--work transfer lookup swarm] [--seeds 0 1 2] [--out runs/methods]
    python benchmarks/methods.py --toy     # 2 steps, 1 seed: the code path only (tests/test_benchmarks_run.py)
    python benchmarks/methods.py --work swarm --methods ftis --set method.composition=pool_all \
        --out runs/methods_ftis_pooled    # an ablation: config keys set on every run (docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

PAIR_METHODS = ("grpo", "graft", "sgt", "luffy", "hacpo", "sapo", "prp", "xgrpo", "ftis")
SWARM_METHODS = ("grpo", "graft", "sapo", "prp", "xgrpo", "ftis")

#: per work: steps, prompts per step, held-out prompts and samples at the end
WORK = {
    "transfer": {"steps": 20, "prompt_batch": 32, "minibatch": 8, "val_prompts": 128, "val_samples": 4},
    "lookup": {"steps": 40, "prompt_batch": 16, "minibatch": 8, "val_prompts": 128, "val_samples": 8},
    "swarm": {"steps": 20, "prompt_batch": 16, "minibatch": 4, "val_prompts": 64, "val_samples": 4},
}
TOY = {"steps": 2, "prompt_batch": 4, "minibatch": 2, "val_prompts": 8, "val_samples": 1}

#: the methods' own keys under this protocol (HACPO: its preset's KL to the initial policy)
METHOD_KEYS = {"hacpo": {"kl_coef": 0.001}}


def _policies(work: str) -> list[dict]:
    from graft_rl.testbed import PLAIN_TEMPLATE

    common = {"prompt_format": "plain", "plain_template": PLAIN_TEMPLATE, "prompt_suffix": None, "lr": 1e-4}
    if work == "swarm":
        models = [("A1", "transfer-a"), ("A2", "transfer-a"), ("N1", "testbed-a"), ("N2", "testbed-a")]
        return [{"name": n, "model": f"zoo:{m}", **common} for n, m in models]
    return [{"name": n, "model": f"zoo:{work}-{n.lower()}", **common} for n in ("A", "B")]


def config(work: str, method: str, run_dir: Path, seed: int, s: dict, sets: tuple[str, ...] = ()):
    """The run's config: the work's base, the protocol's keys, then ``sets`` (``KEY=VALUE``, ``--set``)."""
    from graft_rl.engine.config import load_config

    keys = {
        "run_dir": str(run_dir),
        "seed": seed,
        "steps": s["steps"],
        "prompt_batch": s["prompt_batch"],
        "minibatch": s["minibatch"],
        "checkpoint_every": s["steps"],
        "validation.every": s["steps"],
        "validation.limit": s["val_prompts"],
        "validation.samples": s["val_samples"],
    }
    keys.update({f"method.{k}": v for k, v in METHOD_KEYS.get(method, {}).items()})
    if method == "sapo":  # J = I, and as many updates a step as the others: twice the groups, twice the minibatch
        keys["method.sapo_external"] = s["prompt_batch"]
        keys["minibatch"] = 2 * s["minibatch"]
    if work == "lookup":  # its config's exchange is one-directional (balance: false), a key GRPO does not read
        keys["method.name"] = method
        keys["method.balance"] = method == "grpo"
        return load_config(
            ROOT / "configs" / "lookup" / "graft.yaml", [f"{k}={v}" for k, v in keys.items()] + list(sets)
        )
    from graft_rl.testbed import shipped_testbed

    base = shipped_testbed("transfer").train_config(run_dir=str(run_dir))
    base["validation"].update(temperature=1.0, top_p=1.0)
    base["method"] = {"name": method}
    base["policies"] = _policies(work)
    return load_config(base, [f"{k}={v}" for k, v in keys.items()] + list(sets))


def _moved(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per receiver, over the run: peer groups, responses and their tokens received; peer rewards that
    shaped a baseline (XGRPO)."""
    import pyarrow.parquet as pq

    from graft_rl.engine.store import RecordStore

    tokens: dict[tuple, int] = {}
    for f in (run_dir / "records").glob("*/step_*.parquet"):
        t = pq.read_table(f, columns=["step", "prompt_id", "policy", "group_index", "token_ids"]).to_pylist()
        tokens.update({(r["step"], r["policy"], r["prompt_id"], r["group_index"]): len(r["token_ids"]) for r in t})
    out: dict[str, dict[str, float]] = defaultdict(
        lambda: {"groups": 0.0, "responses": 0.0, "tokens": 0.0, "rewards": 0.0}
    )
    seen: set = set()
    for r in RecordStore(run_dir).read_exchange():
        m = out[r["receiver"]]
        if r.get("moved") == "reward":
            m["rewards"] += 1
            continue
        m["responses"] += 1
        m["tokens"] += tokens.get((r["step"], r["source"], r["prompt_id"], r["group_index"]), 0)
        key = (r["receiver"], r["step"], r["source"], r["prompt_id"])
        if key not in seen:
            seen.add(key)
            m["groups"] += 1
    return dict(out)


def run(work: str, method: str, seed: int, out: Path, s: dict, sets: tuple[str, ...] = ()) -> dict:
    """One run's figures (cached in its ``done.json``); ``{"refused": line}`` where the method cannot run."""
    import shutil

    from graft_rl.engine.trainer import Trainer
    from graft_rl.errors import ConfigError

    run_dir = out / "runs" / work / f"{method}_s{seed}"
    done = run_dir / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        tr = Trainer(config(work, method, run_dir, seed, s, sets), show_progress=False)
    except ConfigError as exc:
        res = {"refused": str(exc)}
        run_dir.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps(res))
        return res
    try:
        tr.run()
    finally:
        tr.close()
    seconds = time.perf_counter() - t0
    val = [json.loads(x) for x in (run_dir / "validation.jsonl").read_text().splitlines() if x.strip()]
    moved = _moved(run_dir)
    res: dict = {"seconds": seconds, "policies": {}}
    for name in dict.fromkeys(v["policy"] for v in val):
        last = [v for v in val if v["policy"] == name][-1]
        fams = {k.rsplit("/", 1)[1]: v for k, v in last.items() if k.startswith("val/") and k.count("/") == 2}
        res["policies"][name] = {"heldout": last["val/score"], "families": fams, "moved": moved.get(name, {})}
    done.write_text(json.dumps(res))
    return res


def _ms(xs, scale: float = 100.0, fmt: str = ".1f") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{scale * statistics.fmean(xs):{fmt}} ± {scale * sd:{fmt}}"


def _weakest_families(runs_of: dict, pols: list[str]) -> dict[str, str]:
    """Per policy, the held-out family it does worst on under GRPO: the one sharing is meant to lift
    (the pairs' missing families; without a GRPO run, the worst under the first method)."""
    base = runs_of.get("grpo") or next(iter(runs_of.values()))
    ok = [r for r in base if "policies" in r]
    weak = {}
    for p in pols:
        fams = ok[0]["policies"][p]["families"] if ok else {}
        if fams:
            weak[p] = min(fams, key=lambda f: statistics.fmean(r["policies"][p]["families"].get(f, 1.0) for r in ok))
    return weak


def _every_family(work: str, runs_of: dict, pols: list[str]) -> list[str]:
    """The second table of a work: every policy's held-out pass@1 on every prompt family."""
    ok_of = {m: [r for r in rs if "policies" in r] for m, rs in runs_of.items()}
    cols = list(
        dict.fromkeys(
            (p, f) for rs in ok_of.values() for r in rs[:1] for p in pols for f in r["policies"][p]["families"]
        )
    )
    if not cols:
        return []
    lines = [
        f"{work}, every policy on every family (held-out pass@1 %, mean ± std over seeds):",
        "",
        "| method | " + " | ".join(f"{p}: {f}" for p, f in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for method, ok in ok_of.items():
        if ok:
            cells = [_ms([r["policies"][p]["families"].get(f) for r in ok]) for p, f in cols]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def summarize(results: dict, out: Path, header: str) -> str:
    lines = [header, ""]
    for work in dict.fromkeys(w for w, _ in results):
        runs_of = {m: r for (w, m), r in results.items() if w == work}
        pols = next((list(r["policies"]) for rs in runs_of.values() for r in rs if "policies" in r), [])
        weak = _weakest_families(runs_of, pols)
        lines += [
            f"### {work}",
            "",
            "| method | "
            + " | ".join(f"{p} held-out %" for p in pols)
            + " | "
            + " | ".join(f"{p}: {f} %" for p, f in weak.items())
            + " | groups in / policy | responses in | tokens in | rewards in | s / run |",
            "|---|" + "---:|" * (len(pols) + len(weak) + 5),
        ]
        for method, rs in runs_of.items():
            refused = next((r["refused"] for r in rs if "refused" in r), None)
            if refused:
                why = "needs one vocabulary; the pair has two tokenizers" if "vocabulary" in refused else refused
                lines.append(f"| {method} | refused: {why} |" + " - |" * (len(pols) + len(weak) + 4))
                continue
            ok = [r for r in rs if "policies" in r]
            cells = [_ms([r["policies"][p]["heldout"] for r in ok]) for p in pols]
            cells += [_ms([r["policies"][p]["families"].get(f) for r in ok]) for p, f in weak.items()]
            for key in ("groups", "responses", "tokens", "rewards"):
                per_run = [sum(r["policies"][p]["moved"].get(key, 0.0) for p in pols) / len(pols) for r in ok]
                cells.append(f"{statistics.fmean(per_run):.0f}")
            cells.append(f"{statistics.fmean(r['seconds'] for r in ok):.0f}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines += ["", *_every_family(work, runs_of, pols)]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def plot(results: dict, out: Path) -> None:
    """Top row: each policy's held-out pass@1; bottom row: its weakest family under GRPO (what sharing
    is meant to lift)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = list(dict.fromkeys(w for w, _ in results))
    fig, axes = plt.subplots(2, len(works), figsize=(6.5 * len(works), 8.6), squeeze=False)
    for col, work in enumerate(works):
        methods = [m for (w, m), rs in results.items() if w == work]
        runs_of = {m: results[(work, m)] for m in methods}
        pols = next((list(r["policies"]) for m in methods for r in runs_of[m] if "policies" in r), [])
        weak = _weakest_families(runs_of, pols)
        rows = [
            ("held-out pass@1, %", lambda r, p: r["policies"][p]["heldout"], "all held-out", pols),
            (
                "its weakest family, %",
                lambda r, p, weak=weak: r["policies"][p]["families"].get(weak[p]),
                "each policy's weakest family under GRPO",
                list(weak),
            ),
        ]
        for row, (ylabel, value, what, shown) in enumerate(rows):
            ax = axes[row][col]
            width = 0.8 / max(len(shown), 1)
            for j, p in enumerate(shown):
                ys, es, xs = [], [], []
                for i, m in enumerate(methods):
                    vals = [v for r in runs_of[m] if "policies" in r and (v := value(r, p)) is not None]
                    if vals:
                        xs.append(i + (j - (len(shown) - 1) / 2) * width)
                        ys.append(100 * statistics.fmean(vals))
                        es.append(100 * statistics.stdev(vals) if len(vals) > 1 else 0.0)
                label = p if row == 0 else f"{p}: {weak[p]}"
                ax.bar(xs, ys, width, yerr=es, capsize=2, color=f"C{j}", label=label)
            for i, m in enumerate(methods):
                if any("refused" in r for r in runs_of[m]):
                    ax.text(i, 2, "refused:\ntwo\nvocabularies", ha="center", va="bottom", fontsize=7, color="0.4")
            ax.set_xticks(range(len(methods)), methods, rotation=30)
            ax.set_ylabel(f"{ylabel} (mean ± std over seeds)")
            ax.set_title(f"{work}: {what}, after training")
            ax.set_ylim(0, 100)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8, title="policy", loc="upper right")
    fig.suptitle("Every method, one budget (benchmarks/methods.py)")
    fig.tight_layout()
    fig.savefig(out / "methods.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", nargs="+", default=list(WORK), choices=list(WORK))
    ap.add_argument("--methods", nargs="+", default=None, help="a subset of the methods")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument(
        "--out",
        default=str(ROOT / "runs" / "methods"),
        help="runs and results (copy results.md and methods.png to docs/methods/)",
    )
    ap.add_argument("--toy", action="store_true", help="2 steps, 1 seed, tiny validation: the code path only")
    ap.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config keys set on every run, after the protocol's (an ablation: use its own --out)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [0] if args.toy else args.seeds
    results: dict = {}
    from tqdm.auto import tqdm

    todo = [
        (w, m, s)
        for w in args.work
        for m in (SWARM_METHODS if w == "swarm" else PAIR_METHODS)
        if args.methods is None or m in args.methods
        for s in seeds
    ]
    for work, method, seed in tqdm(todo, desc="benchmarks/methods", unit="run"):
        settings = TOY if args.toy else WORK[work]
        results.setdefault((work, method), []).append(run(work, method, seed, out, settings, tuple(args.set)))
    import torch
    from build_testbed import cpu_model

    header = (
        f"Every method, one protocol: {', '.join(args.work)}; seeds {seeds}; "
        f"{'toy settings' if args.toy else 'settings in benchmarks/methods.py WORK'}; "
        f"{'set: ' + ', '.join(args.set) + '; ' if args.set else ''}"
        f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}."
    )
    print(summarize(results, out, header))
    plot(results, out)
    print(f"wrote {out / 'results.md'} and {out / 'methods.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
