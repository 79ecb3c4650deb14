"""Terminal summaries of a run, read from its ``metrics.jsonl`` only."""

from __future__ import annotations

import statistics
from pathlib import Path

from graft_rl.rundir import read_log

__all__ = ["read_metrics", "run_summary", "print_run_summary"]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a graft run directory?)")
    return read_log(path)[0]  # a torn last line (power loss mid-write) is ignored


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def read_validation(run_dir: str | Path) -> list[dict]:
    return read_log(Path(run_dir) / "validation.jsonl")[0]


def run_summary(run_dir: str | Path) -> list[dict]:
    """Per policy: steps, first/last reward, validation before/after/best, groups received, admitted fraction, time."""
    lines = read_metrics(run_dir)
    val = read_validation(run_dir)
    out = []
    for name in dict.fromkeys(ln["policy"] for ln in lines):
        mine = [ln for ln in lines if ln["policy"] == name]
        k = max(1, len(mine) // 4)
        out.append(
            {
                "policy": name,
                "steps": len(mine),
                "reward_first": _mean(ln["reward_mean"] for ln in mine[:k]),
                "reward_last": _mean(ln["reward_mean"] for ln in mine[-k:]),
                "exchanged_in": sum(ln.get("exchanged_in") or 0 for ln in mine),
                "admitted_frac": _mean(ln.get("admitted_frac") for ln in mine),
                "clip_frac_self": _mean(ln.get("clip_frac_self") for ln in mine),
                "clip_frac_peer": _mean(ln.get("clip_frac_peer") for ln in mine),
                "rollouts": sum(ln.get("rollouts") or 0 for ln in mine),
                "val_before": next((v["val/score"] for v in val if v["policy"] == name), None),
                "val_after": next((v["val/score"] for v in reversed(val) if v["policy"] == name), None),
                "val_best": max((v["val/score"] for v in val if v["policy"] == name), default=None),
                "best_step": next((v.get("best_step") for v in reversed(val) if v["policy"] == name), None),
                "seconds": sum((ln.get("time_generate") or 0) + (ln.get("time_reward") or 0)
                               + (ln.get("time_score") or 0) + (ln.get("time_update") or 0) for ln in mine),
            }
        )
    return out


def _fmt(v, pct=False):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{100 * v:.1f}%" if pct else f"{v:.3f}"
    return str(v)


def print_run_summary(run_dir: str | Path) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = run_summary(run_dir)
    table = Table(title=f"graft run {run_dir}")
    cols = [("policy", False), ("steps", False), ("reward first¼", True), ("reward last¼", True),
            ("val before", True), ("val after", True), ("val best (step)", True),
            ("groups in", False), ("admitted", True), ("clip self", True), ("clip peer", True), ("train s", False)]
    for c, _ in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(
            r["policy"], str(r["steps"]), _fmt(r["reward_first"], True), _fmt(r["reward_last"], True),
            _fmt(r["val_before"], True), _fmt(r["val_after"], True),
            f"{_fmt(r['val_best'], True)} ({r['best_step']})" if r["val_best"] is not None else "-",
            str(int(r["exchanged_in"])), _fmt(r["admitted_frac"], True), _fmt(r["clip_frac_self"], True),
            _fmt(r["clip_frac_peer"], True), f"{r['seconds']:.0f}",
        )
    Console(width=max(Console().width, 150)).print(table)
    print("reward: training-batch pass rate; val: held-out pass@1 (validation.jsonl); groups in: peer groups grafted "
          "into this policy; admitted: peer responses passing the compatibility gate.")
