"""Terminal summaries of a run, read from its ``metrics.jsonl`` only."""

from __future__ import annotations

import statistics
from pathlib import Path

from graft_rl.engine.rundir import read_log
from graft_rl.errors import DOCS

__all__ = ["read_metrics", "run_summary", "family_summary", "print_run_summary", "reward_call_problems"]


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
                "admitted_frac": _pooled_admitted(mine),
                "clip_frac_self": _mean(ln.get("clip_frac_self") for ln in mine),
                "clip_frac_peer": _mean(ln.get("clip_frac_peer") for ln in mine),
                "rollouts": sum(ln.get("rollouts") or 0 for ln in mine),
                "mismatch_kl": _mean(ln.get("mismatch_kl") for ln in mine),
                "mismatch_max": max(
                    (ln["mismatch_max"] for ln in mine if ln.get("mismatch_max") is not None), default=None
                ),
                "val_before": next((v["val/score"] for v in val if v["policy"] == name), None),
                "val_after": next((v["val/score"] for v in reversed(val) if v["policy"] == name), None),
                "best_step": (best := next((v.get("best_step") for v in reversed(val) if v["policy"] == name), None)),
                # the score of the selected checkpoint (step 0 is not a candidate unless validation.select_initial)
                "val_best": next((v["val/score"] for v in val if v["policy"] == name and v["step"] == best), None),
                "seconds": sum(
                    (ln.get("time_generate") or 0)
                    + (ln.get("time_reward") or 0)
                    + (ln.get("time_logprobs") or 0)
                    + (ln.get("time_update") or 0)
                    for ln in mine
                ),
            }
        )
    return out


def large_gap_line(rows: list[dict]) -> str | None:
    """One line naming the policies whose engine and trainer disagreed beyond
    :data:`~graft_rl.methods.corrections.LARGE_GAP_KL` per token over the run (None: none did)."""
    from graft_rl.methods.corrections import LARGE_GAP_KL

    big = [r for r in rows if r.get("mismatch_kl") is not None and r["mismatch_kl"] > LARGE_GAP_KL]
    if not big:
        return None
    each = ", ".join(
        f"{r['policy']} mismatch_kl {r['mismatch_kl']:.1e} per token (largest |log mu - log pi_old| "
        f"{r['mismatch_max']:.2f})"
        for r in big
    )
    return (
        f"engine and trainer disagree: {each}, above {LARGE_GAP_KL:.0e}; a method.correction (tis, icepop) "
        f"corrects it ({DOCS}design/#engine-and-trainer)"
    )


def family_summary(run_dir: str | Path) -> list[dict]:
    """Per policy and prompt family (runs whose data names a few families, e.g. the transfer testbed):
    held-out pass@1 before → after (and at the selected step), own groups that failed entirely, peer
    groups grafted in and the fraction of their responses the gate admitted. Empty for other runs."""
    lines, val = read_metrics(run_dir), read_validation(run_dir)
    out = []
    for name in dict.fromkeys(ln["policy"] for ln in lines):
        mine = [ln for ln in lines if ln["policy"] == name]
        vals = [v for v in val if v["policy"] == name]
        best = next((v.get("best_step") for v in reversed(vals)), None)
        fams = sorted(
            {k.split("/", 1)[1] for ln in mine for k in ln if k.startswith("groups/")}
            | {k.rsplit("/", 1)[1] for v in vals for k in v if k.count("/") == 2 and k.startswith("val/")}
        )
        for fam in fams:

            def total(key: str, fam: str = fam, mine: list = mine) -> float:
                return sum(ln.get(f"{key}/{fam}") or 0 for ln in mine)

            def val_at(v: dict | None, fam: str = fam) -> float | None:
                ks = [k for k in (v or {}) if k.startswith("val/") and k.endswith(f"/{fam}") and k.count("/") == 2]
                return _mean(v[k] for k in ks) if ks else None

            rows = total("grafted_rows")
            out.append(
                {
                    "policy": name,
                    "family": fam,
                    "val_before": val_at(vals[0] if vals else None),
                    "val_after": val_at(vals[-1] if vals else None),
                    "val_best": val_at(next((v for v in vals if v["step"] == best), None)),
                    "groups": total("groups"),
                    "all_fail": total("all_fail"),
                    "grafted": total("grafted"),
                    "grafted_rows": rows,
                    "admitted_rows": total("admitted_rows"),
                    "admitted_frac": total("admitted_rows") / rows if rows else None,
                }
            )
    return out


