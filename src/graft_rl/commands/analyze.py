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
from dataclasses import dataclass, field
from pathlib import Path

from graft_rl.commands.report import read_metrics, read_validation
from graft_rl.engine.provenance import CHANGES
from graft_rl.engine.rundir import best_steps, read_log
from graft_rl.engine.store import RecordStore

__all__ = [
    "Analysis",
    "AnalysisError",
    "analyze",
    "compatibility_stats",
    "complementarity",
    "compute",
    "plot",
    "plot_compatibility",
    "report",
]

PHASES = ("time_generate", "time_reward", "time_logprobs", "time_update")


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
        "p10_token": q(tok, 0.1),
        "p90_token": q(tok, 0.9),
        "p10_char": q(chr_, 0.1),
        "p90_char": q(chr_, 0.9),
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


@dataclass
class Analysis:
    """What ``graft analyze`` computed from a run's records and logs (no plotting, no formatting)."""

    run: Path
    policies: list[str]  # in the metrics' order
    by_pol: dict[str, list[dict]]  # each policy's metric lines
    comp: dict[str, list[tuple[int, float | None]]]  # complementarity per receiver per step (Fig. 1)
    exchange: list[dict]  # every exchange record
    dirs: dict[tuple[str, str], list[dict]]  # non-auxiliary exchange records per (source, receiver)
    delta: float  # the run's gate threshold
    curves: list[tuple[Path, list[dict], list[dict]]]  # (run, metrics, validation) of the run and --compare runs
    cases: list[dict]  # case studies: exchange record, prompt, the receiver's failed and the source's good text
    best: dict[str, int | None]  # best validation step per policy
    summary: dict = field(default_factory=dict)


def analyze(
    run_dir: str | Path, compare: list[str] | None = None, out_dir: str | Path | None = None, cases: int = 3
) -> dict:
    """Compute the diagnostics of a run (:func:`compute`), draw them (:func:`plot`) and write
    ``report.md`` (:func:`report`) and ``summary.json`` to ``out_dir`` (default ``RUN_DIR/analysis``)."""
    from graft_rl.commands.results import differences

    a = compute(run_dir, compare, cases)
    # overlaid curves of runs on other data or models are marked (a method differs by design)
    notes = differences([a.run, *compare], ignore=("method",)) if compare else []
    for note in notes:
        print(f"graft analyze: the compared runs differ in {note}; their curves are overlaid as asked")
    a.summary["compare_differences"] = notes
    out = Path(out_dir) if out_dir else a.run / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    plot(a, out)
    marked = "".join(f"\n> The compared runs differ in {n}.\n" for n in notes)
    (out / "report.md").write_text(report(a) + marked)
    (out / "summary.json").write_text(json.dumps(a.summary, indent=1, default=str))
    return {**a.summary, "out": str(out)}


def compute(run_dir: str | Path, compare: list[str] | None = None, cases: int = 3) -> Analysis:
    """Read a run (and ``compare`` runs' curves) and compute every diagnostic and the summary."""
    run = Path(run_dir)
    if not run.is_dir():
        raise AnalysisError(f"{run}: not a directory")
    store = RecordStore(run)
    if not store.policies():
        raise AnalysisError(
            f"{run}: no trajectory records (records/<policy>/step_*.parquet); is this a graft run directory?"
        )
    curves = []
    for rdir in [run] + [Path(c) for c in (compare or [])]:
        try:
            curves.append((rdir, read_metrics(rdir), read_validation(rdir)))
        except FileNotFoundError as exc:
            raise AnalysisError(str(exc)) from None
    metrics, val = curves[0][1], curves[0][2]
    policies = list(dict.fromkeys(m["policy"] for m in metrics))
    # peer responses (a reward that only shaped a baseline, XGRPO's, is not one)
    ex = [r for r in store.read_exchange() if r.get("moved") in (None, "response")]
    dirs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in ex:
        if not r["auxiliary"]:
            dirs[(r["source"], r["receiver"])].append(r)
    best = {p: b.get("step") for p, b in best_steps(val, _select_initial(run)).items()}
    a = Analysis(
        run,
        policies,
        {p: [m for m in metrics if m["policy"] == p] for p in policies},
        complementarity(store),
        ex,
        dict(dirs),
        _run_delta(run),
        curves,
        _cases(store, ex, cases),
        best,
    )
    a.summary = _summary(a, metrics)
    a.summary["changes"] = read_log(run / CHANGES)[0]  # what a resume went on with (--allow-changed)
    return a


