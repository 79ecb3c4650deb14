"""`graft preflight` over the paper presets: does every row of Tables 1-2 run end to end on this machine?

    python benchmarks/preflight_presets.py                       # every pair-1 preset + pair 2's and 3's graft.yaml
    python benchmarks/preflight_presets.py --presets pair1/graft.yaml pair1/hacpo.yaml
    .venv-vllm/bin/python benchmarks/preflight_presets.py --presets pair1/graft.yaml   # with vLLM (CPU build)

Each preset runs in its own `graft preflight` process (its own Ray cluster), one after another.
Prints a Markdown table (preset, result, seconds, the rollout backend that ran, the first failing
stage's line) and, with ``--out FILE``, writes the checklists as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAPER = ROOT / "configs" / "paper"
sys.path.insert(0, str(ROOT / "scripts"))

from build_testbed import cpu_model  # noqa: E402  (the CPU name every recorded number states)


def default_presets() -> list[str]:
    pair1 = sorted(p.name for p in (PAPER / "pair1").glob("*.yaml") if p.name != "base.yaml")
    return [f"pair1/{p}" for p in pair1] + ["pair2/graft.yaml", "pair3/graft.yaml"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="*", default=None, help="paths under configs/paper (default: see above)")
    ap.add_argument("--out", default=None, help="write every checklist as JSON here")
    args = ap.parse_args()
    presets = args.presets or default_presets()
    try:
        import vllm  # noqa: F401

        backend_here = "vllm"
    except ImportError:
        backend_here = "hf (vLLM not installed)"
    print(
        f"graft preflight over {len(presets)} presets on {cpu_model()}, {os.cpu_count()} cores; python {sys.executable}; "
        f"vLLM presets run with: {backend_here}",
        flush=True,
    )
    rows, results = [], {}
    for preset in presets:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "preflight.json"
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "graft_rl.commands.cli", "preflight", str(PAPER / preset), "--json", str(out)],
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - t0
            res = json.loads(out.read_text()) if out.is_file() else None
        if res is None:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append((preset, "FAIL", seconds, "-", tail))
        else:
            failed = next((s for s in res["stages"] if s["status"] == "FAIL"), None)
            build = next(s for s in res["stages"] if s["name"] == "model build")["detail"]
            backend = "vllm" if "vllm" in build else "hf"
            rows.append(
                (
                    preset,
                    "passed" if res["ok"] else "FAIL",
                    seconds,
                    backend,
                    f"{failed['name']}: {failed['detail']}" if failed else "",
                )
            )
            results[preset] = res
        print(f"  {rows[-1][1]:>6}  {preset:<45} {seconds:6.0f} s  {rows[-1][4]}", flush=True)
    print()
    print("| preset | result | seconds | rollouts | failing stage |")
    print("|---|---|---:|---|---|")
    for preset, status, seconds, backend, why in rows:
        print(f"| {preset} | {status} | {seconds:.0f} | {backend} | {why.replace('|', '/')} |")
    passed = sum(1 for r in rows if r[1] == "passed")
    total = sum(r[2] for r in rows)
    print(f"\n{passed}/{len(rows)} passed, {total / 60:.1f} min in all ({cpu_model()}, {os.cpu_count()} cores)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
