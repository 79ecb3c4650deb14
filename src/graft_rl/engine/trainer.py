"""The step loop for N policies (docs/design.md, layer 5): generate, verify, exchange, score, update.

One step (paper Section 4, Algorithm in Figure 2):

1. every live policy samples ``n`` responses for the same prompt batch; replayed peers
   read theirs from records (Section 6.2);
2. rewards are verified (hard timeout per answer) and each policy's groups are recorded;
3. for each receiver the exchange builds its batch (own groups, grafted groups with source
   advantages), the receiver scores every row under its own tokenisation once, before any
   update (old log-probs), and the weighting turns compatibility scores into weights;
4. the receiver's groups are ordered into minibatches (peer-last) and one epoch of
   updates runs.

Every random draw derives from ``(seed, step, policy)``, never from global RNG state, so a
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
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from graft_rl.data import Problem
from graft_rl.engine.checkpointing import CheckpointError, Checkpointing, cpu_threads
from graft_rl.engine.config import ConfigError, TrainConfig, load_config, to_dict
from graft_rl.engine.handles import Pending, WorkerHandle, completion_order, start_workers
from graft_rl.engine.plan import check_resources
from graft_rl.engine.prompts import PromptRows, check_prompts, prompt_families, training_data
from graft_rl.engine.provenance import check_allowed, fingerprint
from graft_rl.engine.rollouts import DynamicSamplingError, Rollouts
from graft_rl.engine.rundir import RunLock, append_lines, clean_stale, finite_json, write_text_atomic
from graft_rl.engine.store import RecordStore
from graft_rl.engine.trackers import Trackers, completion_rows
from graft_rl.engine.validation import Validation
from graft_rl.methods import build_method
from graft_rl.methods.exchange import ReceiverBatch
from graft_rl.policy import PolicyConfig, RolloutGroup, SamplingParams
from graft_rl.rewards import Reward
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["Trainer", "RunInterrupted", "CheckpointError", "DynamicSamplingError", "derive_seed"]


class Trainer(Rollouts, Checkpointing, Validation):
    """Co-train the configured policies with the configured method."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: bool = False,
        show_progress: bool = True,
        *,
        reward: str | Callable | Reward | None = None,
        scorer: Callable[[list[RolloutGroup]], dict] | None = None,
        workers: Callable[[TrainConfig, list[PolicyConfig]], dict[str, WorkerHandle]] = start_workers,
        allow_changed: Sequence[str] = (),
    ):
        """``reward``: the run's reward in place of ``data.reward`` -- a name, ``module:function``, or a
        Python function ``(responses, problems) -> list[float]`` (docs/tasks.md); it scores training,
        validation sets without a reward of their own, and is recorded in ``config.yaml``.
        ``scorer``: scores a step's groups in place (sets each group's ``rewards``) and returns its
        counts (``verify_timeouts``, ...), bypassing the reward (tests, preflight); default :meth:`score_groups`.
        ``workers``: builds each policy's :class:`~graft_rl.engine.handles.WorkerHandle` from the config and
        the policies' configs; default: in-process or Ray actors, as ``execution`` says.
        ``allow_changed``: on resume, go on although the reward's source (``"reward"``) or a data file
        (``"data"``) changed since the checkpoint (:mod:`~graft_rl.engine.provenance`); recorded."""
        check_resources(cfg)  # one line, before any model or data is touched, if e.g. no GPU is there
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.show_progress = show_progress
        self.scorer, self._reward_arg = scorer, reward  # no bound method stored: no cycle keeps Ray actors alive
        self._start_workers = workers
        self.allow_changed = check_allowed(allow_changed)
        self.workers: dict[str, WorkerHandle] = {}
        self.lock = RunLock(self.run_dir)
        if not resume:
            _check_fresh_run_dir(self.run_dir)
        created = not self.run_dir.exists()
        self.lock.acquire()  # before anything is written: a second run on this directory stops here
        for name in START_LEFTOVERS[1:]:  # a start killed mid-write (the lock is ours now: nobody writes them)
            (self.run_dir / name).unlink(missing_ok=True)
        try:
            self._init(cfg, resume)
        except BaseException:
            self.close()
            if not resume:  # bad input leaves nothing behind in a fresh run directory
                for f in (self.run_dir / "config.yaml", *(self.run_dir / n for n in START_LEFTOVERS)):
                    f.unlink(missing_ok=True)
                if created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                    self.run_dir.rmdir()
            raise

    def _init(self, cfg: TrainConfig, resume: bool) -> None:
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self._threads = cpu_threads(cfg)  # before any engine changes this process's count (vLLM sets 1)
        self.store = RecordStore(self.run_dir)
        self.data: Sequence[Problem] = training_data(cfg)  # a table file stays Arrow columns
        self._rows = PromptRows(self.data)  # what the reward gets for a prompt, for the prompts drawn lately
        self.reward = self._run_reward(cfg, self._reward_arg)
        self._load_validation(cfg)  # each set and its reward (checked now: one line before any model loads)
        # prompt id -> family, when the data names a few; validation sets scored per family too
        self._family, self._val_family = prompt_families(self._rows, self.data, self.val_sets)
        self.provenance = fingerprint(cfg, {"train": self.reward, **self.val_rewards})
        self.steps_per_epoch = len(self.data) // cfg.prompt_batch
        self.total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * self.steps_per_epoch
        self.method = build_method(cfg.method)  # the driver's side of it: exchange, per-step state, filter
        self.sampling = SamplingParams(cfg.n, cfg.temperature, cfg.top_p, 0, cfg.max_new_tokens)
        self.start_step = 1
        # Ray: generations started for the next step as each policy's update finished (see step)
        self._prefetched: dict[tuple[str, int], object] = {}
        self._prefetch_until = 0  # the last step of the current run() call
        ckpt = None
        if resume:
            for stale in clean_stale(self.run_dir):
                print(f"graft train: removed {stale} (left by an interrupted write)")
            ckpt = self._latest_checkpoint(announce=True)
            if ckpt is not None:
                self._check_config(ckpt)
                self._check_provenance(ckpt)  # before anything is rewritten: a refusal changes nothing
            else:  # killed before its first checkpoint: start again from step 1 with the saved config
                print(f"graft train: {self.run_dir} has no checkpoint yet; starting the run from step 1")
                self._restart_from_scratch()
        write_text_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        pcs = [_from_checkpoint(pc, ckpt) if ckpt is not None else pc for pc in cfg.policies]
        self.workers = self._start_workers(cfg, pcs)
        # name -> the in-process Policy, or (Ray) its config: the model lives in the actor
        self.policies = {name: h.policy for name, h in self.workers.items()}
        self.peers = {p.name or p.policy: (RecordStore(p.records), p.policy) for p in cfg.peers}
        self.live = set(self.policies)
        self.names = [p.name for p in cfg.policies] + list(self.peers)
        if ckpt is not None:
            self._restore(ckpt)
        self.trackers = Trackers(cfg.trackers, self.run_dir, to_dict(cfg), cfg.tracking)
        # every prompt fits every policy's context (and max_prompt_tokens): one line now, not a crash mid-run
        # and a response never runs past it: a policy whose context cannot hold the longest prompt plus
        # max_new_tokens samples at most what it leaves, and says so (a learned-position model would crash).
        # Only prompts whose size could reach a limit are tokenised (engine/prompts.py); validation clamps per call
        budgets = check_prompts(self.workers, self.data, list(self.val_sets.values()), cfg.max_new_tokens)
        self.samplings = {}
        for name, (budget, note) in budgets.items():
            if note:
                print(f"graft train: {note}")
            self.samplings[name] = dataclasses.replace(self.sampling, max_new_tokens=budget)
        self.best: dict[str, dict] = self._best_from_log()
        if ckpt is not None:
            self._reconcile_best()  # best/ as the truncated validation log names it

    # ------------------------------------------------------------------ workers
    def _result(self, pending: Pending):
        """Wait for a submitted call (:meth:`Pending.get`)."""
        return pending.get()

    # ------------------------------------------------------------------ one receiver
    def _train_receiver(self, name: str, batch: ReceiverBatch, step: int):
        """Start scoring, weighting and updating one receiver where its model lives: a Ray future
        (the call runs while the driver starts the next receiver's), or in-process the result."""
        seed = derive_seed(self.cfg.seed, Purpose.UPDATE, step, self.names.index(name))
        return self.workers[name].train(batch, step, seed, self.cfg.temperature, self.samplings[name].max_new_tokens)

    def _finish_receiver(self, name: str, batch: ReceiverBatch, step: int, handle) -> dict:
        """Wait for a receiver's update; keep its rows' weights and inclusion on the driver's batch
        (the per-family counts read them) and record what it grafted."""
        upd = self._result(handle)
        for r, w, inc in zip(batch.rows, upd.weights, upd.included, strict=True):
            r.weight, r.include = w, inc
        self.store.write_exchange(step, name, upd.exchange_rows)
        if self.trackers.wants_completions(step):
            rows = completion_rows(
                step, name, batch.rows, upd.weights, upd.exchange_rows, self.cfg.tracking.completions_rows
            )
            self.trackers.add_completions(step, rows)
        stats = upd.stats
        if stats.pop("nonfinite_stop", False):
            raise FloatingPointError(f"step {step}, policy {name!r}: non-finite loss or gradient (nonfinite_loss=stop)")
        return stats

    # ------------------------------------------------------------------ one step
    def receiver_batches(
        self, step: int, groups: dict[str, list[RolloutGroup]], lines: dict[str, dict]
    ) -> dict[str, ReceiverBatch]:
        """A step's exchange phase: the method's per-step state (:meth:`Method.observe`), each
        receiver's batch (selection, composition, advantages; Section 4.1), and the groups'
        statistics in ``lines``. (``graft probe`` runs this.)"""
        self.method.observe(groups)
        batches: dict[str, ReceiverBatch] = {}
        for name in self.policies:
            gen = torch.Generator().manual_seed(
                derive_seed(self.cfg.seed, Purpose.EXCHANGE, step, self.names.index(name))
            )
            own = groups[name]
            batches[name] = self.method.build(name, groups, self.live, self.cfg.n, gen)
            line = lines[name]
            rewards = [r for g in own for r in g.rewards]
            line["reward_mean"] = statistics.fmean(rewards)
            line["all_fail_frac"] = sum(1 for g in own if g.k == 0) / len(own)
            line["all_pass_frac"] = sum(1 for g in own if g.k == g.n) / len(own)
            lengths = [len(ids) for g in own for ids in g.token_ids]
            line["response_len_mean"] = statistics.fmean(lengths)
            line["truncated_frac"] = sum(1 for g in own for f in g.finish_reasons if f == "length") / len(lengths)
        return batches

    def step(self, step: int) -> list[dict]:
        groups, lines = self.rollouts(step)
        for name in self.policies:
            self.store.write(step, groups[name])
        batches = self.receiver_batches(step, groups, lines)
        # every receiver's update is started before any is awaited: under Ray each policy's devices
        # score and train at the same time (in-process they run one after the other)
        pending = {name: self._train_receiver(name, batches[name], step) for name in self.policies}
        if step < self._prefetch_until and any(self.workers[name].concurrent for name in pending):
            # a policy whose update is done starts generating the next step at once (its weights are
            # final for the step), rather than idle until the slower policy's update is done too
            for name in completion_order(pending):
                self._prefetched[(name, step + 1)] = self._start_generation(name, step + 1)
        for name in self.policies:
            lines[name].update(self._finish_receiver(name, batches[name], step, pending[name]))
            if self._family:
                lines[name].update(batches[name].family_stats(self._family, groups[name]))
        return [lines[n] for n in self.policies]

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
        if self.val_sets:
            v = self.cfg.validation
            sizes = ", ".join(f"{ds} {len(ps)}" for ds, ps in self.val_sets.items())
            print(
                textwrap.fill(
                    f"graft train: validation every {v.every} steps: {v.samples} samples per problem at "
                    f"temperature {v.temperature:g} ({sizes} problems); best/ by their mean pass@1",
                    80,
                    subsequent_indent="  ",
                )
            )
        try:
            if self.start_step == 1 and self.cfg.validation.at_start and self.val_sets:
                self.validate(0)
            for step in bar:
                lines = self.step(step)
                self._write_metrics(lines)
                all_lines.extend(lines)
                bar.set_postfix_str(_summary(lines))
                if self.val_sets and (step % self.cfg.validation.every == 0 or step == self.total_steps):
                    self.validate(step)
                if step % self.cfg.checkpoint_every == 0 or step == self.total_steps or stop.signum:
                    self.save_checkpoint(step)
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
                # the newest checkpoint by name: no checksums on the way out (resume verifies them)
                last = max((self.run_dir / "checkpoints").glob("step_*"), default=None)
                print(
                    f"graft train: stopped at once; --resume continues from "
                    f"{'step ' + last.name.split('_')[1].lstrip('0') if last else 'the start'} in {self.run_dir}"
                )
            raise
        finally:
            self._prefetch_until = 0
            self._prefetched.clear()  # a generation started for a step this call does not run: dropped
            stop.restore()
            bar.close()
            self.lock.release()
        return all_lines

    def close(self) -> None:
        """Release the run-directory lock, the trackers, and any Ray actors and placement groups."""
        if hasattr(self, "trackers"):
            self.trackers.finish()
        self.lock.release()
        for handle in self.workers.values():
            handle.close()
        self.workers = {}

    def _write_metrics(self, lines: list[dict]) -> None:
        append_lines(
            self.run_dir / "metrics.jsonl", [json.dumps(finite_json(ln), default=_json_default) for ln in lines]
        )
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
        cfg_path = _saved_config(Path(run_dir))
        try:
            load_config(cfg_path, [f"run_dir={run_dir}"], saved=True)
            source: Path | dict = cfg_path
        except ConfigError as exc:  # torn or edited config.yaml: every checkpoint holds the config it ran with
            source = _config_from_checkpoints(Path(run_dir), cfg_path, exc)
        cfg = load_config(source, [*(overrides or []), f"run_dir={run_dir}"], saved=True)
        return cls(cfg, resume=True, show_progress=show_progress, allow_changed=allow_changed)


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
    return PolicyConfig(
        **{**to_dict(pc), "model": str((ckpt / pc.name).absolute()), "gguf_file": None, "tokenizer": None, **ref}
    )
