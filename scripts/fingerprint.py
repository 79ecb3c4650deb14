"""Fingerprint every testbed preset: the proof that a refactor changed the code's shape, not its results.

For each ``configs/testbed/*.yaml`` (every method and ablation of the paper's Tables 2 and 5 and
Appendix G) it trains the shipped testbed pair for a few small steps with the preset's own method
keys, then prints one row per preset: a digest of ``metrics.jsonl`` (every value but wall times and
the engine-trainer gap, ``mismatch_*`` / ``correction_*``, which ``--json`` digests apart as ``gap``),
of the exchange records, and of both policies' final weights, plus two readable numbers (B's last
loss and A's grafted groups). "but clip" digests the metrics without the self/peer clip fractions
(``--json`` keeps their values per step, and every metric line under ``lines``, to name what a change
moved), for changes that correct those diagnostics alone. Run it on two checkouts and compare the tables: identical digests
mean identical numbers to the last bit on this CPU.

Reproduce (about 6 minutes on 2 cores of an Intel Xeon, alone on the machine):
    python scripts/fingerprint.py [--steps 3] [--only graft hacpo] [--json out.json]
    PYTHONPATH=/path/to/other/checkout/src python scripts/fingerprint.py   # the other side
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("graft_rl") is None:  # not installed: this checkout's (PYTHONPATH picks another)
    sys.path.insert(0, str(ROOT / "src"))

#: small steps of the testbed presets: each step still grafts, gates and clips (n = 4 for every preset,
#: so the GRPO n=8/16/32 rows coincide: they differ only in n)
SMALL = ["prompt_batch=16", "minibatch=4", "n=4", "max_new_tokens=24", "checkpoint_every=100", "validation.data=[]"]


#: the self/peer clipped-token fractions (Table 9): a digest without them tells a change of the other
#: metrics from a change of these diagnostics alone (``clip`` in ``--json`` holds their values)
CLIP_KEYS = ("clip_frac_self", "clip_frac_peer")


#: the engine-trainer gap (0.3.0): measurements of the engine, kept out of the metrics digests so that a
#: run from before they existed compares equal on everything else (``gap`` digests them alone)
GAP_PREFIXES = ("mismatch_", "correction_")


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def fingerprint(config: Path, steps: int, work: Path) -> dict:
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file

    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    run_dir = work / config.stem
    cfg = load_config(config, [f"run_dir={run_dir}", f"steps={steps}", *SMALL])
    tr = Trainer(cfg, show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in ln.items() if not k.startswith(("time_", *GAP_PREFIXES))} for ln in lines]
    gap = [{k: v for k, v in ln.items() if k.startswith(GAP_PREFIXES)} for ln in lines]
    exchange = []
    for f in sorted((run_dir / "exchange").rglob("*.parquet")):
        # `moved` (0.3.0: what moved, "response" for every peer row before XGRPO) is left out of the digest,
        # so that records from before the column compare equal on everything else
        rows = [{k: v for k, v in r.items() if k != "moved"} for r in pq.read_table(f).to_pylist()]
        exchange.append([f.parent.name, f.name, rows])
    weights = {}
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    for pol in sorted(p for p in last.iterdir() if p.is_dir()):
        h = hashlib.sha256()
        for shard in sorted(pol.glob("*.safetensors")):
            for name, t in sorted(load_file(str(shard)).items()):
                h.update(name.encode())
                h.update(t.to(torch.float32).contiguous().numpy().tobytes())
        weights[pol.name] = h.hexdigest()[:12]
    first, second = list(dict.fromkeys(ln["policy"] for ln in lines))[:2]  # the pair's A and B (a swarm's first two)
    b_last = next(ln for ln in reversed(lines) if ln["policy"] == second)
    grafted = sum(ln.get("exchanged_in", 0) or 0 for ln in lines if ln["policy"] == first)
    clip = [[ln["step"], ln["policy"], ln.get("clip_frac_self"), ln.get("clip_frac_peer")] for ln in lines]
    return {
        "metrics": _digest(metrics),
        "metrics_but_clip": _digest([{k: v for k, v in m.items() if k not in CLIP_KEYS} for m in metrics]),
        "clip": clip,
        "gap": _digest(gap),
        "exchange": _digest(exchange),
        "weights": _digest(weights),
        "loss_B": b_last.get("loss"),
        "lines": [{**m, **g} for m, g in zip(metrics, gap, strict=True)],  # the values behind the digests
        "grafted_A": grafted,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="preset names (file stems) to run; default: every testbed preset")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args()
    from tqdm.auto import tqdm

    import graft_rl

    configs = sorted(p for p in (ROOT / "configs" / "testbed").glob("*.yaml") if p.name != "base.yaml")
    if args.only:
        configs = [p for p in configs if p.stem in args.only]
    print(f"graft_rl from {Path(graft_rl.__file__).parent}")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in tqdm(configs, desc="fingerprint", unit="preset"):
            out[cfg.stem] = fingerprint(cfg, args.steps, Path(tmp))
    head = (
        f"{'preset':<26}{'metrics':>14}{'but clip':>14}{'exchange':>14}{'weights':>14}{'loss B':>14}{'grafted A':>11}"
    )
    print(head)
    for name, r in out.items():
        loss = "-" if r["loss_B"] is None else f"{r['loss_B']:.6g}"
        print(
            f"{name:<26}{r['metrics']:>14}{r['metrics_but_clip']:>14}{r['exchange']:>14}{r['weights']:>14}"
            f"{loss:>14}{r['grafted_A']:>11g}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
