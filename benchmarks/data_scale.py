"""Start-up and first-step cost against the size of the training table (issue 40, item 4).

A user's CSV of short math prompts (own column names ``question``/``target``, about 30 bytes a
row) at 1k / 100k / 1M rows, trained for one step by the tiny pair (``graft_rl.policy.tiny``, built
locally) with ``execution: local`` and ``ray``. Each cell runs in a fresh process and reports:

- ``start (s)``: ``Trainer(cfg)`` -- reading the table, the reward check, building the workers,
  the prompt-length checks;
- ``first step (s)``: from the start of the process's work to the end of step 1;
- ``peak RSS (MB)``: the driver's peak resident memory (``ru_maxrss``), and under Ray each policy
  actor's too (read from ``/proc`` while the actors live).

Goal: the first step at 1M rows within 1.5x of 1k, peak RSS growth under 500 MB.

    python benchmarks/data_scale.py                       # 1k, 100k, 1M rows; local and ray
    python benchmarks/data_scale.py --rows 1000 --toy     # seconds: checks it runs (tests/test_benchmarks_run.py)

Prints a Markdown table; results with the machine in docs/benchmarks.md ("Dataset size").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def write_csv(path: Path, rows: int) -> None:
    """``rows`` short arithmetic prompts under the user's own column names (about 30 bytes a row)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    i = pa.array(range(rows), pa.int64())
    a = [str(x % 997) for x in range(rows)]
    b = [str((x * 7919) % 1009) for x in range(rows)]
    question = [f"What is {x} + {y}?" for x, y in zip(a, b, strict=True)]
    target = [int(x) + int(y) for x, y in zip(a, b, strict=True)]
    pacsv.write_csv(pa.table({"qid": i, "question": question, "target": target}), path)


def _rss_mb(pid: int) -> float | None:
    """Peak resident memory of a live process (``VmHWM``), in MB; None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _actor_pids() -> list[int]:
    """The Ray actor processes of this machine that hold a policy (``ray::PolicyWorker...``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith("ray::") and "Worker" in cmd and "IDLE" not in cmd:
            out.append(p.pid)
    return out


def child(csv: Path, execution: str, models: list[str], out: Path) -> None:
    """One cell, in this fresh process: build the trainer, run one step, print a JSON line."""
    t0 = time.perf_counter()
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    cfg = load_config(
        {
            "run_dir": str(out),
            "steps": 1,
            "prompt_batch": 8,
            "minibatch": 8,
            "n": 2,
            "max_new_tokens": 8,
            "checkpoint_every": 100,
            "execution": execution,
            "ray": {"num_cpus": 1},
            "data": {"train": str(csv), "columns": {"id": "qid", "problem": "question", "answer": "target"}},
            "validation": {"data": []},
            "policies": [{"name": "A", "model": models[0]}, {"name": "B", "model": models[1]}],
        }
    )
    tr = Trainer(cfg, show_progress=False)
    t_start = time.perf_counter() - t0
    actors = _actor_pids() if execution == "ray" else []
    tr.run()
    t_step = time.perf_counter() - t0
    actor_rss = [_rss_mb(p) for p in actors]
    tr.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"start": t_start, "step": t_step, "rss": rss, "actor_rss": actor_rss}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1000,100000,1000000", help="comma-separated table sizes")
    ap.add_argument("--execution", default="local,ray", help="comma-separated: local, ray")
    ap.add_argument("--toy", action="store_true", help="no Ray, the given sizes only: checks the script runs")
    ap.add_argument("--child", nargs=4, metavar=("CSV", "EXECUTION", "MODEL_A", "MODEL_B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        csv, execution, a, b = args.child
        child(Path(csv), execution, [a, b], Path(tempfile.mkdtemp()) / "run")
        return

    from graft_rl.policy.tiny import build_tiny_pair

    work = Path(tempfile.mkdtemp(prefix="graft_data_scale_"))
    models = [str(p) for p in build_tiny_pair(work / "models")]
    sizes = [int(x) for x in args.rows.split(",")]
    executions = ["local"] if args.toy else args.execution.split(",")
    cpu = platform.processor() or platform.machine()
    print(f"dataset size, tiny pair, one step of 8 prompts x 2 samples; {cpu}, {os.cpu_count()} cores")
    print("| rows | CSV (MB) | execution | start (s) | first step (s) | driver peak RSS (MB) | actors' peak RSS (MB) |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for rows in sizes:
        csv = work / f"train_{rows}.csv"
        write_csv(csv, rows)
        for execution in executions:
            env = {**os.environ, "GRAFT_RL_VERIFY_WORKERS": "1"}
            res = subprocess.run(
                [sys.executable, __file__, "--child", str(csv), execution, *models],
                capture_output=True,
                text=True,
                env=env,
                timeout=3600,
            )
            if res.returncode != 0:
                sys.exit(f"rows={rows} execution={execution} failed:\n{res.stderr[-3000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            actors = ", ".join(f"{x:.0f}" for x in r["actor_rss"] if x is not None) or "-"
            print(
                f"| {rows:,} | {csv.stat().st_size / 1e6:.1f} | {execution} | {r['start']:.1f} | {r['step']:.1f} | "
                f"{r['rss']:.0f} | {actors} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