def reward_call_problems(run_dir: str | Path) -> str | None:
    """One line when reward calls of the run's training steps timed out, failed or were left unchecked
    (each scored 0; a timed-out call's worker was killed with every process it started), else None."""
    lines = read_metrics(run_dir)
    n = {k: sum(ln.get(k) or 0 for ln in lines) for k in ("verify_timeouts", "verify_errors", "verify_over_budget")}
    if not any(n.values()):
        return None
    parts = [
        f"{n['verify_timeouts']} timed out (data.verify_timeout; each call's processes were ended)",
        f"{n['verify_errors']} raised or crashed",
        f"{n['verify_over_budget']} left unchecked (data.verify_budget)",
    ]
    return "reward calls scored 0: " + ", ".join(p for p, v in zip(parts, n.values(), strict=True) if v)


def _pooled_admitted(lines: list[dict]) -> float | None:
    """Admitted fraction pooled over the run: peer responses with weight > 0 / all grafted peer
    responses (the definition `graft analyze` uses; a step with many grafted responses counts more)."""
    n = adm = 0.0
    for ln in lines:
        k = len(ln.get("compat_token") or [])
        if k and ln.get("admitted_frac") is not None:
            n += k
            adm += ln["admitted_frac"] * k
    return adm / n if n else None


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def print_run_summary(run_dir: str | Path, width: int | None = None) -> None:
    """The end-of-run table, narrow enough for an 80-column terminal, and what each column means."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    rows = run_summary(run_dir)
    table = Table(
        title=f"graft run {run_dir}", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left"
    )
    for c, just in (
        ("policy", "left"),
        ("reward %", "right"),
        ("held-out %", "right"),
        ("best@step", "right"),
        ("grafted", "right"),
        ("adm. %", "right"),
        ("clip %", "right"),
        ("s", "right"),
    ):
        table.add_column(c, justify=just, no_wrap=True)
    for r in rows:
        table.add_row(
            r["policy"],
            f"{_pct(r['reward_first'])}→{_pct(r['reward_last'])}",
            f"{_pct(r['val_before'])}→{_pct(r['val_after'])}",
            f"{_pct(r['val_best'])}@{r['best_step']}" if r["val_best"] is not None else "-",
            str(int(r["exchanged_in"])),
            _pct(r["admitted_frac"]),
            f"{_pct(r['clip_frac_self'])}/{_pct(r['clip_frac_peer'])}",
            f"{r['seconds']:.0f}",
        )
    console = Console(width=width) if width else Console()
    console.print(table)
    gap = large_gap_line(rows)
    if gap:
        console.print(gap, soft_wrap=True)  # one line: grep finds it
    calls = reward_call_problems(run_dir)
    if calls:
        console.print(calls, soft_wrap=True)  # one line: grep finds it
    fam_rows = family_summary(run_dir)
    if fam_rows:
        ft = Table(
            title="per prompt family", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left"
        )
        for c, just in (
            ("policy", "left"),
            ("family", "left"),
            ("held-out %", "right"),
            ("best", "right"),
            ("all-fail %", "right"),
            ("grafted", "right"),
            ("adm. %", "right"),
        ):
            ft.add_column(c, justify=just, no_wrap=True)
        for r in fam_rows:
            ft.add_row(
                r["policy"],
                r["family"],
                f"{_pct(r['val_before'])}→{_pct(r['val_after'])}",
                _pct(r["val_best"]),
                _pct(r["all_fail"] / r["groups"]) if r["groups"] else "-",
                str(int(r["grafted"])),
                _pct(r["admitted_frac"]),
            )
        console.print(ft)
    console.print(
        "reward: training-batch pass rate, first → last quarter of the steps. held-out: validation pass@1 before → "
        "after training (best: the selected checkpoint's validation, at its step). grafted: peer groups that replaced this policy's "
        "failed groups. adm.: grafted peer responses admitted by the compatibility gate (weight > 0), pooled over the "
        "run. clip: clipped token fraction of own/peer tokens. s: training seconds."
        + (
            " Per family: held-out pass@1 on that family; all-fail: this policy's own groups with no correct response "
            "(GRPO gets no gradient from them); grafted/adm.: peer groups that replaced them and the admitted share of "
            "their responses."
            if fam_rows
            else ""
        ),
        soft_wrap=False,
        width=min(console.width, 100),
    )