def _cases(store: RecordStore, ex: list[dict], limit: int) -> list[dict]:
    """Up to ``limit`` admitted successful peer responses, one per prompt and direction, with the
    receiver's failed response beside them (Appendix I)."""
    out: list[dict] = []
    seen: set = set()
    for r in ex:
        if len(out) >= limit:
            break
        if r["auxiliary"] or r["reward"] <= 0 or r["weight"] <= 0:
            continue
        key = (r["source"], r["receiver"], r["prompt_id"])
        if key in seen:  # one case per prompt and direction (a group often repeats one response)
            continue
        seen.add(key)
        try:
            own = {g.prompt_id: g for g in store.read(r["receiver"], r["step"])}.get(r["prompt_id"])
            peer = {g.prompt_id: g for g in store.read(r["source"], r["step"])}.get(r["prompt_id"])
        except Exception:
            continue
        if own is None or peer is None:
            continue
        out.append({**r, "prompt": own.prompt, "own_text": own.texts[0], "peer_text": peer.texts[r["group_index"]]})
    return out


def _summary(a: Analysis, metrics: list[dict]) -> dict:
    """Per policy: complementarity, exchange volume, admission, clipping, seconds and best step; joint seconds."""
    pols: dict[str, dict] = {}
    for r, series in a.comp.items():
        pols.setdefault(r, {})["complementarity_mean"] = _mean(v for _, v in series)
    for p in a.policies:
        mine = a.by_pol[p]
        pols.setdefault(p, {}).update(
            candidates=sum(m.get("candidates_in") or 0 for m in mine),
            grafted=sum(m.get("exchanged_in") or 0 for m in mine),
        )
    for (_, recv), rows in a.dirs.items():
        pols.setdefault(recv, {})["admitted_frac"] = sum(1 for r in rows if r["weight"] > 0) / len(rows)
    for p in a.policies:
        cs = [m.get("clip_frac_self") for m in a.by_pol[p]]
        with_peer = [c for c in (m.get("clip_frac_peer") for m in a.by_pol[p]) if c is not None]
        pols.setdefault(p, {}).update(
            clip_self=_mean(cs), clip_peer=_mean(with_peer), zero_peer_clip_steps=sum(1 for c in with_peer if c == 0)
        )
    for p in a.policies:
        gaps = [m["mismatch_kl"] for m in a.by_pol[p] if m.get("mismatch_kl") is not None]
        pols.setdefault(p, {}).update(
            mismatch_kl=_mean(gaps),
            mismatch_max=max(
                (m["mismatch_max"] for m in a.by_pol[p] if m.get("mismatch_max") is not None), default=None
            ),
            mismatch_out=_mean(m.get("mismatch_out") for m in a.by_pol[p] if m.get("mismatch_out") is not None),
            correction_masked=_mean(
                m.get("correction_masked") for m in a.by_pol[p] if m.get("correction_masked") is not None
            ),
        )
    for p in a.policies:
        total = sum(sum(m.get(k) or 0 for m in a.by_pol[p]) for k in PHASES)
        pols.setdefault(p, {}).update(seconds=total, best_step=a.best.get(p))
    return {"run": str(a.run), "policies": pols, "joint_seconds": sum(pols[p]["seconds"] for p in a.policies)}


