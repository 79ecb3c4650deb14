"""``graft probe``: will GRAFT help this pair on this data? Measured before any training.

GRAFT acts only where a receiver's whole group fails and its peer's group is mixed (Section 4.1),
and learns only from what its gate admits (Section 4.2). Both are properties of the pair and the
data at the start of training, so they can be measured in minutes: each policy samples the config's
``n`` responses for ``--limit`` training prompts, the rewards are verified, and the trainer's own
step phases run up to (not including) the update:

- :meth:`Rollouts.generate`, :meth:`Rollouts.verify` (generation, verification) and :meth:`Trainer.exchange`
  (selection, balanced exchange, source advantages) — the same calls a training step makes, with the
  same seeds, so the probe's first batch *is* training step 1's when ``--limit`` equals
  ``prompt_batch``;
- :meth:`PolicyWorker.weigh_peers` — the receiver's compatibility scores and gate weights from the
  code :meth:`PolicyWorker.train` uses, on the grafted groups (what a step would train on) and, to
  measure more responses, on every complementary candidate (the same build with balancing off);
- :func:`graft_rl.commands.analyze.complementarity` and :func:`~graft_rl.commands.analyze.compatibility_stats` — the
  diagnostics ``graft analyze`` computes from a run's records.

Nothing is trained and nothing is written but the report (``probe.json``, ``probe.png``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import tempfile
import textwrap
from collections import defaultdict
from pathlib import Path

import torch

from graft_rl import algo
from graft_rl.commands.analyze import compatibility_stats, complementarity, plot_compatibility
from graft_rl.engine.config import TrainConfig
from graft_rl.engine.rundir import write_text_atomic
from graft_rl.methods import MethodConfig, build_exchange, build_method
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["probe", "format_probe", "plot_probe", "ProbeError"]


class ProbeError(ValueError):
    """A config the probe cannot measure (one line)."""


def _complementary(receiver_groups: list, source_by_prompt: dict) -> list:
    """The receiver's groups that are complementary candidates from the source (Section 4.1,
    :func:`graft_rl.algo.complementary_mask`: the receiver's group all fails, the source's is mixed)."""
    paired = [(g, source_by_prompt[g.prompt_id]) for g in receiver_groups if g.prompt_id in source_by_prompt]
    if not paired:
        return []
    k_src = torch.tensor([s.k for _, s in paired])
    k_recv = torch.tensor([g.k for g, _ in paired])
    mask = algo.complementary_mask(k_src, k_recv, paired[0][1].n).tolist()
    return [g for (g, _), m in zip(paired, mask, strict=True) if m]


def _probe_config(cfg: TrainConfig, limit: int) -> tuple[TrainConfig, MethodConfig]:
    """The config the probe's trainer runs: the config's own data, models, sampling and seeds, with
    ``prompt_batch`` at most ``limit``, no validation, no KL reference (it does not change a score),
    and GRAFT's exchange (the config's own method settings when it is GRAFT)."""
    if len(cfg.policies) < 2 and not cfg.peers:
        raise ProbeError("the config has one policy and no stored peer: there is no exchange to probe")
    method = cfg.method if cfg.method.name == "graft" else MethodConfig(name="graft", delta=cfg.method.delta)
    method = dataclasses.replace(method, kl_coef=0.0)
    method.validate(unused_keys=False)
    pb = min(cfg.prompt_batch, limit)
    steps = math.ceil(limit / pb)
    val = dataclasses.replace(cfg.validation, data=[])
    pcfg = dataclasses.replace(
        cfg,
        prompt_batch=pb,
        minibatch=min(cfg.minibatch, pb),
        steps=steps,
        validation=val,
        method=method,
        tensorboard=False,
        # GRAFT's exchange pairs groups by prompt: every policy answers the same ones (a swarm method's
        # own streams would draw others; what it moves is counted on these groups)
        rollout=dataclasses.replace(cfg.rollout, prompts="shared"),
    )
    pcfg.validate(saved=True)
    return pcfg, method


def probe(
    cfg: TrainConfig, limit: int | None = None, out_dir: str | Path | None = None, show: bool = True, reward=None
) -> dict:
    """Sample, verify, select and score ``limit`` prompts (default: one ``prompt_batch``) as a
    training step would; return the per-direction diagnostics and write ``probe.json``/``probe.png``.
    ``reward``: the run's reward in place of ``data.reward`` (a name, ``module:function`` or a Python function)."""
    from tqdm.auto import tqdm

    from graft_rl.engine.trainer import Trainer

    limit = cfg.prompt_batch if limit is None else limit
    if limit < 1:
        raise ProbeError(f"--limit must be >= 1, got {limit}")
    out = Path(out_dir) if out_dir else Path("probe") / Path(cfg.run_dir).name
    out.mkdir(parents=True, exist_ok=True)  # before any sampling: the results are never computed only to be lost
    pcfg, method = _probe_config(cfg, limit)
    unbalanced = build_exchange(dataclasses.replace(method, balance=False))  # every candidate, to score more responses
    tmp = Path(tempfile.mkdtemp(prefix="graft_probe_"))
    try:
        quiet = dataclasses.replace(pcfg, run_dir=str(tmp / "run"), report_to=[], tensorboard=False)  # no tracker runs
        tr = Trainer(quiet, show_progress=False, reward=reward)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    names = list(tr.policies)
    own = build_method(dataclasses.replace(cfg.method, kl_coef=0.0))  # the config's method: what it would move
    moves: dict[str, list[dict]] = defaultdict(list)  # receiver -> per step: groups, responses, tokens, rewards
    scored: dict[tuple[str, str], list[dict]] = defaultdict(list)  # grafted peer rows, per (source, receiver)
    cand_rows: dict[tuple[str, str], list[dict]] = defaultdict(list)  # every candidate's peer rows
    per_step: list[dict] = []
    groups_all: dict[str, list] = defaultdict(list)
    family: dict[str, str] = {}  # prompt id -> family, kept as drawn (the trainer keeps only recent steps' rows)
    try:
        bar = tqdm(range(1, pcfg.steps + 1), desc="graft probe", unit="batch", disable=not show)
        for step in bar:
            groups, lines = tr.rollouts.verify(step, tr.rollouts.generate(step, tr.policies))
            if tr.family:
                family.update({g.prompt_id: tr.family[g.prompt_id] for gs in groups.values() for g in gs})
            for name in tr.policies:
                tr.store.write(step, groups[name])
            for name, gs in groups.items():
                groups_all[name] += gs
            batches = tr.exchange(step, groups, lines)
            _method_moves(own, step, groups, tr, moves)
            pending, pending_c = {}, {}
            for recv in names:
                seed = derive_seed(
                    pcfg.seed, Purpose.UPDATE, step, tr.names.index(recv)
                )  # the seed training step `step` uses
                budget = tr.samplings[recv].max_new_tokens
                pending[recv] = tr.workers[recv].weigh_peers(batches[recv], seed, pcfg.temperature, budget)
                gen = torch.Generator().manual_seed(
                    derive_seed(pcfg.seed, Purpose.EXCHANGE, step, tr.names.index(recv))
                )
                cb = unbalanced.build(recv, groups, tr.live, pcfg.n, gen)
                pending_c[recv] = tr.workers[recv].weigh_peers(cb, seed, pcfg.temperature, budget)
            for recv in names:
                for r in pending[recv].get():
                    scored[(r["source"], recv)].append(r)
                for r in pending_c[recv].get():
                    cand_rows[(r["source"], recv)].append(r)
                st = batches[recv].stats
                per_step.append(
                    {
                        "step": step,
                        "receiver": recv,
                        "prompts": len(groups[recv]),
                        "candidates": st.get("candidates_in", 0.0),
                        "grafted": st.get("exchanged_in", 0.0),
                        **{k: v for k, v in st.items() if k.startswith("exchanged_from/")},
                    }
                )
        comp = complementarity(tr.store)
    finally:
        tr.close()
        shutil.rmtree(tmp, ignore_errors=True)
    res = _summarise(cfg, pcfg, method, limit, names, groups_all, scored, cand_rows, per_step, comp, family)
    res["moves"] = _per_step(moves, cfg.prompt_batch / pcfg.prompt_batch) if own.uses_peers else {}
    res["reward"], res["success_threshold"] = tr.reward.name, cfg.data.success_threshold
    write_text_atomic(out / "probe.json", json.dumps(res, indent=1))
    plot_probe(res, scored, cand_rows, out / "probe.png")
    res["written"] = [str(out / "probe.json"), str(out / "probe.png")]
    return res


