"""Two `graft train` runs at once on the same cores: seconds per step alone vs side by side.

    python benchmarks/two_jobs.py [--steps 6] [--toy]   # ~3 minutes on 2 cores; run it alone

For each OpenMP spin setting (libgomp's default 300,000 and the CLI's default 5,000) it runs the
default testbed job for 6 steps (no validation) once alone and twice concurrently, and prints the
median of (generate + score + update) seconds per step. A run that loses more than 2x when a
second one shares its cores is oversubscribed: spinning OpenMP threads steal each other's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 6


def launch(run_dir: Path, env: dict, steps: int = STEPS, toy: bool = False) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "graft_rl.commands.cli",
        "train",
        f"run_dir={run_dir}",
        f"steps={steps}",
        "validation.data=[]",
        "checkpoint_every=100",
        *(["prompt_batch=4", "n=2"] if toy else []),
        "--no-progress",
    ]
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait(proc: subprocess.Popen) -> None:
    """Wait for a run; a failed one stops the benchmark with its last lines."""
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"graft train exited {proc.returncode}: {err.strip()[-2000:]}")


def seconds_per_step(run_dir: Path) -> float:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step: dict[int, float] = {}
    for ln in lines:
        per_step[ln["step"]] = (
            per_step.get(ln["step"], 0.0) + ln["time_generate"] + ln["time_logprobs"] + ln["time_update"]
        )
    return statistics.median(per_step.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--toy", action="store_true", help="4 prompts x 2 responses a step: the code path only")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="two_jobs_"))
    print("| GOMP_SPINCOUNT | alone s/step | two at once s/step (each) | slowdown |\n|---:|---:|---:|---:|")
    for spin in ("300000", "5000"):
        env = {**os.environ, "GOMP_SPINCOUNT": spin}
        solo = root / f"solo_{spin}"
        wait(launch(solo, env, args.steps, args.toy))
        pair = [root / f"pair_{spin}_{i}" for i in range(2)]
        procs = [launch(d, env, args.steps, args.toy) for d in pair]
        for p in procs:
            wait(p)
        t_solo = seconds_per_step(solo)
        t_pair = [seconds_per_step(d) for d in pair]
        print(
            f"| {spin} | {t_solo:.2f} | {t_pair[0]:.2f} / {t_pair[1]:.2f} | {statistics.fmean(t_pair) / t_solo:.1f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
