"""Build the CPU testbed pair once and ship it in the package (src/graft_rl/testbed_files).

    python scripts/build_testbed.py                 # build (about 2-3 minutes on 2 cores) and install
    python scripts/build_testbed.py --from DIR      # install an existing build (ensure_testbed's cache)

Writes ``testbed_files/{model_a,model_b}/`` (``save_pretrained`` + tokenizer), ``train.jsonl``,
``heldout.jsonl`` and ``testbed.json``: the build settings, the warm-up record, the sha256 of
every shipped file, the greedy held-out accuracy of each model on the first 64 held-out problems
(the fixed sample the test re-measures), and the machine that built it. Floating-point
differences between CPUs compound over the warm-up, so the pair is built here once and shipped,
not rebuilt on each user's machine.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from graft_rl.testbed import SHIPPED_ROOT, Testbed, ensure_testbed  # noqa: E402

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SAMPLE = 64  # held-out problems the shipped accuracy is measured on (greedy)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy_heldout_accuracy(tb: Testbed, which: str, n: int = SAMPLE) -> float:
    """Greedy (top-k 1) pass@1 of one shipped model on the first ``n`` held-out problems."""
    from graft_rl.data import load_jsonl
    from graft_rl.evaluation import evaluate_policy
    from graft_rl.policy import Policy, PolicyConfig

    pd = {p["name"]: p for p in tb.policy_dicts()}[which]
    pol = Policy(PolicyConfig(**pd))
    problems = load_jsonl(tb.eval_file, n)
    return evaluate_policy(pol, problems, "gsm8k", samples=1, temperature=1.0, top_p=1.0, max_new_tokens=40, seed=0,
                           top_k=1)["pass@1"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="src", default=None, help="an existing ensure_testbed() directory to install")
    args = ap.parse_args()
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        built = ensure_testbed(Path(args.src) if args.src else Path(tmp) / "testbed")
        meta = json.loads((built.root / "testbed.json").read_text())
        if SHIPPED_ROOT.exists():
            shutil.rmtree(SHIPPED_ROOT)
        SHIPPED_ROOT.mkdir(parents=True)
        for model in ("model_a", "model_b"):
            (SHIPPED_ROOT / model).mkdir()
            for f in MODEL_FILES:
                if (built.root / model / f).is_file():
                    shutil.copy2(built.root / model / f, SHIPPED_ROOT / model / f)
        for f in ("train.jsonl", "heldout.jsonl"):
            shutil.copy2(built.root / f, SHIPPED_ROOT / f)
    shipped = Testbed(SHIPPED_ROOT, shipped=True)
    files = {str(p.relative_to(SHIPPED_ROOT)): sha256(p) for p in sorted(SHIPPED_ROOT.rglob("*")) if p.is_file()}
    acc = {w: greedy_heldout_accuracy(shipped, w) for w in ("A", "B")}
    meta.update({
        "files": files,
        "heldout_greedy": {"problems": SAMPLE, "accuracy": acc},
        "built_on": {"cpu": cpu_model(), "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "date": datetime.date.today().isoformat()},
    })
    (SHIPPED_ROOT / "testbed.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(p.stat().st_size for p in SHIPPED_ROOT.rglob("*") if p.is_file())
    print(f"shipped testbed in {SHIPPED_ROOT}: {len(files)} files, {size / 1e6:.1f} MB; greedy held-out accuracy "
          f"on {SAMPLE}: A {acc['A']:.3f}, B {acc['B']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