def _method_moves(method, step: int, groups: dict, tr, moves: dict) -> None:
    """What the config's own method would move into each receiver at this probed step (its exchange on
    the probed groups, with the draws training step ``step`` makes): appended to ``moves[receiver]``."""
    method.observe(groups)
    for recv in tr.policies:
        i = tr.names.index(recv)
        gen, swarm = (
            torch.Generator().manual_seed(derive_seed(tr.cfg.seed, p, step, i))
            for p in (Purpose.EXCHANGE, Purpose.SWARM)
        )
        moves[recv].append(moved(method.build(recv, groups, tr.live, tr.cfg.n, gen, swarm)))


def _per_step(moves: dict, scale: float) -> dict:
    """Each receiver's mean of what its method moves per probed batch, scaled to the config's batch."""
    return {
        recv: {k: statistics.fmean(m[k] for m in per) * scale for k in per[0]} for recv, per in moves.items() if per
    }


def moved(batch) -> dict:
    """What a receiver's batch takes from its peers: ``groups`` (peer groups, by source and prompt),
    ``responses`` (peer responses, an auxiliary target included), ``tokens`` (their sampled tokens) and
    ``rewards`` (peer rewards that only shaped a baseline, XGRPO's)."""
    peer = [r for r in batch.rows if r.is_peer]
    return {
        "groups": float(len({(r.source, r.prompt_id) for r in peer})),
        "responses": float(len(peer)),
        "tokens": float(sum(len(r.token_ids or ()) for r in peer)),
        "rewards": float(len(batch.moved)),
    }


