"""Validation during training and the best checkpoint (paper Section 5.1, App. B: checkpoint
selection on held-out data; docs/design.md, layer 5).

:class:`Validation` is a part of :class:`~graft_rl.engine.trainer.Trainer`: every ``validation.every``
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

from graft_rl.data import check_answers, default_reward, load_dataset
from graft_rl.engine.evaluation import pass1_by_family
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
from graft_rl.rewards import Reward, resolve_reward
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["Validation", "pass1_variance"]


class Validation:
    """Validation and best-checkpoint keeping; mixed into the trainer, whose ``cfg``, ``run_dir``,
    ``policies``, ``names``, ``val_sets`` (label -> problems), ``val_rewards``, ``_val_family``, ``best`` and ``workers`` (the policies' handles), ``_result``
    it uses."""

    def _load_validation(self, cfg) -> None:
        """Each validation set (label -> problems) and its reward: its own, else its dataset's verifier,
        else the run's reward."""
        self.val_sets: dict[str, list] = {}
        self.val_rewards: dict[str, Reward] = {}
        for vs in cfg.validation.sets():
            problems = load_dataset(vs["data"], cfg.validation.limit, vs["columns"])
            label = vs["name"]
            self.val_sets[label] = problems
            own = vs["reward"] or default_reward(vs["data"], problems[0])
            self.val_rewards[label] = resolve_reward(own, cfg.data.success_threshold) if own else self.reward
            if self.val_rewards[label].builtin:
                check_answers(problems, self.val_rewards[label].target, vs["data"])
            elif self.val_rewards[label] is not self.reward:
                self.val_rewards[label].check(problems[0].row(), cfg.data.verify_timeout)

    def validate(self, step: int) -> list[dict]:
        """Evaluate every policy on the validation sets; keep each policy's best checkpoint."""
        if not self.val_sets:
            return []
        v = self.cfg.validation
        # every policy's evaluations submitted before any is awaited (at once under Ray)
        pending = {
            (name, ds): self.workers[name].evaluate(
                problems,
                self.val_rewards[ds],
                v.samples,
                v.temperature,
                v.top_p,
                v.max_new_tokens,
                derive_seed(self.cfg.seed, Purpose.VALIDATION, step, self.names.index(name)),
                self.cfg.data.verify_timeout,
                self.cfg.data.verify_budget,  # per chunk of problems, as a step's batch: validation time is bounded too
            )
            for name in self.policies
            for ds, problems in self.val_sets.items()
        }
        lines, improved = [], []
        for name in self.policies:
            line: dict = {"step": step, "policy": name}
            scores, variances, seconds, over = [], [], 0.0, 0
            for ds, problems in self.val_sets.items():
                res = self._result(pending[(name, ds)])
                line[f"val/{ds}"] = res["pass@1"]
                if self._val_family[ds] and res.get("correct") is not None:
                    for fam, score in pass1_by_family(problems, res["correct"], v.samples).items():
                        line[f"val/{ds}/{fam}"] = score
                scores.append(res["pass@1"])
                variances.append(pass1_variance(res.get("correct"), v.samples))
                seconds += res.get("seconds", 0.0)
                over += res.get("verify_over_budget", 0)
            line["val/score"] = statistics.fmean(scores)
            if all(x is not None for x in variances):  # the mean of the datasets' scores: its standard error
                line["val/score_se"] = math.sqrt(sum(variances)) / len(variances)
            line["time_validate"] = seconds  # measured in the worker, where the evaluation ran
            line["verify_over_budget"] = over  # answers left unchecked (scored 0) by data.verify_budget
            best = self.best.get(name)
            candidate = step > 0 or v.select_initial  # "best" is a trained checkpoint unless asked
            if candidate and (best is None or line["val/score"] > best["score"]):
                self.best[name] = {"step": step, "score": line["val/score"]}
                improved.append(name)
            line["best_step"] = self.best[name]["step"] if name in self.best else None
            lines.append(line)
        if improved:  # written under a temporary name and renamed: best/<policy> is always complete
            tmp = {name: self.run_dir / "best" / f".{name}.tmp" for name in improved}
            for t in tmp.values():
                if t.exists():
                    shutil.rmtree(t)
            try:
                saving = [self.workers[name].save(str(tmp[name].absolute())) for name in improved]
                for name, handle in zip(improved, saving, strict=True):
                    self._result(handle)
                    # graft eval checks best/<policy> against it: files, step and run
                    write_manifest(tmp[name], step, run_identity(self.run_dir))
                    replace_dir(tmp[name], self.run_dir / "best" / name)
                write_text_atomic(self.run_dir / "best" / "best.json", json.dumps(self.best, indent=1))
            except Exception as exc:  # noqa: BLE001 a full disk (OSError, torch, safetensors): one line; resume redoes it
                from graft_rl.engine.checkpointing import CheckpointError, is_write_error, write_error_text

                if not isinstance(exc, OSError) and not is_write_error(exc):
                    raise
                raise CheckpointError(
                    f"cannot write {self.run_dir / 'best'}: {write_error_text(exc, self.run_dir)}"
                ) from None
        append_lines(self.run_dir / "validation.jsonl", [json.dumps(finite_json(ln)) for ln in lines])
        self.trackers.log(lines)
        return lines

    def _best_from_log(self) -> dict[str, dict]:
        return best_steps(read_log(self.run_dir / "validation.jsonl")[0], self.cfg.validation.select_initial)


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
