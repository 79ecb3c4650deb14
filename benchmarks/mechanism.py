"""The end-to-end mechanism check over several seeds: GRAFT vs GRPO on the lookup pair.

The lookup pair (``graft_rl.testbed``, ``configs/lookup/graft.yaml``): model A was taught a wrong
rule for the family ``shift3`` and sharpened, so every one of its groups there fails; B is right
about half the time; the pool holds only ``shift3``. GRPO gives A no gradient; GRAFT grafts B's
mixed groups into A's batch. ``tests/engine/test_mechanism_e2e.py`` runs seed 0 as a regression
check; this script first prints how the pair is built (each model's probability of the right
digit on the held-out ``shift3`` prompts), then runs both configs for each seed and prints, per run, A's held-out pass@1 on
``shift3`` (its missing family) and ``shift6`` (the family it half knows), the share of A's own
groups that failed entirely, the peer groups grafted in and the share of their responses the gate
admitted, and the wall time.

Reproduce (4 seeds x 2 methods, about 30 s a run on 2 cores):
    python benchmarks/mechanism.py [--seeds 0 1 2 3] [--out runs/mechanism] [--toy]
    python benchmarks/mechanism.py --lora     # graft_lora.yaml / grpo_lora.yaml: LoRA adapters on both policies
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

CONFIGS = {"graft": ROOT / "configs" / "lookup" / "graft.yaml", "grpo": ROOT / "configs" / "lookup" / "grpo.yaml"}
LORA_CONFIGS = {m: c.with_name(f"{m}_lora.yaml") for m, c in CONFIGS.items()}  # --lora


#: ``--toy``: 2 steps, a small held-out set (the benchmark's code path, not its figures; tests/test_benchmarks_run.py)
TOY = ["steps=2", "checkpoint_every=2", "validation.every=2", "validation.limit=16", "validation.samples=1"]


def run(method: str, seed: int, out: Path, overrides: list[str] = (), configs: dict = CONFIGS) -> dict:
    from graft_rl.commands.report import family_summary
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    run_dir = out / f"{method}_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    cfg = load_config(configs[method], [f"run_dir={run_dir}", f"seed={seed}", *overrides])
    Trainer(cfg, show_progress=False).run()
    rows = {(r["policy"], r["family"]): r for r in family_summary(run_dir)}
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", default="runs/mechanism")
    ap.add_argument("--toy", action="store_true", help="2 steps and a small held-out set: the code path only")
    ap.add_argument("--lora", action="store_true", help="LoRA adapters on both policies (configs/lookup/*_lora.yaml)")
    args = ap.parse_args()
    configs = LORA_CONFIGS if args.lora else CONFIGS
    import torch
    from build_testbed import cpu_model

    from graft_rl.data import load_jsonl
    from graft_rl.testbed import lookup_right_digit_probability, shipped_root

    what = ", LoRA on both policies (configs/lookup/*_lora.yaml)" if args.lora else ""
    print(f"# lookup pair{what}, {torch.get_num_threads()} threads, {cpu_model()}, torch {torch.__version__}\n")
    root = shipped_root("lookup")
    held = [p for p in load_jsonl(root / "heldout.jsonl") if p.subject == "shift3"]
    for which in ("a", "b"):
        ps = lookup_right_digit_probability(root / f"model_{which}", held)
        print(
            f"model {which.upper()}: p(right digit) on {len(ps)} held-out shift3 prompts: mean {sum(ps) / len(ps):.2g}, "
            f"min {min(ps):.2g}, max {max(ps):.2g}"
        )
    print(
        "\ncolumns: held-out pass@1 % before -> after (64 prompts x 8 samples per family); all-fail: A's own groups "
        "with no right response; grafted: B's groups that replaced them; adm.: their responses the gate admitted; "
        "s: wall seconds of the run\n"
    )
    print("| seed | method | A shift3 (missing) | A shift6 | A all-fail | grafted | adm. | s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        for method in configs:
            out = Path(args.out) / ("lora" if args.lora else "")
            r = run(method, seed, out, TOY if args.toy else [], configs)
            a3, a6 = r["rows"][("A", "shift3")], r["rows"][("A", "shift6")]
            fail = a3["all_fail"] / a3["groups"] if a3["groups"] else None
            print(
                f"| {seed} | {method} | {pct(a3['val_before'])} → {pct(a3['val_after'])} | {pct(a6['val_before'])} → "
                f"{pct(a6['val_after'])} | {pct(fail)} | {a3['grafted']:.0f} | {pct(a3['admitted_frac'])} | "
                f"{r['seconds']:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