def _group_stats(gs) -> dict:
    n = len(gs)
    return {
        "prompts": n,
        "reward_mean": statistics.fmean(r for g in gs for r in g.rewards) if gs else None,
        "all_fail": sum(1 for g in gs if g.k == 0) / n if n else None,
        "mixed": sum(1 for g in gs if 0 < g.k < g.n) / n if n else None,
        "all_pass": sum(1 for g in gs if g.k == g.n) / n if n else None,
    }


def _summarise(cfg, pcfg, method, limit, names, groups_all, scored, cand_rows, per_step, comp, family) -> dict:
    delta = method.delta
    scale = cfg.prompt_batch / pcfg.prompt_batch  # per config-sized step
    policies = {name: _group_stats(gs) for name, gs in groups_all.items()}
    directions = {}
    for recv in names:
        steps = [s for s in per_step if s["receiver"] == recv]
        for src in groups_all:
            if src == recv:
                continue
            k_src = {g.prompt_id: g for g in groups_all[src]}
            fails = [g for g in groups_all[recv] if g.k == 0]
            cands = _complementary(groups_all[recv], k_src)
            many = len(groups_all) > 2
            grafted = sum(s.get(f"exchanged_from/{src}", s["grafted"] if not many else 0.0) for s in steps)
            d = {
                "source": src,
                "receiver": recv,
                "receiver_all_fail": len(fails) / max(1, len(groups_all[recv])),
                "candidates": len(cands),
                "candidates_per_step": len(cands) / len(steps) * scale if steps else 0.0,
                "grafted": grafted,
                "grafted_per_step": grafted / len(steps) * scale if steps else 0.0,
                "grafted_compat": compatibility_stats(scored.get((src, recv), []), delta),
                "candidate_compat": compatibility_stats(cand_rows.get((src, recv), []), delta),
            }
            if family:
                fams: dict = {}
                for g in groups_all[recv]:
                    f = fams.setdefault(family.get(g.prompt_id, "?"), {"prompts": 0, "all_fail": 0, "candidates": 0})
                    f["prompts"] += 1
                    f["all_fail"] += g.k == 0
                for g in cands:
                    fams[family.get(g.prompt_id, "?")]["candidates"] += 1
                by_fam = defaultdict(list)
                for r in cand_rows.get((src, recv), []):
                    by_fam[family.get(r["prompt_id"], "?")].append(r)
                for fam, rows in by_fam.items():
                    fams[fam]["admitted"] = sum(r["weight"] > 0 for r in rows) / len(rows)
                d["by_family"] = dict(sorted(fams.items()))
            directions[f"{src}->{recv}"] = d
    series = {r: [v for _, v in s] for r, s in comp.items()}
    for name in policies:
        vals = [v for v in series.get(name, []) if v is not None]
        policies[name]["complementarity"] = statistics.fmean(vals) if vals else None
    res = {
        "config_run_dir": cfg.run_dir,
        "method": cfg.method.name,
        "probed_as": "graft",
        "delta": delta,
        "balance": method.balance,
        "prompts": limit,
        "batches": pcfg.steps,
        "batch": pcfg.prompt_batch,
        "config_prompt_batch": cfg.prompt_batch,
        "n": cfg.n,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "policies": policies,
        "directions": directions,
        "per_step": per_step,
    }
    res["verdict"] = verdict(res)
    return res


