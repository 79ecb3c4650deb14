"""Do a step's metrics depend on how its tokens are cut into forward passes? They must not (SPEC §1.14):
the cut (``micro_batch_tokens``) does not change training, so neither may the clip fractions, the
engine-trainer gap, the correction's weights, the loss or the KL as logged.

Trains the testbed GRAFT preset (``configs/testbed/graft.yaml``) with ``rollout.lag=1
method.correction=tis`` (so the gap and the correction have something to measure) once per cut, same
seed, and prints per step and policy each metric at the automatic size and its largest relative
difference over the other cuts. Counts (the clip fractions' numerators and denominators) must agree
exactly, float sums to rounding; the gap of step 1 (no lag yet: k3 ~1e-13, |log mu - log pi_old| ~4e-7, the
float32 rounding of the same weights' log-probs) differs in its noise and is left out of the last line.

Reproduce (3 steps x 3 cuts, about 2 minutes on 2 cores):
    python benchmarks/step_stats.py [--steps 3] [--cuts auto 96 48]
    python benchmarks/step_stats.py --toy     # 1 step of 8 prompts: the code path only (tests/test_benchmarks_run.py)
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/step_stats.py --cuts auto 96   # another version
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("graft_rl") is None:  # not installed: this checkout's (PYTHONPATH picks another)
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

#: a mean |log mu - log pi_old| below this is the float32 rounding of log-probs (same weights), not a gap
NOISE = 1e-5

KEYS = (
    "clip_frac_self",
    "clip_frac_peer",
    "correction_weight",
    "correction_masked",
    "mismatch_kl",
    "mismatch_abs",
    "mismatch_out",
    "loss",
    "grad_norm",
)


def run(cut: str, steps: int, extra: list[str], work: Path) -> list[dict]:
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    keys = [f"run_dir={work / cut}", f"steps={steps}", "rollout.lag=1", "method.correction=tis"]
    keys += ["checkpoint_every=1000", "validation.data=[]", *extra]
    if cut != "auto":
        keys += [f"policies.0.micro_batch_tokens={cut}", f"policies.1.micro_batch_tokens={cut}"]
    tr = Trainer(load_config(ROOT / "configs" / "testbed" / "graft.yaml", keys), show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    return [json.loads(x) for x in (work / cut / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cuts", nargs="+", default=["auto", "96", "48"], help="micro_batch_tokens values (auto first)")
    ap.add_argument("--toy", action="store_true")
    args = ap.parse_args()
    import torch
    from tqdm.auto import tqdm

    import graft_rl  # imported before build_testbed, which puts this checkout's src first on sys.path

    cpu_model = importlib.import_module("build_testbed").cpu_model

    steps, extra = (1, ["prompt_batch=8", "minibatch=2", "n=4", "max_new_tokens=16"]) if args.toy else (args.steps, [])
    cuts = args.cuts if args.cuts[0] == "auto" else ["auto", *args.cuts]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {cut: run(cut, steps, extra, Path(tmp)) for cut in tqdm(cuts, desc="cuts", unit="run")}
    print(
        f"# step metrics by micro_batch_tokens ({', '.join(cuts)}): testbed GRAFT, rollout.lag=1, tis, "
        f"{steps} step(s) ({cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"graft_rl from {Path(graft_rl.__file__).parent})\n"
    )
    print("| step | policy | metric | auto | largest relative difference over the other cuts |")
    print("|---:|---|---|---:|---:|")
    worst = 0.0
    for i, line in enumerate(runs["auto"]):
        for key in KEYS:
            base = line.get(key)
            if base is None:
                continue
            diffs = [abs(runs[c][i][key] - base) / max(abs(base), 1e-12) for c in cuts[1:]]
            rel = max(diffs, default=0.0)
            noise = (line.get("mismatch_abs") or 0.0) < NOISE  # no lag yet: the gap is float32 rounding
            if key.startswith(("clip_frac", "correction_")) or (key.startswith("mismatch") and not noise):
                worst = max(worst, rel)
            print(f"| {line['step']} | {line['policy']} | {key} | {base:.6g} | {rel:.2e} |")
    print(
        f"\nlargest relative difference of clip_frac_*, correction_* and (where mismatch_abs >= {NOISE:g} nats, "
        f"above float32 noise) mismatch_*: {worst:.2e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
