"""Wall time per step: in-process vs Ray (one actor per policy), two policies on CPU.

In-process, the two policies generate and update one after the other; with Ray each policy
lives in its own actor and both generate at the same time (the driver gathers the groups
afterwards), so on a machine with a core per policy generation overlaps.

Reproduce:  python benchmarks/ray_overlap.py [--steps 6 --prompt-batch 32]
Prints a Markdown table (median seconds per step after the first, and per phase).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def run(execution: str, steps: int, prompt_batch: int, threads: int) -> dict:
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer
    from graft_rl.testbed import shipped_testbed

    tb = shipped_testbed()  # the pair every machine shares
    base = tb.train_config(run_dir=tempfile.mkdtemp())
    base.update(
        steps=10**6,  # the loop below never reaches the run's last step: no end-of-run checkpoint is timed
        prompt_batch=prompt_batch,
        checkpoint_every=10_000,
        validation={"data": []},
        execution=execution,
        ray={"num_cpus": 1, "torch_threads": threads},
    )
    tr = Trainer(load_config(base), show_progress=False)
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        tr.step(step)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "first_s": times[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt-batch", type=int, default=32)
    args = ap.parse_args()
    import torch

    rows = []
    for execution, threads in (("local", torch.get_num_threads()), ("ray", 1)):
        r = run(execution, args.steps, args.prompt_batch, threads)
        rows.append((execution, threads, r))
    print(f"testbed pair, {args.prompt_batch} prompts x n=8 per step, {args.steps} steps (median of steps 2..N)")
    print()
    print("| execution | torch threads per policy | s / step | first step s |")
    print("|---|---:|---:|---:|")
    for execution, threads, r in rows:
        print(f"| {execution} | {threads} | {r['step_s']:.2f} | {r['first_s']:.2f} |")


if __name__ == "__main__":
    main()
