"""Build a CPU testbed pair once and ship it in the package (src/graft_rl/testbed_files/<pair>).

    python scripts/build_testbed.py --pair transfer   # build (about 2-3 minutes on 2 cores) and install
    python scripts/build_testbed.py --pair natural
    python scripts/build_testbed.py --pair lookup     # the end-to-end mechanism check's pair (about 3 minutes)
    python scripts/build_testbed.py --from DIR        # install an existing build (ensure_testbed's cache)

Writes ``testbed_files/<pair>/{model_a,model_b}/`` (``save_pretrained`` + tokenizer), ``train.jsonl``,
``heldout.jsonl`` and ``testbed.json``: the build settings, the warm-up record, the sha256 of
every shipped file, the greedy held-out accuracy of each model on the first 64 held-out problems
(the fixed sample the test re-measures; per family too for a pair with families), and the machine
that built it. Floating-point
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
sys.path.insert(0, str(ROOT / "scripts"))

from testbed_build import ensure_testbed  # noqa: E402

from graft_rl.testbed import PAIRS, Testbed, shipped_root  # noqa: E402

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SAMPLE = 64  # held-out problems the shipped accuracy is measured on (greedy)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy_heldout_accuracy(
    tb: Testbed, which: str, n: int = SAMPLE, by_family: bool = False
) -> float | dict[str, float]:
    """Greedy (top-k 1) pass@1 of one shipped model on the first ``n`` held-out problems (per family: a dict)."""
    from graft_rl.data import load_jsonl
    from graft_rl.engine.evaluation import evaluate_policy, pass1_by_family
    from graft_rl.policy import Policy, PolicyConfig

    pd = {p["name"]: p for p in tb.policy_dicts()}[which]
    pol = Policy(PolicyConfig(**pd))
    problems = load_jsonl(tb.eval_file, n)
    res = evaluate_policy(
        pol, problems, "gsm8k", samples=1, temperature=1.0, top_p=1.0, max_new_tokens=40, seed=0, top_k=1
    )
    return pass1_by_family(problems, res["correct"], 1) if by_family else res["pass@1"]


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
    ap.add_argument("--pair", default="transfer", choices=sorted(PAIRS), help="which pair (default: transfer)")
    ap.add_argument("--from", dest="src", default=None, help="an existing ensure_testbed() directory to install")
    args = ap.parse_args()
    import torch
    import transformers

    root = shipped_root(args.pair)
    with tempfile.TemporaryDirectory() as tmp:
        built = ensure_testbed(Path(args.src) if args.src else Path(tmp) / "testbed", pair=args.pair)
        meta = json.loads((built.root / "testbed.json").read_text())
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        for model in ("model_a", "model_b"):
            (root / model).mkdir()
            for f in MODEL_FILES:
                if (built.root / model / f).is_file():
                    shutil.copy2(built.root / model / f, root / model / f)
        for f in ("train.jsonl", "heldout.jsonl"):
            shutil.copy2(built.root / f, root / f)
    shipped = Testbed(root, shipped=True, pair=args.pair)
    files = {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}
    acc = {w: greedy_heldout_accuracy(shipped, w) for w in ("A", "B")}
    greedy = {"problems": SAMPLE, "accuracy": acc}
    if shipped.families:
        greedy["by_family"] = {w: greedy_heldout_accuracy(shipped, w, by_family=True) for w in ("A", "B")}
    meta.update(
        {
            "pair": args.pair,
            "files": files,
            "heldout_greedy": greedy,
            "built_on": {
                "cpu": cpu_model(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "date": datetime.date.today().isoformat(),
            },
        }
    )
    (root / "testbed.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    print(
        f"shipped testbed in {root}: {len(files)} files, {size / 1e6:.1f} MB; greedy held-out accuracy "
        f"on {SAMPLE}: A {acc['A']:.3f}, B {acc['B']:.3f}"
        + (f"; by family {greedy['by_family']}" if shipped.families else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
