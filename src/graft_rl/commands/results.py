"""Results files that several commands write into one place, and tables that read several runs
(issue 33): ``eval.json`` is merged per policy and benchmark with what is there, under an OS lock,
so no order or overlap of ``graft eval`` calls loses a result; tables over runs check first that the
runs are comparable."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from graft_rl.locks import flocked

__all__ = ["SETTINGS", "locked", "merge_eval", "read_results", "check_comparable", "differences", "settings_text"]

#: What an evaluation's numbers depend on beside the weights: results under other settings are not merged.
SETTINGS = ("samples", "runs", "temperature", "top_p", "limit", "max_new_tokens")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive OS lock (``flock``) for a read-modify-write of ``path``, on ``.NAME.lock`` beside it;
    released on exit (and by the OS if the process dies)."""
    with flocked(path.parent / f".{path.name}.lock"):
        yield


def read_results(path: Path) -> tuple[dict | None, str | None]:
    """``(results, note)``: the file's results, or None when there is none; an unreadable file is moved
    aside to ``NAME.unreadable`` (never overwritten unseen) and the note says so."""
    if not path.exists():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("policies"), dict):
            raise ValueError("no policies")
        return data, None
    except (OSError, ValueError):
        aside = path.with_name(path.name + ".unreadable")
        os.replace(path, aside)
        return None, f"{path.name} could not be read; moved to {aside.name}"


def settings_text(settings: dict) -> str:
    return ", ".join(f"{k} {settings.get(k)}" for k in SETTINGS)


def _average(entry: dict) -> None:
    """Recompute a policy's average and its std over runs from its benchmarks (same settings)."""
    per = list(entry["benchmarks"].values())
    entry["average"] = statistics.fmean(v["pass@1_mean"] for v in per)
    runs = min(len(v.get("pass@1_runs", [])) for v in per)
    agg = [statistics.fmean(v["pass@1_runs"][r] for v in per) for r in range(runs)]
    entry["average_std"] = statistics.stdev(agg) if runs > 1 else 0.0


def merge_eval(old: dict | None, new: dict, written: Collection[str] = ()) -> tuple[dict, list[str]]:
    """``new`` (this command's results) merged into ``old`` (the file's). Each policy entry carries the
    settings it was evaluated with (:data:`SETTINGS`). A policy evaluated now under the settings of its
    earlier entry keeps the benchmarks not evaluated now; one under other settings replaces its earlier
    entry whole; a policy not evaluated now is kept as it was. Returns ``(merged, what was replaced)``;
    ``written``: the policies this command already wrote there itself (their entries are not "earlier")."""
    mine = {k: new.get(k) for k in SETTINGS}
    merged = {k: v for k, v in new.items() if k != "policies" and not k.startswith("_")}
    merged["policies"] = {}
    notes: list[str] = []
    before = dict(old.get("policies", {})) if old else {}
    old_top = {k: old.get(k) for k in SETTINGS} if old else {}
    for name, entry in before.items():
        entry = dict(entry)
        entry.setdefault("settings", old_top)
        merged["policies"][name] = entry
    for name, entry in new.get("policies", {}).items():
        entry = {**entry, "settings": mine, "benchmarks": dict(entry["benchmarks"])}
        prev = merged["policies"].get(name)
        same_weights = prev is not None and (prev.get("model"), prev.get("step")) == (
            entry.get("model"),
            entry.get("step"),
        )
        own = name in written  # its entry in the file is this command's own, written when it finished
        if prev is not None and prev["settings"] == mine and same_weights:
            again = [b for b in entry["benchmarks"] if b in prev["benchmarks"]]
            if again and not own:
                notes.append(f"replaced {name}'s earlier {', '.join(again)}")
            entry["benchmarks"] = {**prev["benchmarks"], **entry["benchmarks"]}  # earlier ones keep their places
            _average(entry)
        elif prev is not None:
            changed = ", ".join(
                f"{k} {prev['settings'].get(k)} -> {mine[k]}" for k in SETTINGS if prev["settings"].get(k) != mine[k]
            )
            if not same_weights:
                was, now = (f"{e.get('model')} (step {e.get('step')})" for e in (prev, entry))
                changed = ", ".join(x for x in (changed, f"weights {was} -> {now}") if x)
            if not own:
                notes.append(
                    f"replaced {name}'s earlier results "
                    f"(other {'settings' if same_weights else 'weights or settings'}: {changed})"
                )
        merged["policies"][name] = entry
    return merged, notes


@functools.lru_cache(maxsize=64)  # a run is checked in several groups (runs, baseline, both)
def _run_facts(run: Path) -> dict:
    """What a run's numbers depend on besides its seed: method, data, each policy's model."""
    from graft_rl.engine.config import load_config

    cfg_file = run / "config.yaml"
    if not cfg_file.is_file():
        return {}
    cfg = load_config(cfg_file, [f"run_dir={run}"], saved=True)
    facts = {"method": cfg.method.name, "data.train": str(cfg.data.train)}
    facts.update({f"model of {pc.name}": pc.model for pc in cfg.policies})
    return facts


def differences(runs: Sequence[str | Path], ignore: Sequence[str] = ()) -> list[str]:
    """Each fact (:func:`_run_facts`: method, data, models) on which ``runs`` differ, as
    ``"KEY: RUN has 'X', RUN has 'Y'"`` (the first run against the first that differs); a fact some
    runs lack (a policy a baseline does not train) is compared among those that have it."""
    facts = [{k: v for k, v in _run_facts(Path(r).expanduser()).items() if k not in ignore} for r in runs]
    out = []
    for key in dict.fromkeys(k for f in facts for k in f):
        having = [(r, f[key]) for r, f in zip(runs, facts, strict=True) if key in f]  # a run without the policy: n/a
        if len({str(v) for _, v in having}) > 1:
            (first, ref), (other, value) = having[0], next((r, v) for r, v in having if v != having[0][1])
            out.append(f"{key}: {first} has {ref!r}, {other} has {value!r}")
    return out


def check_comparable(
    runs: Sequence[str | Path], what: str, results: Sequence[dict] | None = None, ignore: Sequence[str] = ()
) -> None:
    """One line (ValueError) when ``runs`` cannot sit in one table: a run given twice, runs of different
    methods, data or models, or (with their ``eval.json`` ``results``) policies evaluated under
    different settings. ``what`` names the group in the message (e.g. "the runs", "the baseline runs");
    ``ignore``: facts that may differ (``method`` between runs and their baseline)."""
    paths = [Path(r).expanduser().resolve() for r in runs]
    seen: dict[Path, str] = {}
    for given, p in zip(runs, paths, strict=True):
        if p in seen:
            raise ValueError(f"{what}: {given} is given twice ({seen[p]}); each run counts once")
        seen[p] = str(given)
    diffs = differences(runs, ignore)
    if diffs:
        raise ValueError(f"{what} differ in {diffs[0]}; a table over runs compares seeds of one setup")
    if results is None:
        return
    ref: dict[str, tuple[str, dict]] = {}
    for run, res in zip(runs, results, strict=True):
        top = {k: res.get(k) for k in SETTINGS}
        for name, entry in res["policies"].items():
            s = entry.get("settings", top)
            if name not in ref:
                ref[name] = (str(run), s)
            elif s != ref[name][1]:
                raise ValueError(
                    f"{what}: {run} evaluated {name} with {settings_text(s)}, {ref[name][0]} with "
                    f"{settings_text(ref[name][1])}; evaluate them alike (graft eval with the same flags)"
                )
