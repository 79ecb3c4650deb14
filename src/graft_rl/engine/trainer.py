"""The step loop for N policies (docs/design.md, layer 5): :meth:`Trainer.step` is the whole step.

One step (paper Section 4, Algorithm in Figure 2), each phase a call whose arguments carry the data:

1. generate (:meth:`Rollouts.generate <graft_rl.engine.rollouts.Rollouts.generate>`): every live
   policy samples ``n`` responses for the same prompt batch, at once under Ray;
2. verify (:meth:`Rollouts.verify <graft_rl.engine.rollouts.Rollouts.verify>`): rewards are verified
   (hard timeout per answer), the method's rollout filter refills, stored peers' groups are replayed
   (Section 6.2), and each policy's groups are recorded;
3. exchange (:meth:`Trainer.exchange`): for each receiver the method builds its batch (own groups,
   grafted groups with source advantages; Section 4.1);
4. update (:meth:`Trainer.update`): each receiver computes its log-probs of every row under its own
   tokenisation once, before any update (pi_old), weighs peer rows by compatibility (Section 4.2), orders its
   groups into minibatches (peer-last) and runs one epoch, all receivers at once under Ray;
5. validate (:class:`~graft_rl.engine.validation.Validation`) and 6. checkpoint
   (:class:`~graft_rl.engine.checkpointing.Checkpoints`) when due.

Every random draw derives from ``(seed, purpose, step, policy)``, never from global RNG state, so a
resumed run reproduces an uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import statistics
import textwrap
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from graft_rl.data import Problem
from graft_rl.engine.checkpointing import CheckpointError, Checkpoints, cpu_threads, gone_source
from graft_rl.engine.config import ConfigError, TrainConfig, load_config, to_dict
from graft_rl.engine.generators import OneStepOff
from graft_rl.engine.handles import Pending, WorkerHandle, completion_order, start_workers
from graft_rl.engine.prompts import PromptRows, check_prompts, prompt_families, training_data
from graft_rl.engine.provenance import check_allowed, fingerprint
from graft_rl.engine.resources import check_resources
from graft_rl.engine.rollouts import DynamicSamplingError, Rollouts, run_reward
from graft_rl.engine.rundir import RunLock, append_lines, clean_stale, finite_json, write_text_atomic
from graft_rl.engine.store import RecordStore
from graft_rl.engine.trackers import Trackers, completion_rows
from graft_rl.engine.validation import Validation, best_from_log, validation_sets
from graft_rl.errors import MissingSourceError
from graft_rl.methods import build_method
from graft_rl.methods.exchange import ReceiverBatch
from graft_rl.methods.reporting import family_stats
from graft_rl.policy import PolicyConfig, RolloutGroup, SamplingParams
from graft_rl.rewards import Reward
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["Trainer", "RunInterrupted", "CheckpointError", "DynamicSamplingError", "derive_seed"]


def _draws(seed: int, step: int, index: int) -> tuple[torch.Generator, torch.Generator]:
    """A receiver's exchange draws at a step: the exchange's (``Purpose.EXCHANGE``) and an unpaired
    composition's (``Purpose.SWARM``), each ``derive_seed(seed, purpose, step, receiver index)``."""
    gens = (torch.Generator().manual_seed(derive_seed(seed, p, step, index)) for p in (Purpose.EXCHANGE, Purpose.SWARM))
    return next(gens), next(gens)


def _check_vocabulary(cfg: TrainConfig, workers: dict[str, WorkerHandle]) -> None:
    """A loss with ``peer_tokens`` (F-TIS) trains a peer's sampled token ids as the receiver's: every
    policy must have one vocabulary, else one line naming the two that differ."""
    if not cfg.method.reads_peer_tokens() or len(workers) < 2:
        return
    loss = cfg.method.part_name("loss")
    digests = {name: h.vocab_digest().get() for name, h in workers.items()}
    first, *rest = digests
    for name in rest:
        if digests[name] != digests[first]:
            raise ConfigError(
                f"method.loss {loss!r} trains a peer's sampled token ids and weighs them by its per-token "
                f"log-probs, which needs one shared vocabulary, but policies {first!r} and {name!r} have different "
                "tokenizers (its setting is a swarm of one model family); choose another method for this pair"
            )


