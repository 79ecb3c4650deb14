"""The tracker's view of the example, exported: each run's curves read back from its MLflow store.

    python examples/word_games/chart.py runs/word_games/graft runs/word_games/grpo --out docs/word_games.png

Reads ``RUN_DIR/mlruns`` (the file store ``report_to: [mlflow]`` writes) through MLflow's own client,
so the chart shows what the tracker recorded; ``mlflow ui --backend-store-uri RUN_DIR/mlruns`` shows
the same runs interactively (with the completions tables under Artifacts).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [
    ("reward_mean", "training reward (mean)"),
    ("val.heldout", "held-out pass@1 (validation)"),
    ("exchanged_in", "grafted groups received per step"),
    ("admitted_frac", "their responses the gate admitted"),
]


def history(run_dir: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow_run_id"]
    run = client.get_run(run_id)
    out = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}
    return run.data.params.get("method.name", run_dir.name), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("word_games.png"))
    args = ap.parse_args()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.8 * len(PANELS), 3.4))
    styles = ["-", "--", ":"]
    for r, run_dir in enumerate(args.runs):
        method, hist = history(run_dir)
        policies = sorted({k.split("/", 1)[0] for k in hist})
        for ax, (key, title) in zip(axes, PANELS, strict=True):
            for c, pol in enumerate(policies):
                pts = hist.get(f"{pol}/{key}", [])
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        styles[r % 3],
                        color=f"C{c}",
                        marker="o",
                        ms=3,
                        label=f"{pol} ({method})",
                    )
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle("word games: SmolLM2-135M + Gemma3-270M, from the runs' MLflow stores", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