# ---------------------------------------------------------------------------------------- plots
def plot(a: Analysis, out: Path) -> None:
    """``complementarity.png``, ``exchange_volume.png``, ``compatibility.png`` (when anything was
    grafted), ``clipping.png`` and ``curves.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (r, series) in enumerate(a.comp.items()):
        pts = [(s, v) for s, v in series if v is not None]
        if pts:
            _raw_and_smooth(
                ax, [s for s, _ in pts], [v for _, v in pts], f"C{i}", f"{r}'s all-fail prompts a peer solves"
            )
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

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(a.policies):
        steps = [m["step"] for m in a.by_pol[p]]
        # one colour per receiver; candidates dashed and drawn on top, so equal counts stay visible
        ax.plot(
            steps,
            _moving_mean([m.get("exchanged_in") or 0 for m in a.by_pol[p]]),
            color=f"C{i}",
            linewidth=3,
            alpha=0.6,
            label=f"into {p}: grafted (after balancing)",
        )
        ax.plot(
            steps,
            _moving_mean([m.get("candidates_in") or 0 for m in a.by_pol[p]]),
            color=f"C{i}",
            linewidth=1.5,
            linestyle="--",
            label=f"into {p}: candidates (before)",
        )
    ax.set_title("exchange volume per step (moving mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("peer prompt groups per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "exchange_volume.png")

    if a.exchange:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        plot_compatibility(axes, a.dirs, a.delta)
        _save(fig, out / "compatibility.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(a.policies):
        steps = [m["step"] for m in a.by_pol[p]]
        cp = [m.get("clip_frac_peer") for m in a.by_pol[p]]
        _raw_and_smooth(ax, steps, [m.get("clip_frac_self") or 0 for m in a.by_pol[p]], f"C{i}", f"{p}: own tokens")
        _raw_and_smooth(
            ax, steps, [c if c is not None else float("nan") for c in cp], f"C{i}", f"{p}: peer tokens", linestyle="--"
        )
    ax.set_title("clipped-token fraction (faint: per step; bold: moving mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of tokens clipped")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "clipping.png")
    _plot_mismatch(a, out / "mismatch.png")
    _plot_curves(a.curves, out / "curves.png", a.summary.get("changes", []))


def _plot_mismatch(a: Analysis, path: Path) -> None:
    """``mismatch.png`` (runs that measured the engine-trainer gap): ``mismatch_kl`` per step (log
    scale), and the share of own tokens outside the correction's bounds / masked by it."""
    import matplotlib.pyplot as plt

    from graft_rl.methods.corrections import LARGE_GAP_KL

    measured = [p for p in a.policies if any(m.get("mismatch_kl") is not None for m in a.by_pol[p])]
    if not measured:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for i, p in enumerate(a.policies):
        if p not in measured:
            continue
        pts = [(m["step"], m["mismatch_kl"]) for m in a.by_pol[p] if m.get("mismatch_kl") is not None]
        # k3 of identical log-probs is exactly 0: drawn at the axis floor
        axes[0].plot([s for s, _ in pts], [max(v, 1e-16) for _, v in pts], marker=".", color=f"C{i}", label=p)
        out = [(m["step"], m["mismatch_out"]) for m in a.by_pol[p] if m.get("mismatch_out") is not None]
        axes[1].plot([s for s, _ in out], [v for _, v in out], color=f"C{i}", label=f"{p}: outside the bounds")
        masked = [(m["step"], m["correction_masked"]) for m in a.by_pol[p] if m.get("correction_masked") is not None]
        if masked:
            axes[1].plot(
                [s for s, _ in masked], [v for _, v in masked], color=f"C{i}", linestyle="--", label=f"{p}: masked"
            )
    axes[0].axhline(LARGE_GAP_KL, color="crimson", linestyle=":", linewidth=1, label=f"large ({LARGE_GAP_KL:.0e})")
    axes[0].set_yscale("log")
    axes[0].set_title("engine-trainer gap of own tokens: KL(mu || pi_old) per token (k3)")
    axes[0].set_ylabel("mismatch_kl")
    axes[1].set_title("own tokens outside the correction's bounds / masked by it")
    axes[1].set_ylabel("fraction of own tokens")
    axes[1].set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def _plot_curves(curves: list[tuple[Path, list[dict], list[dict]]], path: Path, changes: list[dict] = ()) -> None:
    """Training reward and validation score of every run (per prompt family too), overlaid; a dotted
    vertical line where a resume went on with a changed reward or data file (``changes``)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for step in sorted({c["step"] for c in changes}):
        kinds = " + ".join(sorted({c["kind"] for c in changes if c["step"] == step}))
        for ax in axes:
            ax.axvline(
                step - 0.5, color="crimson", linestyle=":", linewidth=1.5, label=f"{kinds} changed (step {step})"
            )
    for rdir, ms, vs in curves:
        for p in dict.fromkeys(m["policy"] for m in ms):
            mine = [m for m in ms if m["policy"] == p]
            axes[0].plot(
                [m["step"] for m in mine], _moving_mean([m["reward_mean"] for m in mine]), label=f"{rdir.name}:{p}"
            )
            vv = [v for v in vs if v["policy"] == p]
            if vv:
                (line,) = axes[1].plot(
                    [v["step"] for v in vv], [v["val/score"] for v in vv], marker="o", label=f"{rdir.name}:{p}"
                )
                # per prompt family (validation data naming a few, e.g. the transfer testbed): thinner, same colour
                fam_keys = sorted({k for v in vv for k in v if k.startswith("val/") and k.count("/") == 2})
                for k, style in zip(fam_keys, ("--", ":", "-.") * 3, strict=False):
                    pts = [(v["step"], v[k]) for v in vv if k in v]
                    axes[1].plot(
                        [x for x, _ in pts],
                        [y for _, y in pts],
                        linestyle=style,
                        marker=".",
                        linewidth=1,
                        color=line.get_color(),
                        label=f"{rdir.name}:{p} {k.rsplit('/', 1)[1]}",
                    )
    axes[0].set_title("training reward (moving mean)")
    axes[0].set_ylabel("pass rate of the step's rollouts")
    axes[1].set_title("validation score (thin: per prompt family)")
    axes[1].set_ylabel("held-out pass@1")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    if axes[1].get_legend_handles_labels()[0]:  # outside the axes: the family lines fill the panel
        axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _save(fig, path)


# ---------------------------------------------------------------------------------------- report
def report(a: Analysis) -> str:
    """The Markdown report: one section per diagnostic, in the paper's terms."""
    lines = [f"# GRAFT analysis of `{a.run}`", ""]
    lines += [
        "## Complementarity (Fig. 1)",
        "",
        "Fraction of a model's all-fail prompts on which a peer succeeds at least once.",
        "",
    ]
    for r, series in a.comp.items():
        mean = a.summary["policies"][r]["complementarity_mean"]
        n = sum(1 for _, v in series if v is not None)
        lines.append(f"- {r}: mean {mean:.3f} over {n} steps" if mean is not None else f"- {r}: no all-fail prompts")
    lines += [
        "",
        "## Exchange volume per direction",
        "",
        "| receiver | candidates (before balancing) | grafted (after) | steps with exchange |",
        "|---|---:|---:|---:|",
    ]
    for p in a.policies:
        got = [m.get("exchanged_in") or 0 for m in a.by_pol[p]]
        s = a.summary["policies"][p]
        lines.append(f"| {p} | {s['candidates']:.0f} | {s['grafted']:.0f} | {sum(1 for g in got if g)} / {len(got)} |")
    lines += ["", "## Compatibility and admission", ""] + _report_compatibility(a)
    lines += [
        "",
        "## Clipped-token fraction (Table 9)",
        "",
        "| policy | self tokens | peer tokens | steps with peer tokens | of which zero peer clipping |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in a.policies:
        s = a.summary["policies"][p]
        n_peer = sum(1 for m in a.by_pol[p] if m.get("clip_frac_peer") is not None)
        lines.append(
            f"| {p} | {100 * (s['clip_self'] or 0):.2f}% | {100 * (s['clip_peer'] or 0):.2f}% | {n_peer} | "
            f"{s['zero_peer_clip_steps']} |"
        )
    lines += ["", "## Engine and trainer", ""] + _report_mismatch(a)
    lines += ["", "## Case studies (Appendix I)", ""] + _report_cases(a.cases)
    if a.summary.get("changes"):
        lines += ["", "## Changed during the run (resumed with --allow-changed)", ""]
        lines += [f"- from step {c['step']}: {c['change']}" for c in a.summary["changes"]]
    return "\n".join(lines + ["", "## Compute (Table 5)", ""] + _report_compute(a)) + "\n"


def _report_mismatch(a: Analysis) -> list[str]:
    """The engine-trainer gap of each policy's own tokens over the run (``mismatch_*``), and a line
    for a policy whose gap is large."""
    from graft_rl.commands.report import large_gap_line

    pols = a.summary["policies"]
    measured = [p for p in a.policies if pols[p].get("mismatch_kl") is not None]
    if not measured:
        return [
            "Not measured: no own token had an engine log-prob comparable with pi_old (top-p / top-k sampling, "
            "or a run recorded before 0.3.0)."
        ]
    lines = [
        "The k3 estimate of KL(mu || pi_old) per own token (mu: the rollout engine's log-prob of the token it "
        "sampled; pi_old: the trainer's), its largest |log mu - log pi_old|, and the share of own tokens "
        "outside the correction's bounds (and masked by it). `mismatch.png` has the curves.",
        "",
        "| policy | mismatch_kl (mean) | largest gap (nats) | outside bounds | masked |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in measured:
        s = pols[p]
        masked = f"{100 * s['correction_masked']:.2f}%" if s.get("correction_masked") is not None else "-"
        lines.append(
            f"| {p} | {s['mismatch_kl']:.2e} | {s['mismatch_max']:.3g} | {100 * (s['mismatch_out'] or 0):.2f}% | {masked} |"
        )
    big = large_gap_line([{"policy": p, **pols[p]} for p in measured])
    return lines + ([] if big is None else ["", big])


def _report_compatibility(a: Analysis) -> list[str]:
    if not a.exchange:
        return ["No peer responses were grafted in this run (zero exchanges): nothing to score."]
    d = a.delta
    lines = [
        f"| direction | peer responses | admitted (w>0) | mean weight | s (token) median [p10, p90] | "
        f"s (char) median [p10, p90] | s_token > {d} | s_char > {d} | admitted: correct / wrong |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (src, recv), rows in a.dirs.items():
        st = compatibility_stats(rows, d)
        adm = sum(1 for r in rows if r["weight"] > 0) / len(rows)
        cells = (
            "- | - | - | - | -"
            if not st["n"]
            else (
                f"{st['median_token']:.3f} [{st['p10_token']:.2f}, {st['p90_token']:.2f}] | "
                f"{st['median_char']:.3f} [{st['p10_char']:.2f}, {st['p90_char']:.2f}] | {_pct(st['pass_token'])} | "
                f"{_pct(st['pass_char'])} | {_pct(st['admitted_correct'])} / {_pct(st['admitted_wrong'])}"
            )
        )
        lines.append(
            f"| {src}→{recv} | {len(rows)} | {100 * adm:.1f}% | {_mean(r['weight'] for r in rows):.3f} | {cells} |"
        )
    return lines


def _report_cases(cases: list[dict]) -> list[str]:
    if not cases:
        return ["No admitted successful peer response to show."]
    lines: list[str] = []
    for r in cases:
        lines += [
            f"### step {r['step']}, prompt `{r['prompt_id']}`: {r['source']} → {r['receiver']} (weight {r['weight']:.3f}, "
            f"s = {r['compat_token']:.3f})",
            "",
            f"Prompt: {r['prompt']}",
            "",
            f"{r['receiver']}'s failed response (reward 0):",
            "```",
            r["own_text"][:1500],
            "```",
            f"{r['source']}'s successful response (advantage {r['advantage']:+.3f}):",
            "```",
            r["peer_text"][:1500],
            "```",
            "",
        ]
    return lines


def _report_compute(a: Analysis) -> list[str]:
    """Compute accounting (Table 5); the best step by the trainer's own rule (rundir.best_steps)."""
    lines = [
        "| policy | generate s | reward s | log-probs s | update s | total s | best step | s to best |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    step_time: dict[int, float] = defaultdict(float)
    for p in a.policies:
        for m in a.by_pol[p]:
            step_time[m["step"]] += sum(m.get(k) or 0 for k in PHASES)
    for p in a.policies:
        sums = {k: sum(m.get(k) or 0 for m in a.by_pol[p]) for k in PHASES}
        best = a.best.get(p)
        to_best = sum(sum(m.get(k) or 0 for k in PHASES) for m in a.by_pol[p] if best is not None and m["step"] <= best)
        lines.append(
            f"| {p} | {sums['time_generate']:.1f} | {sums['time_reward']:.1f} | {sums['time_logprobs']:.1f} | "
            f"{sums['time_update']:.1f} | {sum(sums.values()):.1f} | {best if best is not None else '-'} | "
            f"{to_best:.1f} |"
        )
    bests = [b for p in a.policies if (b := a.best.get(p)) is not None]
    joint_best = sum(t for s, t in step_time.items() if bests and s <= max(bests))
    return lines + [
        "",
        f"Joint: {a.summary['joint_seconds']:.1f} s for the whole run; {joint_best:.1f} s to the later "
        "of the best checkpoints (the joint run must reach both).",
    ]


def print_summary(summary: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # fits an 80-column terminal (SIMPLE_HEAD, one space between columns); report.md has the full tables
    t = Table(
        title=f"graft analyze {summary['run']}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        title_justify="left",
    )
    for c in ("policy", "compl.", "candidates", "grafted", "admitted", "clip own", "clip peer", "best@", "s"):
        t.add_column(c, justify="left" if c == "policy" else "right", no_wrap=True)

    def f(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else (f"{v:.0f}" if isinstance(v, float) else str(v))

    for p, s in summary["policies"].items():
        t.add_row(
            p,
            f(s.get("complementarity_mean"), True),
            f(s.get("candidates")),
            f(s.get("grafted")),
            f(s.get("admitted_frac"), True),
            f(s.get("clip_self"), True),
            f(s.get("clip_peer"), True),
            f(s.get("best_step")),
            f(s.get("seconds")),
        )
    console = Console()
    console.print(t)
    console.print(
        "compl.: fraction of the policy's all-fail prompts a peer solves; candidates / grafted: peer groups before / "
        "after balancing; admitted: grafted peer responses with weight > 0 (pooled); clip: clipped token fractions; "
        "best@: best validation step; s: training seconds."
    )
    for c in summary.get("changes", []):
        console.print(
            f"[bold]changed from step {c['step']}[/bold]: {c['change']} (resumed with --allow-changed)", soft_wrap=True
        )
    console.print(f"report and plots: {summary['out']}", soft_wrap=True)
