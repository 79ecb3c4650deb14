"""Device-hours of a GRAFT run against the two GRPO runs it replaces (paper Table 5: 43.3 vs 29.9
GPU-hours, 1.45x), on CPU with Ray: each policy its own actor on its own core ("device").

    python benchmarks/device_hours.py [--steps 12 --repeats 3]     # ~8 min on 2 cores
    python benchmarks/device_hours.py --toy    # a minute's check that it runs (tests/engine/test_benchmarks_run.py)

- GRAFT: both policies of the shipped natural testbed pair, ``execution: ray``, one actor of one
  CPU (one torch thread) each: 2 devices for the run's wall time.
- GRPO x 2: policy A alone and policy B alone, the same steps and settings, one actor of one CPU
  each: 1 device for each run's wall time. Run one after the other (each alone on the machine: the
  other core is free for Ray's own processes and the driver) and both at once (both cores busy, as
  in the GRAFT run: the fair comparison on a 2-core machine).
- device-seconds = devices x wall time of the step loop (``Trainer.run``: generation, rewards,
  exchange, scoring, updates and the final checkpoint; actor start-up and model loading are shown
  apart). Ratio = GRAFT device-seconds / (GRPO A + GRPO B device-seconds).

"before" is the previous driver, emulated here by waiting for each receiver's update before
starting the next (the policies' devices then take turns idling); "after" is the trainer as it is
(every receiver's update started before any is awaited). Prints a Markdown table and ends with the
headline line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from build_testbed import cpu_model  # noqa: E402

PAPER_RATIO = 43.3 / 29.9


def sequential_updates(monkeypatch_target) -> None:
    """Emulate the driver before issue 22: each receiver's update awaited before the next starts."""
    real = monkeypatch_target._train_receiver

    def blocking(self, name, batch, step):
        pending = real(self, name, batch, step)
        pending.get()  # waits for the update (the trainer's own get later returns the same result)
        return pending

    monkeypatch_target._train_receiver = blocking


def one_run(policies: list[str], steps: int, prompt_batch: int, method: str) -> dict:
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer
    from graft_rl.testbed import shipped_testbed

    base = shipped_testbed().train_config(run_dir=tempfile.mkdtemp() + "/run", method=method)
    base.update(
        steps=steps,
        prompt_batch=prompt_batch,
        minibatch=min(base["minibatch"], prompt_batch),
        checkpoint_every=10_000,
        validation={"data": []},
        execution="ray",
        ray={"num_cpus": 1, "torch_threads": 1},
    )
    base["policies"] = [p for p in base["policies"] if p["name"] in policies]
    t0 = time.perf_counter()
    tr = Trainer(load_config(base), show_progress=False)
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    lines = tr.run()
    wall = time.perf_counter() - t0
    tr.close()
    grafted = sum(ln.get("exchanged_in", 0) or 0 for ln in lines)
    phases = {
        k: sum(ln.get(f"time_{k}", 0.0) or 0.0 for ln in lines) for k in ("generate", "reward", "logprobs", "update")
    }
    return {"devices": len(policies), "wall": wall, "start": start, "grafted": grafted, **phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt-batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--toy", action="store_true", help="1 step of 4 prompts, 1 trial: that it runs, not its figures")
    args = ap.parse_args()
    if args.toy:
        args.steps, args.prompt_batch, args.repeats = 1, 4, 1
    import ray

    from graft_rl.engine.trainer import Trainer

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    real = Trainer._train_receiver
    trials = []
    try:
        for _ in range(args.repeats):  # interleaved, so slow drifts of the machine hit every variant alike
            trial = {p: one_run([p], args.steps, args.prompt_batch, "grpo") for p in ("A", "B")}
            with ThreadPoolExecutor(2) as pool:  # the two GRPO runs at once, each on its own core
                both = list(pool.map(lambda p: one_run([p], args.steps, args.prompt_batch, "grpo"), ("A", "B")))
            trial["A_at_once"], trial["B_at_once"] = both
            trial["after"] = one_run(["A", "B"], args.steps, args.prompt_batch, "graft")
            sequential_updates(Trainer)
            trial["before"] = one_run(["A", "B"], args.steps, args.prompt_batch, "graft")
            Trainer._train_receiver = real
            trials.append(trial)
    finally:
        Trainer._train_receiver = real
        ray.shutdown()

    def med(key: str) -> dict:  # the trial with the median step-loop wall time
        runs = sorted((t[key] for t in trials), key=lambda r: r["wall"])
        return runs[len(runs) // 2]

    grpo = {"A": med("A"), "B": med("B")}
    at_once = {"A": med("A_at_once"), "B": med("B_at_once")}
    graft = {"before": med("before"), "after": med("after")}
    pair = sum(r["devices"] * r["wall"] for r in grpo.values())
    pair_at_once = sum(r["wall"] for r in at_once.values())
    print(
        f"CPU: {cpu_model()}; shipped natural testbed pair, {args.steps} steps of {args.prompt_batch} prompts x n = 8, "
        f"one actor of 1 CPU (1 torch thread) per policy"
    )
    print()
    print(
        "| run | devices | step-loop wall s | device-s | generate / reward / score / update s (summed over policies) "
        "| start-up s | grafted groups | ratio to the two GRPO runs |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|")

    def phases(r):
        return " / ".join(f"{r[k]:.1f}" for k in ("generate", "reward", "logprobs", "update"))

    for name, r in (("GRPO, policy A alone", grpo["A"]), ("GRPO, policy B alone", grpo["B"])):
        print(f"| {name} | 1 | {r['wall']:.1f} | {r['wall']:.1f} | {phases(r)} | {r['start']:.1f} | - | |")
    print(f"| GRPO A + GRPO B, each alone on the machine | | | {pair:.1f} | | | | 1.00 |")
    for name, r in (("GRPO A, beside GRPO B", at_once["A"]), ("GRPO B, beside GRPO A", at_once["B"])):
        print(f"| {name} | 1 | {r['wall']:.1f} | {r['wall']:.1f} | {phases(r)} | {r['start']:.1f} | - | |")
    print(
        f"| GRPO A + GRPO B, at once (both cores busy, as in GRAFT) | | | {pair_at_once:.1f} | | | | "
        f"{pair_at_once / pair:.2f} |"
    )
    for label in ("before", "after"):
        r = graft[label]
        ds = r["devices"] * r["wall"]
        print(
            f"| GRAFT, {label} (updates {'one after the other' if label == 'before' else 'at once'}) | 2 | {r['wall']:.1f} | "
            f"{ds:.1f} | {phases(r)} | {r['start']:.1f} | {r['grafted']:.0f} | {ds / pair:.2f} |"
        )
    print()
    print(f"median of {args.repeats} interleaved trials (the trial with the median wall time per row)")
    print()
    after, before = 2 * graft["after"]["wall"], 2 * graft["before"]["wall"]
    print(
        f"headline: GRAFT / two GRPO runs device-time = {after / pair_at_once:.2f} against the GRPO runs at once "
        f"({after / pair:.2f} against each run alone on the machine; before the change {before / pair_at_once:.2f} / "
        f"{before / pair:.2f}; the paper's Table 5: {PAPER_RATIO:.2f})"
    )


if __name__ == "__main__":
    main()
