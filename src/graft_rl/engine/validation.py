"""Validation during training and the best checkpoint (paper Section 5.1, App. B: checkpoint
selection on held-out data; docs/design.md, layer 5).

:class:`Validation` is the trainer's collaborator for step 5: every ``validation.every``
steps each policy is scored on every validation set (pass@1 over ``validation.samples`` samples,
per prompt family too when the data names a few), ``validation.jsonl`` gets one line per policy,
and a policy whose mean score beats its best so far is saved to ``best/<policy>`` (under a
temporary name, then renamed) with ``best/best.json``. With Ray, every policy's evaluation runs at
once on its own devices.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from graft_rl.data import check_answers, default_reward, load_dataset
from graft_rl.engine.checkpointing import CheckpointError, is_write_error, write_error_text
from graft_rl.engine.evaluation import pass1_by_family
from graft_rl.engine.handles import WorkerHandle
from graft_rl.engine.rundir import (
    append_lines,
    best_steps,
    finite_json,
    read_log,
    replace_dir,
    run_identity,
    write_manifest,
    write_text_atomic,
)
from graft_rl.engine.trackers import Trackers
from graft_rl.rewards import Reward, resolve_reward
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["Validation", "best_from_log", "pass1_variance", "validation_sets"]


def validation_sets(cfg, run_reward: Reward) -> tuple[dict[str, list], dict[str, Reward]]:
    """Each validation set (label -> problems) and its reward: its own, else its dataset's verifier,
    else the run's reward. Checked now: one line before any model loads."""
    sets: dict[str, list] = {}
    rewards: dict[str, Reward] = {}
    for vs in cfg.validation.sets():
        problems = load_dataset(vs["data"], cfg.validation.limit, vs["columns"])
        label = vs["name"]
        sets[label] = problems
        own = vs["reward"] or default_reward(vs["data"], problems[0])
        rewards[label] = resolve_reward(own, cfg.data.success_threshold) if own else run_reward
        if rewards[label].builtin:
            check_answers(problems, rewards[label].target, vs["data"])
        elif rewards[label] is not run_reward:
            rewards[label].check(problems[0].row(), cfg.data.verify_timeout)
    return sets, rewards


def best_from_log(run_dir: Path, select_initial: bool) -> dict[str, dict]:
    """Each policy's best validation so far (``{"step", "score"}``), as ``validation.jsonl`` names it."""
    return best_steps(read_log(run_dir / "validation.jsonl")[0], select_initial)