def _renamed_argument(reward_groups, scorer):
    """``Trainer(scorer=)``, the old name of ``reward_groups=``: accepted for one version, with a warning."""
    if scorer is None:
        return reward_groups
    if reward_groups is not None:
        raise TypeError("Trainer: give reward_groups= only (scorer= is its deprecated old name)")
    warnings.warn(
        "Trainer(scorer=...) is deprecated (0.2.0) and will be removed in 0.3.0: use Trainer(reward_groups=...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return scorer


class Trainer:
    """Co-train the configured policies with the configured method.

    The trainer holds the run's state and its collaborators, each given what it works on:
    :class:`~graft_rl.engine.rollouts.Rollouts` (generation and rewards),
    :class:`~graft_rl.engine.validation.Validation` (validation and ``best/``) and
    :class:`~graft_rl.engine.checkpointing.Checkpoints` (checkpoints and resume). The exchange and
    the update are the method's (:mod:`graft_rl.methods`), run by :meth:`exchange` and :meth:`update`.
    """

    #: The rollout phase's class (a subclass may score differently: ``graft preflight``'s fixed rewards).
    rollouts_cls: type[Rollouts] = Rollouts

    def __init__(
        self,
        cfg: TrainConfig,
        resume: bool = False,
        show_progress: bool = True,
        *,
        reward: str | Callable | Reward | None = None,
        reward_groups: Callable[[list[RolloutGroup]], dict] | None = None,
        workers: Callable[[TrainConfig, list[PolicyConfig]], dict[str, WorkerHandle]] = start_workers,
        allow_changed: Sequence[str] = (),
        scorer: Callable[[list[RolloutGroup]], dict] | None = None,
    ):
        """``reward``: the run's reward in place of ``data.reward`` -- a name, ``module:function``, or a
        Python function ``(responses, problems) -> list[float]`` (docs/tasks.md); it scores training,
        validation sets without a reward of their own, and is recorded in ``config.yaml``.
        ``reward_groups``: sets the ``rewards`` of a step's groups in place and returns its counts
        (``verify_timeouts``, ...), bypassing the reward (tests, preflight); default
        :meth:`Rollouts.reward_groups <graft_rl.engine.rollouts.Rollouts.reward_groups>`.
        ``workers``: builds each policy's :class:`~graft_rl.engine.handles.WorkerHandle` from the config and
        the policies' configs; default: in-process or Ray actors, as ``execution`` says.
        ``allow_changed``: on resume, go on although the reward's source (``"reward"``) or a data file
        (``"data"``) changed since the checkpoint (:mod:`~graft_rl.engine.provenance`); recorded.
        ``scorer``: the old name of ``reward_groups`` (deprecated in 0.2.0; removed in 0.3.0)."""
        reward_groups = _renamed_argument(reward_groups, scorer)
        check_resources(cfg)  # one line, before any model or data is touched, if e.g. no GPU is there
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.show_progress = show_progress
        self.workers: dict[str, WorkerHandle] = {}
        self.lock = RunLock(self.run_dir)
        if not resume:
            _check_fresh_run_dir(self.run_dir)
        created = not self.run_dir.exists()
        self.lock.acquire()  # before anything is written: a second run on this directory stops here
        for name in START_LEFTOVERS[1:]:  # a start killed mid-write (the lock is ours now: nobody writes them)
            (self.run_dir / name).unlink(missing_ok=True)
        try:
            self._init(cfg, resume, reward, reward_groups, workers, check_allowed(allow_changed))
        except BaseException as exc:
            self.close()
            if resume and isinstance(exc, MissingSourceError):  # a plugin or reward file moved away
                raise gone_source(self.run_dir, exc) from None
            if not resume:  # bad input leaves nothing behind in a fresh run directory
                for f in (self.run_dir / "config.yaml", *(self.run_dir / n for n in START_LEFTOVERS)):
                    f.unlink(missing_ok=True)
                if created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                    self.run_dir.rmdir()
            raise

    def _init(self, cfg: TrainConfig, resume: bool, reward_arg, reward_groups, start, allow_changed) -> None:
        """Everything is checked before a model loads: data, rewards, validation sets, the checkpoint
        and its config and provenance; then the workers start and the run resumes or begins."""
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        threads = cpu_threads(cfg)  # before any engine changes this process's count (vLLM sets 1)
        self.store = RecordStore(self.run_dir)
        self.data: Sequence[Problem] = training_data(cfg)  # a table file stays Arrow columns
        rows = PromptRows(self.data)  # what the reward gets for a prompt, for the prompts drawn lately
        self.reward = run_reward(cfg, self.data, reward_arg)
        val_sets, val_rewards = validation_sets(cfg, self.reward)
        # prompt id -> family, when the data names a few; validation sets scored per family too
        self.family, val_family = prompt_families(rows, self.data, val_sets)
        self.provenance = fingerprint(cfg, {"train": self.reward, **val_rewards})  # what resume compares
        self.total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * (len(self.data) // cfg.prompt_batch)
        self.method = build_method(cfg.method)  # the driver's side of it: exchange, per-step state, filter
        self.sampling = SamplingParams(cfg.n, cfg.temperature, cfg.top_p, 0, cfg.max_new_tokens)
        self.start_step = 1
        self._prefetch_until = 0  # the last step of the current run() call (Ray: next-step generations up to it)
        self.checkpoints = Checkpoints(cfg, self.run_dir, self.store, threads, self.provenance)
        ckpt, changes = None, []
        if resume:
            for stale in clean_stale(self.run_dir):
                print(f"graft train: removed {stale} (left by an interrupted write)")
            ckpt = self.checkpoints.latest(announce=True)
            if ckpt is not None:  # before anything is rewritten: a refusal changes nothing
                changes = self.checkpoints.check(ckpt, self.total_steps, allow_changed)
            else:  # killed before its first checkpoint: start again from step 1 with the saved config
                print(f"graft train: {self.run_dir} has no checkpoint yet; starting the run from step 1")
                self.checkpoints.restart_from_scratch()
        write_text_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.workers = start(cfg, [_from_checkpoint(pc, ckpt) if ckpt else pc for pc in cfg.policies])
        # name -> the in-process Policy, or (Ray) its config: the model lives in the actor
        self.policies = {name: h.policy for name, h in self.workers.items()}
        # rollout.mode: one_step_off: each policy's generators, sampling step t+1 while step t updates
        self.one_step = OneStepOff(cfg, self.workers) if cfg.rollout.mode == "one_step_off" else None
        peers = {p.name or p.policy: (RecordStore(p.records), p.policy) for p in cfg.peers}
        self.live = set(self.policies)
        self.names = [p.name for p in cfg.policies] + list(peers)
        if ckpt is not None:
            method_state, done = self.checkpoints.restore(ckpt, self.workers, changes)
            self.method.load_state_dict(method_state)
            self.start_step = done + 1
            if self.one_step is not None:  # the batch the checkpoint saved in flight, if it did
                self.one_step.restore(ckpt, done + 1)
        self.trackers = Trackers(cfg.trackers, self.run_dir, to_dict(cfg), cfg.tracking)
        # every prompt fits every policy's context (and max_prompt_tokens): one line now, not a crash mid-run
        # and a response never runs past it: a policy whose context cannot hold the longest prompt plus
        # max_new_tokens samples at most what it leaves, and says so (a learned-position model would crash).
        # Only prompts whose size could reach a limit are tokenised (engine/prompts.py); validation clamps per call
        _check_vocabulary(cfg, self.workers)  # a loss that reads peers' token ids: one vocabulary
        budgets = check_prompts(self.workers, self.data, list(val_sets.values()), cfg.max_new_tokens)
        self.samplings = {}
        for name, (budget, note) in budgets.items():
            if note:
                print(f"graft train: {note}")
            self.samplings[name] = dataclasses.replace(self.sampling, max_new_tokens=budget)
        self.rollouts = self.rollouts_cls(
            cfg,
            self.data,
            rows,
            self.reward,
            self.workers,
            self.samplings,
            self.names,
            self.method,
            peers,
            reward_groups,
            self.one_step,
        )
        best = best_from_log(self.run_dir, cfg.validation.select_initial)
        if ckpt is not None:
            self.checkpoints.reconcile_best(best)  # best/ as the truncated validation log names it
        self.validation = Validation(
            cfg, self.run_dir, val_sets, val_rewards, val_family, self.workers, self.names, self.trackers, best
        )

    # ------------------------------------------------------------------ one step
    def step(self, step: int, stop: _GracefulStop | None = None) -> list[dict]:
        """One training step (paper Section 4; the six phases in order) and its metric lines.
        ``stop``: the run's signal handler; a signal during the step makes it end with a checkpoint."""
        started = time.perf_counter()
        pending = self.rollouts.generate(step, self.policies)  # 1. generate (at once under Ray)
        groups, lines = self.rollouts.verify(step, pending)  # 2. verify: rewards, dynamic sampling, peers
        for name in self.policies:
            self.store.write(step, groups[name])
        # one step off: push the weights, start step + 1's generation (past this run() call only for a checkpoint)
        self.rollouts.advance(
            step, self.total_steps if self.checkpoints.due(step, self.total_steps) else self._prefetch_until
        )
        batches = self.exchange(step, groups, lines)  # 3. exchange: each receiver's batch
        self.update(step, batches, groups, lines)  # 4. update: every receiver's epoch
        if self.one_step is not None:
            self.one_step.overlap(lines, time.perf_counter() - started)
        out = [lines[n] for n in self.policies]
        self._write_metrics(out)
        if self.validation.due(step, self.total_steps):
            self.validation.run(step)  # 5. validate, and keep each policy's best
        if self.checkpoints.due(step, self.total_steps) or (stop is not None and stop.signum is not None):
            self.save_checkpoint(step)  # 6. checkpoint
        return out

    def exchange(
        self, step: int, groups: dict[str, list[RolloutGroup]], lines: dict[str, dict]
    ) -> dict[str, ReceiverBatch]:
        """A step's exchange phase: the method's per-step state (:meth:`Method.observe`), each
        receiver's batch (selection, composition, advantages; Section 4.1), and the groups'
        statistics in ``lines``. (``graft probe`` runs this.)"""
        self.method.observe(groups)
        batches: dict[str, ReceiverBatch] = {}
        for name in self.policies:
            gen, swarm = _draws(self.cfg.seed, step, self.names.index(name))
            batches[name] = self.method.build(name, groups, self.live, self.cfg.n, gen, swarm)
            lines[name].update(_group_stats(groups[name]))
        return batches

    def update(
        self,
        step: int,
        batches: dict[str, ReceiverBatch],
        groups: dict[str, list[RolloutGroup]],
        lines: dict[str, dict],
    ) -> None:
        """A step's update phase: every receiver computes pi_old, weighs and trains on its batch where its model
        lives (Section 4.2-4.3); all are started before any is awaited, so under Ray each policy's
        devices score and train at the same time (in-process one after the other). Under Ray a policy
        whose update is done starts generating the next step at once (its weights are final for the
        step), rather than idle until the slower policy's update is done too."""
        pending = {name: self._train_receiver(name, batches[name], step) for name in self.policies}
        if step < self._prefetch_until and any(self.workers[name].concurrent for name in pending):
            self.rollouts.prefetch(completion_order(pending), step + 1)
        for name in self.policies:
            lines[name].update(self._finish_receiver(name, batches[name], step, pending[name]))
            if self.family:
                lines[name].update(family_stats(batches[name], self.family, groups[name]))

    def _train_receiver(self, name: str, batch: ReceiverBatch, step: int) -> Pending:
        """Start scoring, weighting and updating one receiver where its model lives."""
        seed = derive_seed(self.cfg.seed, Purpose.UPDATE, step, self.names.index(name))
        sp = self.samplings[name]
        # the engine's log-probs are of the trainer's distribution unless sampling truncated it (top-p/top-k)
        same = sp.top_p >= 1.0 and not sp.top_k
        return self.workers[name].train(batch, step, seed, self.cfg.temperature, sp.max_new_tokens, same)

    def _finish_receiver(self, name: str, batch: ReceiverBatch, step: int, handle: Pending) -> dict:
        """Wait for a receiver's update; keep its rows' weights and inclusion on the driver's batch
        (the per-family counts read them) and record what it grafted."""
        upd = handle.get()
        for r, w, inc in zip(batch.rows, upd.weights, upd.included, strict=True):
            r.weight, r.include = w, inc
        self.store.write_exchange(step, name, upd.exchange_rows + batch.moved)
        if self.trackers.wants_completions(step):
            rows = completion_rows(
                step, name, batch.rows, upd.weights, upd.exchange_rows, self.cfg.tracking.completions_rows
            )
            self.trackers.add_completions(step, rows)
        stats = upd.stats
        if stats.pop("nonfinite_stop", False):
            raise FloatingPointError(f"step {step}, policy {name!r}: non-finite loss or gradient (nonfinite_loss=stop)")
        return stats

    def save_checkpoint(self, step: int) -> Path:
        """``checkpoints/step_N`` of every policy, the method's state, and best/ committed with it; one step off,
        the batch in flight too (``rollout.inflight_at_checkpoint: save``)."""
        path = self.checkpoints.save(step, self.workers, self.method.state_dict(), self.validation.best)
        if self.one_step is not None:
            self.one_step.save(path, step + 1)
        return path

    # ------------------------------------------------------------------ run
    def run(self, max_steps: int | None = None) -> list[dict]:
        """Train from ``start_step`` to the end (or ``max_steps`` steps, for tests); returns the metric lines.

        A first SIGINT/SIGTERM lets the current step finish (its metrics, due validation and a
        checkpoint), then stops with :class:`RunInterrupted`: ``--resume`` continues exactly where it
        stopped. A second signal stops at once (``KeyboardInterrupt``); ``--resume`` then continues
        from the last checkpoint, dropping what came after it.
        """
        end = self.total_steps if max_steps is None else min(self.total_steps, self.start_step + max_steps - 1)
        all_lines: list[dict] = []
        self.lock.acquire()
        bar = tqdm(
            range(self.start_step, end + 1),
            desc="graft train",
            unit="step",
            disable=not self.show_progress,
            initial=self.start_step - 1,
            total=self.total_steps,
        )
        stop = _GracefulStop()
        self._prefetch_until = end
        if self.validation.sets:
            print(textwrap.fill(self.validation.announce(), 80, subsequent_indent="  ", break_long_words=False))
        try:
            if self.start_step == 1 and self.cfg.validation.at_start and self.validation.sets:
                self.validation.run(0)
            for step in bar:
                lines = self.step(step, stop)
                all_lines.extend(lines)
                bar.set_postfix_str(_summary(lines))
                self.start_step = step + 1  # a later run() call continues here
                if stop.signum:
                    bar.close()
                    print(
                        f"graft train: stopped after step {step} ({signal.Signals(stop.signum).name}); "
                        f"checkpoint in {self.run_dir} (resume with --resume)"
                    )
                    raise RunInterrupted(stop.signum)
        except KeyboardInterrupt as exc:
            if not isinstance(exc, RunInterrupted):
                bar.close()
                _say_stopped_at_once(self.run_dir)
            raise
        finally:
            self._prefetch_until = 0
            self.rollouts.drop_prefetched()  # a generation started for a step this call does not run: dropped
            stop.restore()
            bar.close()
            self.lock.release()
        return all_lines

    def close(self) -> None:
        """Release the run-directory lock, the trackers, and any Ray actors and placement groups."""
        if hasattr(self, "trackers"):
            self.trackers.finish()
        self.lock.release()
        for handle in [*self.workers.values(), *filter(None, [getattr(self, "one_step", None)])]:
            handle.close()  # each policy's trainer, and one step off its generators
        self.workers, self.one_step = {}, None

    def _write_metrics(self, lines: list[dict]) -> None:
        append_lines(self.run_dir / "metrics.jsonl", [json.dumps(finite_json(x), default=_json_default) for x in lines])
        self.trackers.log(lines)

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        show_progress: bool = True,
        overrides: list[str] | None = None,
        allow_changed: Sequence[str] = (),
    ) -> Trainer:
        """Continue a run; ``overrides`` may change only :data:`~graft_rl.engine.rundir.HARMLESS_KEYS` (e.g.
        ``steps=200``); ``allow_changed``: ``"reward"``, ``"data"`` (see :class:`Trainer`)."""
        cfg = _resumed_config(Path(run_dir), overrides or [])
        return cls(cfg, resume=True, show_progress=show_progress, allow_changed=allow_changed)


def _resumed_config(run_dir: Path, overrides: list[str]) -> TrainConfig:
    """The config a resume runs with: the saved one (or, when damaged, a checkpoint's copy) with ``overrides``."""
    cfg_path = _saved_config(run_dir)
    try:
        load_config(cfg_path, [f"run_dir={run_dir}"], saved=True)
        source: Path | dict = cfg_path
    except MissingSourceError as exc:  # the config is fine; a file it names is gone
        raise gone_source(run_dir, exc) from None
    except ConfigError as exc:  # torn or edited config.yaml: every checkpoint holds the config it ran with
        source = _config_from_checkpoints(run_dir, cfg_path, exc)
    return load_config(source, [*overrides, f"run_dir={run_dir}"], saved=True)


def _group_stats(own: list[RolloutGroup]) -> dict:
    """A policy's own groups in its metric line: reward, all-fail/all-pass fractions, lengths."""
    rewards = [r for g in own for r in g.rewards]
    lengths = [len(ids) for g in own for ids in g.token_ids]
    return {
        "reward_mean": statistics.fmean(rewards),
        "all_fail_frac": sum(1 for g in own if g.k == 0) / len(own),
        "all_pass_frac": sum(1 for g in own if g.k == g.n) / len(own),
        "response_len_mean": statistics.fmean(lengths),
        "truncated_frac": sum(1 for g in own for f in g.finish_reasons if f == "length") / len(lengths),
    }


def _say_stopped_at_once(run_dir: Path) -> None:
    # the newest checkpoint by name: no checksums on the way out (resume verifies them)
    last = max((run_dir / "checkpoints").glob("step_*"), default=None)
    where = "step " + last.name.split("_")[1].lstrip("0") if last else "the start"
    print(f"graft train: stopped at once; --resume continues from {where} in {run_dir}")


def _saved_config(run_dir: Path) -> Path:
    """``RUN_DIR/config.yaml``, or one line: a run stopped before writing it has nothing to resume."""
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        left = run_dir.is_dir() and not any(p.name not in START_LEFTOVERS for p in run_dir.iterdir())
        raise ConfigError(
            f"{run_dir}: stopped before its config was written (nothing to resume); start it again with "
            f"graft train CONFIG run_dir={run_dir}"
            if left
            else f"{run_dir}: not a run directory (no config.yaml)"
        )
    return cfg_path


def _config_from_checkpoints(run_dir: Path, cfg_path: Path, exc: Exception) -> dict:
    """The config saved in the newest checkpoint's ``trainer_state.json``, when ``config.yaml`` is damaged."""
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*"), reverse=True):
        try:
            saved = json.loads((ckpt / "trainer_state.json").read_text()).get("config")
        except (OSError, ValueError):
            continue
        if saved:
            print(
                f"graft train: {cfg_path} is damaged ({exc}); resuming with the config saved in checkpoint {ckpt.name}"
            )
            return saved
    raise ConfigError(f"{cfg_path} is damaged ({exc}) and no checkpoint holds a copy of the config") from None


class RunInterrupted(KeyboardInterrupt):
    """The run stopped cleanly at a step boundary after a signal (``graft train`` exits 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _GracefulStop:
    """SIGINT/SIGTERM handlers: the first signal is remembered (the loop stops after the step),
    a second one raises ``KeyboardInterrupt`` at once. Installed only on the main thread."""

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: signals keep their handlers
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\ngraft train: {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
            f"(send it again to stop at once)",
            flush=True,
        )

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self.previous = {}


#: What a start killed at its very first writes leaves (the lock's pid file, mid-write or whole, and a
#: config mid-write): such a directory is started again by the same command, and these are removed.
START_LEFTOVERS = (".lock", ".lock.tmp", "config.yaml.tmp")


def _check_fresh_run_dir(run_dir: Path) -> None:
    """A fresh run needs an absent or empty run directory (or one left by an immediately failed start)."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"run_dir {run_dir} exists and is not a directory")
    held = sorted(p.name for p in run_dir.iterdir() if p.name not in START_LEFTOVERS)
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"run_dir {run_dir} already holds a run ({shown}); use --resume {run_dir} or another run_dir")


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def _summary(lines: list[dict]) -> str:
    parts = []
    for ln in lines:
        ex = ln.get("exchanged_in", 0)
        parts.append(f"{ln['policy']} reward {ln['reward_mean']:.2f} grafted {int(ex)}")
    return " | ".join(parts)


def _from_checkpoint(pc: PolicyConfig, ckpt: Path) -> PolicyConfig:
    """A policy resumed from checkpoint ``ckpt``: its weights from there (an absolute path: a Ray actor
    does not work in the driver's directory), its KL reference still the model it started from."""
    ref = {
        "reference_model": pc.reference_model or pc.model,
        "reference_gguf_file": pc.reference_gguf_file if pc.reference_model else pc.gguf_file,
    }
    if pc.lora is not None:  # the reference is the base under the adapter, recorded in the checkpoint
        ref = {"reference_model": None, "reference_gguf_file": None}
    return PolicyConfig(
        **{**to_dict(pc), "model": str((ckpt / pc.name).absolute()), "gguf_file": None, "tokenizer": None, **ref}
    )
