"""``graft analyze``: the paper's diagnostics from a run's records and metrics alone (no model loaded).

- complementarity per step: fraction of a model's all-fail prompts on which the peer succeeds
  at least once (Fig. 1 right);
- exchange volume per direction per step, before (candidates) and after balancing;
- compatibility-score distribution and admitted fraction per direction;
- clipped-token fraction for self vs peer tokens, and steps with no clipping on peer tokens (Table 9);
- reward and validation curves (several runs overlaid with ``--compare``);
- case studies (Appendix I): the receiver's failed response beside the grafted successful one;
- compute accounting (Table 5): wall time per phase, to the best checkpoint and to the end.

Writes ``report.md`` and PNG plots to ``RUN_DIR/analysis`` (or ``--out``) and prints a summary.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from graft_rl.report import read_metrics, read_validation
from graft_rl.rundir import best_steps
from graft_rl.store import RecordStore

__all__ = ["AnalysisError", "analyze", "compatibility_stats", "complementarity", "plot_compatibility"]

PHASES = ("time_generate", "time_reward", "time_score", "time_update")


class AnalysisError(ValueError):
    pass


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _moving_mean(ys: list[float], k: int | None = None) -> list[float]:
    """Trailing moving mean over ``k`` points (default: a tenth of the series, at least 3); NaNs skipped."""
    import math

    k = k or max(3, len(ys) // 10)
    out = []
    for i in range(len(ys)):
        window = [y for y in ys[max(0, i - k + 1) : i + 1] if y is not None and not math.isnan(y)]
        out.append(statistics.fmean(window) if window else float("nan"))
    return out


def _raw_and_smooth(ax, xs, ys, color, label, linestyle="-") -> None:
    """A faint raw line under its moving mean, in one colour (spiky per-step series stay readable)."""
    ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8, linestyle=linestyle)
    ax.plot(xs, _moving_mean(ys), color=color, linewidth=1.8, linestyle=linestyle, label=label)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def compatibility_stats(rows: list[dict], delta: float = 0.8) -> dict:
    """How the two compatibility normalisations distribute over one direction's grafted peer responses.

    ``admitted``: the run's own rule (weight > 0); ``pass_token`` / ``pass_char``: the fraction
    each score would admit at ``delta`` (Section 4.2 gate, token-mean vs per-character);
    ``admitted_correct`` / ``admitted_wrong``: admission among rewarded and unrewarded responses.
    """
    rows = [r for r in rows if r["compat_token"] is not None and r["compat_char"] is not None]
    if not rows:
        return {"n": 0}

    def q(xs, f):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))]

    tok, chr_ = [r["compat_token"] for r in rows], [r["compat_char"] for r in rows]
    good, bad = [r for r in rows if r["reward"] > 0], [r for r in rows if r["reward"] <= 0]
    return {
        "n": len(rows),
        "admitted": sum(r["weight"] > 0 for r in rows) / len(rows),
        "pass_token": sum(x > delta for x in tok) / len(rows),
        "pass_char": sum(x > delta for x in chr_) / len(rows),
        "median_token": statistics.median(tok),
        "median_char": statistics.median(chr_),
        "p10_token": q(tok, 0.1), "p90_token": q(tok, 0.9),
        "p10_char": q(chr_, 0.1), "p90_char": q(chr_, 0.9),
        "admitted_correct": sum(r["weight"] > 0 for r in good) / len(good) if good else None,
        "admitted_wrong": sum(r["weight"] > 0 for r in bad) / len(bad) if bad else None,
    }


def plot_compatibility(axes, dirs: dict, delta: float) -> None:
    """Histograms of each direction's compatibility scores, token-mean (``axes[0]``) and per
    character (``axes[1]``), δ marked; ``dirs``: ``{(source, receiver): rows}`` with ``compat_token``
    and ``compat_char`` (exchange records, or ``graft probe``'s scored rows)."""
    every = [x for rows in dirs.values() for r in rows for x in (r["compat_token"], r["compat_char"]) if x is not None]
    cap = min(3.0, max(every + [delta * 1.5]))  # the axis ends at the largest score (values above 3 drawn at 3)
    for (src, recv), rows in dirs.items():
        s_tok = [r["compat_token"] for r in rows if r["compat_token"] is not None]
        s_chr = [r["compat_char"] for r in rows if r["compat_char"] is not None]
        axes[0].hist([min(x, cap) for x in s_tok], bins=40, range=(0, cap), alpha=0.5, label=f"{src}→{recv}")
        axes[1].hist([min(x, cap) for x in s_chr], bins=40, range=(0, cap), alpha=0.5, label=f"{src}→{recv}")
    for a, title in zip(axes, ("token-mean s (paper)", "per-character s"), strict=True):
        a.axvline(delta, color="k", linestyle=":", label=f"δ = {delta}")
        a.set_title(title)
        a.set_xlabel("compatibility score s" + (" (scores above 3 drawn at 3)" if cap == 3.0 else ""))
        a.set_ylabel("peer responses")
        a.set_xlim(0, cap)
        a.legend(fontsize=8)


def complementarity(store: RecordStore) -> dict[str, list[tuple[int, float | None]]]:
    """Per receiver ``R`` (peer = every other recorded policy): per step, fraction of R's all-fail prompts some peer solves."""
    pols = store.policies()
    out: dict[str, list] = {}
    for r in pols:
        series = []
        for step in store.steps(r):
            ks = {p: {g.prompt_id: g.k for g in store.read(p, step)} for p in pols if step in store.steps(p)}
            fails = [q for q, k in ks[r].items() if k == 0]
            peers = [p for p in ks if p != r]
            if not peers:
                continue
            solved = sum(1 for q in fails if any(ks[p].get(q, 0) > 0 for p in peers))
            series.append((step, solved / len(fails) if fails else None))
        out[r] = series
    return out


def _select_initial(run: Path) -> bool:
    """The run's ``validation.select_initial`` (False, the default, when the config does not say)."""
    import yaml

    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    return bool((cfg.get("validation") or {}).get("select_initial", False))


def _run_delta(run: Path) -> float:
    """The run's gate threshold δ from its resolved config (0.8, the paper's, if unreadable)."""
    try:
        import yaml

        return float(((yaml.safe_load((run / "config.yaml").read_text()) or {}).get("method") or {}).get("delta", 0.8))
    except (OSError, ValueError, AttributeError):
        return 0.8


def analyze(run_dir: str | Path, compare: list[str] | None = None, out_dir: str | Path | None = None, cases: int = 3) -> dict:
    run = Path(run_dir)
    if not run.is_dir():
        raise AnalysisError(f"{run}: not a directory")
    store = RecordStore(run)
    if not store.policies():
        raise AnalysisError(f"{run}: no trajectory records (records/<policy>/step_*.parquet); is this a graft run directory?")
    try:
        metrics = read_metrics(run)
    except FileNotFoundError as exc:
        raise AnalysisError(str(exc)) from None
    val = read_validation(run)
    out = Path(out_dir) if out_dir else run / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(m["policy"] for m in metrics))
    by_pol = {p: [m for m in metrics if m["policy"] == p] for p in policies}
    summary: dict = {"run": str(run), "policies": {}}
    report = [f"# GRAFT analysis of `{run}`", ""]

    # 1. complementarity
    comp = complementarity(store)
    fig, ax = plt.subplots(figsize=(7, 4))
    report += ["## Complementarity (Fig. 1)", "", "Fraction of a model's all-fail prompts on which a peer succeeds at least once.", ""]
    for i, (r, series) in enumerate(comp.items()):
        pts = [(s, v) for s, v in series if v is not None]
        if pts:
            _raw_and_smooth(ax, [s for s, _ in pts], [v for _, v in pts], f"C{i}", f"{r}'s all-fail prompts a peer solves")
        mean = _mean(v for _, v in series)
        summary["policies"].setdefault(r, {})["complementarity_mean"] = mean
        report.append(f"- {r}: mean {mean:.3f} over {len(pts)} steps" if mean is not None else f"- {r}: no all-fail prompts")
    ax.set_title("complementarity (faint: per step; bold: moving mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of the receiver's all-fail prompts")
    ax.set_ylim(0, 1.03)  # a line at 1.0 is drawn inside the frame, not on its edge
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # no step had an all-fail prompt with a peer group beside it (e.g. a stored peer's run)
        ax.text(0.5, 0.5, "no all-fail prompt with a live peer", ha="center", va="center", transform=ax.transAxes)
    _save(fig, out / "complementarity.png")

    # 2. exchange volume
    fig, ax = plt.subplots(figsize=(7, 4))
    report += ["", "## Exchange volume per direction", "", "| receiver | candidates (before balancing) | grafted (after) | steps with exchange |",
               "|---|---:|---:|---:|"]
    for i, p in enumerate(policies):
        steps = [m["step"] for m in by_pol[p]]
        cand = [m.get("candidates_in") or 0 for m in by_pol[p]]
        got = [m.get("exchanged_in") or 0 for m in by_pol[p]]
        # one colour per receiver; candidates dashed and drawn on top, so equal counts stay visible
        ax.plot(steps, _moving_mean(got), color=f"C{i}", linewidth=3, alpha=0.6, label=f"into {p}: grafted (after balancing)")
        ax.plot(steps, _moving_mean(cand), color=f"C{i}", linewidth=1.5, linestyle="--", label=f"into {p}: candidates (before)")
        report.append(f"| {p} | {sum(cand):.0f} | {sum(got):.0f} | {sum(1 for g in got if g)} / {len(got)} |")
        summary["policies"].setdefault(p, {}).update(candidates=sum(cand), grafted=sum(got))
    ax.set_title("exchange volume per step (moving mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("peer prompt groups per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "exchange_volume.png")

    # 3. compatibility and admission
    ex = store.read_exchange()
    report += ["", "## Compatibility and admission", ""]
    if not ex:
        report.append("No peer responses were grafted in this run (zero exchanges): nothing to score.")
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        dirs = defaultdict(list)
        for r in ex:
            if not r["auxiliary"]:
                dirs[(r["source"], r["receiver"])].append(r)
        delta = _run_delta(run)
        plot_compatibility(axes, dirs, delta)
        report += [f"| direction | peer responses | admitted (w>0) | mean weight | s (token) median [p10, p90] | "
                   f"s (char) median [p10, p90] | s_token > {delta} | s_char > {delta} | admitted: correct / wrong |",
                   "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for (src, recv), rows in dirs.items():
            st = compatibility_stats(rows, delta)
            adm = sum(1 for r in rows if r["weight"] > 0) / len(rows)
            cells = "- | - | - | - | -" if not st["n"] else (
                f"{st['median_token']:.3f} [{st['p10_token']:.2f}, {st['p90_token']:.2f}] | "
                f"{st['median_char']:.3f} [{st['p10_char']:.2f}, {st['p90_char']:.2f}] | {_pct(st['pass_token'])} | "
                f"{_pct(st['pass_char'])} | {_pct(st['admitted_correct'])} / {_pct(st['admitted_wrong'])}")
            report.append(f"| {src}→{recv} | {len(rows)} | {100 * adm:.1f}% | {_mean(r['weight'] for r in rows):.3f} | {cells} |")
            summary["policies"].setdefault(recv, {})["admitted_frac"] = adm
        _save(fig, out / "compatibility.png")

    # 4. clipping: self vs peer tokens
    fig, ax = plt.subplots(figsize=(7, 4))
    report += ["", "## Clipped-token fraction (Table 9)", "", "| policy | self tokens | peer tokens | steps with peer tokens | of which zero peer clipping |",
               "|---|---:|---:|---:|---:|"]
    for i, p in enumerate(policies):
        steps = [m["step"] for m in by_pol[p]]
        cs = [m.get("clip_frac_self") for m in by_pol[p]]
        cp = [m.get("clip_frac_peer") for m in by_pol[p]]
        _raw_and_smooth(ax, steps, [c or 0 for c in cs], f"C{i}", f"{p}: own tokens")
        _raw_and_smooth(ax, steps, [c if c is not None else float("nan") for c in cp], f"C{i}", f"{p}: peer tokens",
                        linestyle="--")
        with_peer = [c for c in cp if c is not None]
        zero = sum(1 for c in with_peer if c == 0)
        report.append(f"| {p} | {100 * (_mean(cs) or 0):.2f}% | {100 * (_mean(with_peer) or 0):.2f}% | {len(with_peer)} | {zero} |")
        summary["policies"].setdefault(p, {}).update(clip_self=_mean(cs), clip_peer=_mean(with_peer), zero_peer_clip_steps=zero)
    ax.set_title("clipped-token fraction (faint: per step; bold: moving mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of tokens clipped")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "clipping.png")

    # 5. reward and validation curves, with comparisons
    runs = [run] + [Path(c) for c in (compare or [])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for rdir in runs:
        try:
            ms = read_metrics(rdir)
        except FileNotFoundError as exc:
            raise AnalysisError(str(exc)) from None
        vs = read_validation(rdir)
        for p in dict.fromkeys(m["policy"] for m in ms):
            mine = [m for m in ms if m["policy"] == p]
            xs = [m["step"] for m in mine]
            ys = [m["reward_mean"] for m in mine]
            axes[0].plot(xs, _moving_mean(ys), label=f"{rdir.name}:{p}")
            vv = [v for v in vs if v["policy"] == p]
            if vv:
                (line,) = axes[1].plot([v["step"] for v in vv], [v["val/score"] for v in vv], marker="o",
                                       label=f"{rdir.name}:{p}")
                # per prompt family (validation data naming a few, e.g. the transfer testbed): thinner, same colour
                fam_keys = sorted({k for v in vv for k in v if k.startswith("val/") and k.count("/") == 2})
                for k, style in zip(fam_keys, ("--", ":", "-.") * 3):
                    pts = [(v["step"], v[k]) for v in vv if k in v]
                    axes[1].plot([x for x, _ in pts], [y for _, y in pts], linestyle=style, marker=".", linewidth=1,
                                 color=line.get_color(), label=f"{rdir.name}:{p} {k.rsplit('/', 1)[1]}")
    axes[0].set_title("training reward (moving mean)")
    axes[0].set_ylabel("pass rate of the step's rollouts")
    axes[1].set_title("validation score (thin: per prompt family)")
    axes[1].set_ylabel("held-out pass@1")
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    if axes[1].get_legend_handles_labels()[0]:  # outside the axes: the family lines fill the panel
        axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _save(fig, out / "curves.png")

    # 6. case studies (Appendix I)
    report += ["", "## Case studies (Appendix I)", ""]
    shown = 0
    seen_texts: set = set()
    for r in ex:
        if shown >= cases:
            break
        if r["auxiliary"] or r["reward"] <= 0 or r["weight"] <= 0:
            continue
        key = (r["source"], r["receiver"], r["prompt_id"])
        if key in seen_texts:  # one case per prompt and direction (a group often repeats one response)
            continue
        seen_texts.add(key)
        try:
            own = {g.prompt_id: g for g in store.read(r["receiver"], r["step"])}.get(r["prompt_id"])
            peer = {g.prompt_id: g for g in store.read(r["source"], r["step"])}.get(r["prompt_id"])
        except Exception:
            continue
        if own is None or peer is None:
            continue
        report += [
            f"### step {r['step']}, prompt `{r['prompt_id']}`: {r['source']} → {r['receiver']} (weight {r['weight']:.3f}, "
            f"s = {r['compat_token']:.3f})",
            "",
            f"Prompt: {own.prompt}",
            "",
            f"{r['receiver']}'s failed response (reward 0):",
            "```",
            own.texts[0][:1500],
            "```",
            f"{r['source']}'s successful response (advantage {r['advantage']:+.3f}):",
            "```",
            peer.texts[r["group_index"]][:1500],
            "```",
            "",
        ]
        shown += 1
    if not shown:
        report.append("No admitted successful peer response to show.")

    # 7. compute accounting (Table 5); the best step by the trainer's own rule (rundir.best_steps)
    best_by_policy = best_steps(val, _select_initial(run))
    report += ["", "## Compute (Table 5)", "", "| policy | generate s | reward s | score s | update s | total s | best step | s to best |",
               "|---|---:|---:|---:|---:|---:|---:|---:|"]
    joint_total = 0.0
    step_time = defaultdict(float)
    for m in metrics:
        step_time[m["step"]] += sum(m.get(k) or 0 for k in PHASES)
    for p in policies:
        sums = {k: sum(m.get(k) or 0 for m in by_pol[p]) for k in PHASES}
        total = sum(sums.values())
        joint_total += total
        best = best_by_policy.get(p, {}).get("step")
        to_best = sum(sum(m.get(k) or 0 for k in PHASES) for m in by_pol[p] if best is not None and m["step"] <= best)
        report.append(
            f"| {p} | {sums['time_generate']:.1f} | {sums['time_reward']:.1f} | {sums['time_score']:.1f} | "
            f"{sums['time_update']:.1f} | {total:.1f} | {best if best is not None else '-'} | "
            f"{to_best:.1f} |"
        )
        summary["policies"].setdefault(p, {}).update(seconds=total, best_step=best)
    bests = [summary["policies"][p].get("best_step") for p in policies if summary["policies"][p].get("best_step") is not None]
    joint_best = sum(t for s, t in step_time.items() if bests and s <= max(bests))
    report.append("")
    report.append(f"Joint: {joint_total:.1f} s for the whole run; {joint_best:.1f} s to the later of the best checkpoints "
                  "(the joint run must reach both).")
    summary["joint_seconds"] = joint_total
    (out / "report.md").write_text("\n".join(report) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    summary["out"] = str(out)
    return summary


def print_summary(summary: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # fits an 80-column terminal (SIMPLE_HEAD, one space between columns); report.md has the full tables
    t = Table(title=f"graft analyze {summary['run']}", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
              title_justify="left")
    for c in ("policy", "compl.", "candidates", "grafted", "admitted", "clip own", "clip peer", "best@", "s"):
        t.add_column(c, justify="left" if c == "policy" else "right", no_wrap=True)

    def f(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else (f"{v:.0f}" if isinstance(v, float) else str(v))

    for p, s in summary["policies"].items():
        t.add_row(p, f(s.get("complementarity_mean"), True), f(s.get("candidates")), f(s.get("grafted")),
                  f(s.get("admitted_frac"), True), f(s.get("clip_self"), True), f(s.get("clip_peer"), True),
                  f(s.get("best_step")), f(s.get("seconds")))
    console = Console()
    console.print(t)
    console.print("compl.: fraction of the policy's all-fail prompts a peer solves; candidates / grafted: peer groups before / "
          "after balancing; admitted: grafted peer responses with weight > 0 (pooled); clip: clipped token fractions; "
          "best@: best validation step; s: training seconds.")
    console.print(f"report and plots: {summary['out']}", soft_wrap=True)