class Validation:
    """Step 5 of a training step: every policy (its ``workers``) scored on the validation ``sets``
    with their ``rewards``; ``families`` says which sets are scored per prompt family too; ``best``
    (policy -> ``{"step", "score"}``) is kept and ``best/`` written with it."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        sets: Mapping[str, list],
        rewards: Mapping[str, Reward],
        families: Mapping[str, bool],
        workers: Mapping[str, WorkerHandle],
        names: Sequence[str],
        trackers: Trackers,
        best: dict[str, dict],
    ):
        self.cfg, self.run_dir, self.sets, self.rewards, self.families = cfg, run_dir, sets, rewards, families
        self.workers, self.names, self.trackers, self.best = workers, list(names), trackers, best

    def due(self, step: int, last: int) -> bool:
        """Whether step ``step`` of a run of ``last`` steps ends with a validation."""
        return bool(self.sets) and (step % self.cfg.validation.every == 0 or step == last)

    def announce(self) -> str:
        """What the run will validate, in a line."""
        v = self.cfg.validation
        sizes = ", ".join(f"{ds} {len(ps)}" for ds, ps in self.sets.items())
        return (
            f"graft train: validation every {v.every} steps: {v.samples} samples per problem at "
            f"temperature {v.temperature:g} ({sizes} problems); best/ by their mean pass@1"
        )

    def run(self, step: int) -> list[dict]:
        """Evaluate every policy on the validation sets; keep each policy's best checkpoint."""
        if not self.sets:
            return []
        v = self.cfg.validation
        # every policy's evaluations submitted before any is awaited (at once under Ray)
        pending = {
            (name, ds): self.workers[name].evaluate(
                problems,
                self.rewards[ds],
                v.samples,
                v.temperature,
                v.top_p,
                v.max_new_tokens,
                derive_seed(self.cfg.seed, Purpose.VALIDATION, step, self.names.index(name)),
                self.cfg.data.verify_timeout,
                self.cfg.data.verify_budget,  # per chunk of problems, as a step's batch: validation time is bounded too
            )
            for name in self.workers
            for ds, problems in self.sets.items()
        }
        lines, improved = [], []
        for name in self.workers:
            line = self._line(step, name, {ds: pending[(name, ds)].get() for ds in self.sets})
            best = self.best.get(name)
            candidate = step > 0 or v.select_initial  # "best" is a trained checkpoint unless asked
            if candidate and (best is None or line["val/score"] > best["score"]):
                self.best[name] = {"step": step, "score": line["val/score"]}
                improved.append(name)
            line["best_step"] = self.best[name]["step"] if name in self.best else None
            lines.append(line)
        if improved:
            self._save_best(step, improved)
        append_lines(self.run_dir / "validation.jsonl", [json.dumps(finite_json(ln)) for ln in lines])
        self.trackers.log(lines)
        return lines

    def _line(self, step: int, name: str, results: dict[str, dict]) -> dict:
        """A policy's validation line from its result on each set."""
        v = self.cfg.validation
        line: dict = {"step": step, "policy": name}
        scores, variances, seconds, over = [], [], 0.0, 0
        for ds, res in results.items():
            line[f"val/{ds}"] = res["pass@1"]
            if self.families[ds] and res.get("correct") is not None:
                for fam, score in pass1_by_family(self.sets[ds], res["correct"], v.samples).items():
                    line[f"val/{ds}/{fam}"] = score
            scores.append(res["pass@1"])
            variances.append(pass1_variance(res.get("correct"), v.samples))
            seconds += res.get("seconds", 0.0)
            over += res.get("verify_over_budget", 0)
        line["val/score"] = statistics.fmean(scores)
        if all(x is not None for x in variances):  # the mean of the datasets' scores: its standard error
            line["val/score_se"] = math.sqrt(sum(v for v in variances if v is not None)) / len(variances)
        line["time_validate"] = seconds  # measured in the worker, where the evaluation ran
        line["verify_over_budget"] = over  # answers left unchecked (scored 0) by data.verify_budget
        return line

    def _save_best(self, step: int, improved: list[str]) -> None:
        """``best/<policy>`` for each improved policy, written under a temporary name and renamed
        (best/<policy> is always complete), and ``best/best.json``."""
        tmp = {name: self.run_dir / "best" / f".{name}.tmp" for name in improved}
        for t in tmp.values():
            if t.exists():
                shutil.rmtree(t)
        try:
            # best/ is evaluated, never resumed: no rollout.lag history (k + 1 copies of the weights)
            saving = [self.workers[name].save(str(tmp[name].absolute()), lag=False) for name in improved]
            for name, handle in zip(improved, saving, strict=True):
                handle.get()
                # graft eval checks best/<policy> against it: files, step and run
                write_manifest(tmp[name], step, run_identity(self.run_dir))
                replace_dir(tmp[name], self.run_dir / "best" / name)
            write_text_atomic(self.run_dir / "best" / "best.json", json.dumps(self.best, indent=1))
        except Exception as exc:  # noqa: BLE001 a full disk (OSError, torch, safetensors): one line; resume redoes it
            if not isinstance(exc, OSError) and not is_write_error(exc):
                raise
            raise CheckpointError(
                f"cannot write {self.run_dir / 'best'}: {write_error_text(exc, self.run_dir)}"
            ) from None


def pass1_variance(correct: list[int] | None, samples: int) -> float | None:
    """Sampling variance of a dataset's pass@1 (mean over problems of ``c_i / k``).

    With ``k > 1`` samples per problem: ``sum_i p_i (1 - p_i) / (k - 1) / N^2`` (unbiased per
    problem); with ``k = 1``: ``p (1 - p) / N``, the Bernoulli bound over problems.
    """
    if not correct:
        return None
    n = len(correct)
    p = [c / samples for c in correct]
    if samples > 1:
        return sum(x * (1 - x) for x in p) / (samples - 1) / n**2
    mean = statistics.fmean(p)
    return mean * (1 - mean) / n