def verdict(res: dict) -> list[str]:
    """One line per receiver: what GRAFT would graft into it per step and how much the gate admits."""
    lines = []
    for d in res["directions"].values():
        c = d["candidate_compat"]
        adm = c.get("admitted") if c.get("n") else None
        lines.append(
            f"GRAFT would graft ~{d['grafted_per_step']:.1f} groups per step (of {res['config_prompt_batch']}) from "
            f"{d['source']} into {d['receiver']}, "
            + (
                f"{100 * adm:.0f} % of their responses admitted at δ = {res['delta']:g}"
                if adm is not None
                else "nothing to admit (no candidate groups)"
            )
        )
    return lines


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def format_probe(res: dict) -> str:
    """The terminal report (80 columns)."""
    out = [
        f"graft probe: {res['prompts']} prompts x n={res['n']} ({res['batches']} batch(es) of {res['batch']}), "
        f"max_new_tokens {res['max_new_tokens']}, seed {res['seed']}"
    ]
    if res["method"] != "graft":
        out.append(f"(the config's method is {res['method']}; probed with GRAFT's exchange at δ = {res['delta']:g})")
    out += ["", f"{'policy':<22}{'reward':>8}{'all-fail':>10}{'mixed':>8}{'all-pass':>10}{'compl.':>9}"]
    for name, p in res["policies"].items():
        out.append(
            f"{name[:21]:<22}{_pct(p['reward_mean']):>8}{_pct(p['all_fail']):>10}{_pct(p['mixed']):>8}"
            f"{_pct(p['all_pass']):>10}{_pct(p.get('complementarity')):>9}"
        )
    out += [
        "",
        "compl.: share of the policy's all-fail prompts some peer solves (Fig. 1)",
        "",
        f"{'direction':<24}{'cand/step':>10}{'graft/step':>11}{'scored':>7}{'s med':>7}{'admit':>7}{'ok/wrong':>12}",
    ]
    for key, d in res["directions"].items():
        c = d["candidate_compat"]
        ok_wrong = f"{_pct(c.get('admitted_correct'))}/{_pct(c.get('admitted_wrong'))}" if c.get("n") else "-"
        med = f"{c['median_token']:.2f}" if c.get("n") else "-"
        out.append(
            f"{key.replace('->', '→')[:23]:<24}{d['candidates_per_step']:>10.1f}{d['grafted_per_step']:>11.1f}"
            f"{c.get('n', 0):>7}{med:>7}{_pct(c.get('admitted')):>7}{ok_wrong:>12}"
        )
    out += [
        "",
        "per step of the config's batch; scored: the candidates' peer responses under the receiver;",
        "s med: median token-mean compatibility; admit: share the gate admits (w > 0)",
    ]
    fam_lines = []
    for key, d in res["directions"].items():
        for fam, f in (d.get("by_family") or {}).items():
            fam_lines.append(
                f"{key.replace('->', '→')[:23]:<24}{fam[:14]:<15}{f['prompts']:>8}{f['all_fail']:>10}"
                f"{f['candidates']:>8}{_pct(f.get('admitted')):>8}"
            )
    if fam_lines:
        out += [
            "",
            f"{'direction':<24}{'family':<15}{'prompts':>8}{'all-fail':>10}{'cand.':>8}{'admit':>8}",
            *fam_lines,
        ]
    out += [""]
    for v in res["verdict"]:
        out += textwrap.wrap(v, 80, subsequent_indent="  ", break_long_words=False)
    for recv, m in (res.get("moves") or {}).items():
        line = (
            f"{res['method']} would move ~{m['groups']:.1f} groups, {m['responses']:.0f} responses, "
            f"{m['tokens']:.0f} tokens per step into {recv}"
        )
        out += textwrap.wrap(line + (f" (and {m['rewards']:.0f} peer rewards)" if m["rewards"] else ""), 80)
    return "\n".join(
        ln if len(ln) <= 80 else "\n".join(textwrap.wrap(ln, 80, subsequent_indent="  ", break_long_words=False))
        for ln in out
    )


def plot_probe(res: dict, scored: dict, cand_rows: dict, path: Path) -> None:
    """Complementarity per policy (as in Fig. 1) and each direction's compatibility histograms, δ marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(res["policies"])
    xs = range(len(names))
    w = 0.27
    for j, (key, label) in enumerate(
        (
            ("all_fail", "all-fail groups"),
            ("mixed", "mixed groups"),
            ("complementarity", "all-fail prompts a peer solves"),
        )
    ):
        vals = [res["policies"][n].get(key) or 0.0 for n in names]
        bars = axes[0].bar([x + (j - 1) * w for x in xs], vals, w, label=label, color=f"C{j}")
        axes[0].bar_label(bars, labels=[f"{100 * v:.0f}%" for v in vals], fontsize=7)
    axes[0].set_xticks(list(xs), [n[:18] for n in names])
    axes[0].set_ylim(0, 1.12)
    axes[0].set_ylabel("share of probed prompts (green: of all-fail)")
    axes[0].set_title(f"before training: {res['prompts']} prompts, n = {res['n']}")
    axes[0].legend(fontsize=8, loc="upper right")
    dirs = {k: v for k, v in cand_rows.items() if v}
    if dirs:
        plot_compatibility(axes[1:], dirs, res["delta"])
        for a in axes[1:]:
            a.set_title(a.get_title() + ": candidates' peer responses")
    else:
        for a in axes[1:]:
            a.text(
                0.5,
                0.5,
                "no complementary candidates:\nnothing to score",
                ha="center",
                va="center",
                transform=a.transAxes,
            )
            a.set_axis_off()
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
