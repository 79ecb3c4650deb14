"""Cost of verifying a weight push (graft_rl.policy.pushcheck): row digests of one decoder layer of
Qwen2.5-3B's shape, trainer side (fp32 master cast to bf16, then digested) and engine side (bf16),
scaled to the whole model (3.09 B parameters).

    python benchmarks/push_digest.py           # one 77 M-parameter layer, 2 threads
    python benchmarks/push_digest.py --toy     # a few seconds' check that it runs (tests/test_benchmarks_run.py)

Prints a Markdown table; results with the machine in docs/benchmarks.md ("Push verification cost").
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from graft_rl.policy.pushcheck import row_digest  # noqa: E402

#: Qwen2.5-3B: hidden, MLP width, key/value rows, layers, vocabulary, parameters
QWEN25_3B = dict(hidden=2048, inter=11008, kv=256, layers=36, vocab=151936, params=3.09e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", action="store_true", help="a 1/16-width layer: checks the script runs")
    args = ap.parse_args()
    torch.set_num_threads(2)
    s = QWEN25_3B
    f = 16 if args.toy else 1
    h, i, kv = s["hidden"] // f, s["inter"] // f, s["kv"] // f
    layer = [torch.randn(*shape) for shape in ((h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i))]
    n = sum(t.numel() for t in layer)
    [row_digest(t, torch.bfloat16) for t in layer]  # warm-up
    t0 = time.perf_counter()
    [row_digest(t, torch.bfloat16) for t in layer]
    trainer = time.perf_counter() - t0
    engine_layer = [t.bfloat16() for t in layer]
    t0 = time.perf_counter()
    [row_digest(t) for t in engine_layer]
    engine = time.perf_counter() - t0
    rows = s["layers"] * (h + 2 * kv + h + 2 * i + h) + 2 * s["vocab"]
    cpu = platform.processor() or platform.machine()
    print(f"push digest, {n / 1e6:.1f} M-parameter layer, {cpu}, torch {torch.__version__}, 2 threads")
    print("| side | ns / parameter | whole 3.09 B model (s) |")
    print("|---|---|---|")
    for name, t in (("trainer (fp32 → bf16, digest)", trainer), ("engine (bf16)", engine)):
        print(f"| {name} | {t / n * 1e9:.2f} | {t / n * s['params']:.1f} |")
    print(f"digest size per side: {rows / 1e6:.2f} M rows × 8 B = {rows * 8 / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
