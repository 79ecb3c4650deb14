"""The step loop for N policies (SPEC §4 layer 5): generate, verify, exchange, score, update.

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

import dataclasses

import json
import math
import signal
import statistics
import textwrap
import time
from collections import deque
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from graft_rl.config import ConfigError, TrainConfig, load_config, to_dict
from graft_rl.data import Problem, check_answers, load_dataset, verifier_for
from graft_rl.evaluation import families
from graft_rl.exchange import CAPABILITY_FLOOR, ReceiverBatch, build_exchange
from graft_rl.objectives import build_objective
from graft_rl.plan import check_resources
from graft_rl.checkpointing import CheckpointError, Checkpointing
from graft_rl.policy import Policy, PolicyConfig, RolloutGroup, SamplingParams
from graft_rl.rewards import score_responses
from graft_rl.rundir import RunLock, clean_stale, finite_json, write_text_atomic
from graft_rl.seeding import derive_seed
from graft_rl.store import RecordStore
from graft_rl.validation import Validation
from graft_rl.worker import PolicyWorker

__all__ = ["Trainer", "RunInterrupted", "CheckpointError", "DynamicSamplingError", "derive_seed"]


class Trainer(Checkpointing, Validation):
    """Co-train the configured policies with the configured method."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, show_progress: bool = True):
        check_resources(cfg)  # one line, before any model or data is touched, if e.g. no GPU is there
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.show_progress = show_progress
        self.workers: dict = {}
        self.lock = RunLock(self.run_dir)
        if not resume:
            _check_fresh_run_dir(self.run_dir)
        created = not self.run_dir.exists()
        self.lock.acquire()  # before anything is written: a second run on this directory stops here
        try:
            self._init(cfg, resume)
        except BaseException:
            self.close()
            if not resume:  # bad input leaves nothing behind in a fresh run directory
                for f in (self.run_dir / "config.yaml", self.run_dir / ".lock"):
                    f.unlink(missing_ok=True)
                if created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                    self.run_dir.rmdir()
            raise

    def _init(self, cfg: TrainConfig, resume: bool) -> None:
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.store = RecordStore(self.run_dir)
        self.data: list[Problem] = load_dataset(cfg.data.train, cfg.data.limit)
        if len(self.data) < cfg.prompt_batch:
            raise ConfigError(f"data.train {cfg.data.train!r} has {len(self.data)} problems, fewer than prompt_batch={cfg.prompt_batch}")
        self._by_id = {p.id: p for p in self.data}
        self._family = families(self.data)  # prompt id -> family, when the data names a few (testbed kinds)
        self.verifier = cfg.data.verifier if cfg.data.verifier != "auto" else verifier_for(cfg.data.train, self.data[0])
        check_answers(self.data, self.verifier, cfg.data.train)  # a reference no response could match: one line
        self.steps_per_epoch = len(self.data) // cfg.prompt_batch
        self.total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * self.steps_per_epoch
        self.exchange = build_exchange(cfg.method)
        self.objective = build_objective(cfg.method)
        self.sampling = SamplingParams(cfg.n, cfg.temperature, cfg.top_p, 0, cfg.max_new_tokens)
        self.start_step = 1
        # Ray: generations started for the next step as each policy's update finished (see step)
        self._prefetched: dict[tuple[str, int], object] = {}
        self._prefetch_until = 0  # the last step of the current run() call
        self.success_history: dict[str, deque] = {}
        ckpt = None
        if resume:
            for stale in clean_stale(self.run_dir):
                print(f"graft train: removed {stale} (left by an interrupted write)")
            ckpt = self._latest_checkpoint(announce=True)
            if ckpt is not None:
                self._check_config(ckpt)
            else:  # killed before its first checkpoint: start again from step 1 with the saved config
                print(f"graft train: {self.run_dir} has no checkpoint yet; starting the run from step 1")
                self._restart_from_scratch()
        write_text_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        pcs = []
        for pc in cfg.policies:
            if ckpt is not None:
                ref = {"reference_model": pc.reference_model or pc.model,
                       "reference_gguf_file": pc.reference_gguf_file if pc.reference_model else pc.gguf_file}
                pc = PolicyConfig(**{**to_dict(pc), "model": str(ckpt / pc.name), "gguf_file": None, "tokenizer": None, **ref})
            pcs.append(pc)
        # in-process: the Policy objects live here (self.policies); with Ray each lives in its actor
        self.policies: dict[str, Policy] = {}
        if cfg.execution == "ray":
            from graft_rl.distributed import start_actors

            self.workers = start_actors(cfg, pcs)
            self.policies = {pc.name: pc for pc in pcs}  # type: ignore[misc]  # names only: no model here
        else:
            for pc in pcs:
                self.policies[pc.name] = Policy(pc, with_reference=cfg.method.kl_coef > 0)
                self.workers[pc.name] = PolicyWorker(
                    self.policies[pc.name], cfg.method, cfg.minibatch, cfg.nonfinite_loss, self.objective, self.exchange.weighting
                )
        self.peers = {p.name or p.policy: (RecordStore(p.records), p.policy) for p in cfg.peers}
        self.live = set(self.policies)
        self.names = [p.name for p in cfg.policies] + list(self.peers)
        for name in self.names:
            self.success_history[name] = deque(maxlen=cfg.method.hacpo_capability_window)
        if ckpt is not None:
            self._restore(ckpt)
        self._tb = self._tensorboard() if cfg.tensorboard else None
        self.val_sets = {name: load_dataset(name, cfg.validation.limit) for name in cfg.validation.data}
        for name, problems in self.val_sets.items():
            check_answers(problems, verifier_for(name, problems[0]), name)
        # every prompt fits every policy's context (and max_prompt_tokens): one line now, not a crash mid-run
        # and a response never runs past it: a policy whose context cannot hold the longest prompt plus
        # max_new_tokens samples at most what it leaves, and says so (a learned-position model would crash)
        every = self.data + [p for ps in self.val_sets.values() for p in ps]
        for handle in [self._submit(name, "prompt_budget", every, 1) for name in self.policies]:
            self._result(handle)
        # the training responses' budget from the training prompts (validation clamps its own per call)
        budgets = {name: self._submit(name, "prompt_budget", self.data, cfg.max_new_tokens) for name in self.policies}
        self.samplings = {}
        for name, handle in budgets.items():
            budget, note = self._result(handle)
            if note:
                print(f"graft train: {note}")
            self.samplings[name] = dataclasses.replace(self.sampling, max_new_tokens=budget)
        self._val_family = {name: bool(families(ps)) for name, ps in self.val_sets.items()}  # scored per family too
        if not self._family:  # a pool of one family that validation scores among others (the lookup pair)
            val_fams = {p.subject for name, ps in self.val_sets.items() if self._val_family[name] for p in ps}
            if len({p.subject for p in self.data}) == 1 and self.data[0].subject in val_fams:
                self._family = {p.id: p.subject for p in self.data}
        self.best: dict[str, dict] = self._best_from_log()
        if ckpt is not None:
            self._reconcile_best()  # best/ as the truncated validation log names it

    # ------------------------------------------------------------------ workers
    def _submit(self, name: str, method: str, *args):
        """Start a call on a policy's worker: a Ray future, or (in-process) the finished result."""
        w = self.workers[name]
        if self.cfg.execution == "ray":
            return getattr(w, method).remote(*args)
        return getattr(w, method)(*args)

    def _result(self, handle):
        if self.cfg.execution == "ray":
            from graft_rl.distributed import get

            return get(handle)
        return handle

    def _call(self, name: str, method: str, *args):
        return self._result(self._submit(name, method, *args))

    # ------------------------------------------------------------------ data order
    def prompts_for_step(self, step: int) -> list[tuple[str, str]]:
        """The prompt batch of a step: epoch-wise shuffles seeded by (seed, epoch)."""
        epoch, pos = divmod(step - 1, self.steps_per_epoch)
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 1, epoch))
        perm = torch.randperm(len(self.data), generator=g)
        idx = perm[pos * self.cfg.prompt_batch : (pos + 1) * self.cfg.prompt_batch].tolist()
        return [(self.data[i].id, self.data[i].problem) for i in idx]

    # ------------------------------------------------------------------ rewards
    def _verify(self, groups: list[RolloutGroup]) -> dict:
        rows = [(g, i) for g in groups for i in range(g.n)]
        probs = [self._by_id[g.prompt_id] for g, _ in rows]
        scores, st = score_responses(
            [g.texts[i] for g, i in rows],
            [p.answer for p in probs],
            self.verifier,
            [p.source for p in probs],
            [p.id for p in probs],
            self.cfg.data.verify_timeout,
            self.cfg.data.verify_budget,
        )
        it = iter(scores)
        for g in groups:
            g.rewards = [next(it) for _ in range(g.n)]
        return {"verify_timeouts": st.timeout, "verify_errors": st.error + st.crash, "verify_over_budget": st.budget}

    # ------------------------------------------------------------------ generation
    def _generation_seed(self, name: str, step: int) -> int:
        return derive_seed(self.cfg.seed, 2, step, self.names.index(name))

    def _start_generation(self, name: str, step: int):
        return self._submit(name, "generate_timed", self.prompts_for_step(step), self.samplings[name],
                            self._generation_seed(name, step))

    def _dynamic_sampling(self, name, prompts, groups, step, vstats, times) -> tuple[list, list, int, int]:
        """DAPO's dynamic sampling (``recipe/dapo``, ``filter_groups``): keep the groups with mixed
        rewards; while fewer than ``prompt_batch`` are kept, generate another batch of prompts, up to
        ``method.max_num_gen_batches`` batches in the step (the first included; <= 0: no limit), past
        which the run stops with :class:`DynamicSamplingError`. Fresh prompts come from the training
        data not yet drawn in this step (then, reshuffled, from those not kept). ``times`` accumulates the
        extra batches' ``time_generate`` (measured in the worker) and ``time_reward``.
        Returns ``(kept groups, their prompts, extra rollouts, generation batches)``."""
        keep = [g for g in groups if 0 < g.k < g.n]
        extra_rollouts = 0
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 3, step, self.names.index(name)))
        used = {pid for pid, _ in prompts}
        pool = [p for p in torch.randperm(len(self.data), generator=g).tolist() if self.data[p].id not in used]
        cap = self.cfg.method.max_num_gen_batches
        batches = 1
        while len(keep) < self.cfg.prompt_batch:
            if 0 < cap <= batches:
                raise DynamicSamplingError(
                    f"step {step}: policy {name!r} has {len(keep)} of {self.cfg.prompt_batch} prompts with mixed rewards after "
                    f"{batches} generation batches (method.max_num_gen_batches={cap}); the data may be too hard (or easy) "
                    f"for it. Set method.max_num_gen_batches=0 for no limit, and resume with --resume")
            if not pool:  # every prompt drawn once in this step: another pass over those not kept (a prompt
                # is in a step's batch once), as DAPO's next epoch would
                kept = {gr.prompt_id for gr in keep}
                pool = [p for p in torch.randperm(len(self.data), generator=g).tolist() if self.data[p].id not in kept]
                if not pool:
                    raise DynamicSamplingError(
                        f"step {step}: policy {name!r} has {len(keep)} of {self.cfg.prompt_batch} prompts with mixed rewards, "
                        f"and every other prompt of data.train was drawn; prompt_batch is larger than what the data can fill")
            batches += 1
            take, pool = pool[: self.cfg.prompt_batch], pool[self.cfg.prompt_batch :]
            more_prompts = [(self.data[i].id, self.data[i].problem) for i in take]
            seed = derive_seed(self.cfg.seed, 4, step, self.names.index(name), batches - 1)
            more, gen_s = self._call(name, "generate_timed", more_prompts, self.samplings[name], seed)
            times["time_generate"] += gen_s
            extra_rollouts += len(more) * self.cfg.n
            t0 = time.perf_counter()
            st = self._verify(more)
            times["time_reward"] += time.perf_counter() - t0
            for k, v in st.items():
                vstats[k] = vstats.get(k, 0) + v
            keep.extend(gr for gr in more if 0 < gr.k < gr.n)
        keep = keep[: self.cfg.prompt_batch]
        return keep, [(gr.prompt_id, gr.prompt) for gr in keep], extra_rollouts, batches

    # ------------------------------------------------------------------ one receiver
    def _train_receiver(self, name: str, batch: ReceiverBatch, step: int):
        """Start scoring, weighting and updating one receiver where its model lives: a Ray future
        (the call runs while the driver starts the next receiver's), or in-process the result."""
        seed = derive_seed(self.cfg.seed, 5, step, self.names.index(name))
        caps = {n: self._capability(n) for n in self.names}
        return self._submit(name, "train", batch, step, seed, caps, self.cfg.temperature, self.samplings[name].max_new_tokens)

    def _finish_receiver(self, name: str, batch: ReceiverBatch, step: int, handle) -> dict:
        """Wait for a receiver's update; record its peer rows' weights and what it grafted."""
        stats, weights, exchange_rows = self._result(handle)
        for r, w in zip(batch.rows, weights, strict=True):
            r.weight = w
        self.store.write_exchange(step, name, exchange_rows)
        if stats.pop("nonfinite_stop", False):
            raise FloatingPointError(f"step {step}, policy {name!r}: non-finite loss or gradient (nonfinite_loss=stop)")
        return stats

    def _capability(self, name: str) -> float:
        h = self.success_history.get(name)
        return max(statistics.fmean(h), CAPABILITY_FLOOR) if h else 0.5

    # ------------------------------------------------------------------ one step
    def rollouts(self, step: int) -> tuple[dict[str, list[RolloutGroup]], dict[str, dict]]:
        """A step's rollout phase: every policy's verified groups (dynamic sampling applied), stored
        peers' replayed groups, and each policy's metric line so far. (``graft probe`` runs this.)"""
        prompts = self.prompts_for_step(step)
        groups: dict[str, list[RolloutGroup]] = {}
        lines: dict[str, dict] = {name: {"step": step, "policy": name} for name in self.policies}
        # all policies generate at once (overlapping in time with Ray; one after another in-process);
        # time_generate is measured in the worker, where the generation runs (Table 5's compute).
        # Under Ray a policy's generation may have started already, when its last update finished
        pending = {name: self._prefetched.pop((name, step)) if (name, step) in self._prefetched
                   else self._start_generation(name, step) for name in self.policies}
        for name in self.policies:
            gs, gen_s = self._result(pending[name])
            rollouts = len(gs) * self.cfg.n
            t0 = time.perf_counter()
            vst = self._verify(gs)
            times = {"time_generate": gen_s, "time_reward": time.perf_counter() - t0}
            if self.cfg.method.dynamic_sampling:
                gs, _, extra, lines[name]["gen_batches"] = self._dynamic_sampling(name, prompts, gs, step, vst, times)
                rollouts += extra
            lines[name].update(times)
            lines[name].update(vst)
            lines[name]["rollouts"] = rollouts
            groups[name] = gs
        for name, (store, peer_policy) in self.peers.items():
            replayed = store.replay(peer_policy, step, prompts)
            groups[name] = [
                RolloutGroup(g.prompt_id, g.prompt, name, g.texts, g.token_ids, g.gen_logprobs, g.finish_reasons)
                for g in replayed
            ]
            self._verify(groups[name])  # rewards are re-verified, not trusted from the records
        return groups, lines

    def receiver_batches(self, step: int, groups: dict[str, list[RolloutGroup]], lines: dict[str, dict]) -> dict[str, ReceiverBatch]:
        """A step's exchange phase: capabilities, each receiver's batch (selection, composition,
        advantages; Section 4.1), and the groups' statistics in ``lines``. (``graft probe`` runs this.)"""
        for name, gs in groups.items():
            # HACPO's capability: the step's success rate, floored (its recipe's CapabilityTracker)
            self.success_history[name].append(max(sum(g.k for g in gs) / max(1, sum(g.n for g in gs)), CAPABILITY_FLOOR))
        if isinstance(getattr(self.exchange, "capability", None), dict):
            self.exchange.capability.update({n: self._capability(n) for n in groups})
        batches: dict[str, ReceiverBatch] = {}
        for name in self.policies:
            gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 6, step, self.names.index(name)))
            own = groups[name]
            # GRPO + dynamic sampling trains each policy on its own filtered batch
            view = groups if not self.cfg.method.dynamic_sampling else {name: own}
            batches[name] = self.exchange.build(name, view, self.live, self.cfg.n, gen)
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
        if self.cfg.execution == "ray" and step < self._prefetch_until:
            from graft_rl.distributed import completion_order

            # a policy whose update is done starts generating the next step at once (its weights are
            # final for the step), rather than idle until the slower policy's update is done too
            for name in completion_order(pending):
                self._prefetched[(name, step + 1)] = self._start_generation(name, step + 1)
        for name in self.policies:
            lines[name].update(self._finish_receiver(name, batches[name], step, pending[name]))
            if self._family:
                lines[name].update(self._family_stats(groups[name], batches[name]))
        return [lines[n] for n in self.policies]

    def _family_stats(self, own: list[RolloutGroup], batch: ReceiverBatch) -> dict:
        """Per prompt family (``subject``): own groups, own all-fail groups, prompts with peer data
        (grafted groups; SGT's auxiliary response), and grafted peer responses with those the gate
        admitted (weight > 0): counts, pooled by the report."""
        out: dict[str, float] = {}

        def add(key: str, fam: str, v: float = 1.0) -> None:
            out[f"{key}/{fam}"] = out.get(f"{key}/{fam}", 0.0) + v

        for g in own:
            fam = self._family[g.prompt_id]
            add("groups", fam)
            add("all_fail", fam, float(g.k == 0))
        for rows in batch.group_rows():
            if not any(batch.rows[i].is_peer for i in rows):  # no peer data for this prompt
                continue
            fam = self._family[batch.rows[rows[0]].prompt_id]
            add("grafted", fam)  # a grafted group, or SGT's auxiliary peer response
            peer = [batch.rows[i] for i in rows if batch.rows[i].is_peer and not batch.rows[i].is_aux]
            add("grafted_rows", fam, len(peer))
            add("admitted_rows", fam, sum(1 for r in peer if r.weight > 0))
        return out

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
        bar = tqdm(range(self.start_step, end + 1), desc="graft train", unit="step", disable=not self.show_progress,
                   initial=self.start_step - 1, total=self.total_steps)
        stop = _GracefulStop()
        self._prefetch_until = end
        if self.val_sets:
            v = self.cfg.validation
            sizes = ", ".join(f"{Path(ds).stem} {len(ps)}" for ds, ps in self.val_sets.items())
            print(textwrap.fill(f"graft train: validation every {v.every} steps: {v.samples} samples per problem at "
                                f"temperature {v.temperature:g} ({sizes} problems); best/ by their mean pass@1",
                                80, subsequent_indent="  "))
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
                    print(f"graft train: stopped after step {step} ({signal.Signals(stop.signum).name}); "
                          f"checkpoint in {self.run_dir} (resume with --resume)")
                    raise RunInterrupted(stop.signum)
        except KeyboardInterrupt as exc:
            if not isinstance(exc, RunInterrupted):
                bar.close()
                # the newest checkpoint by name: no checksums on the way out (resume verifies them)
                last = max((self.run_dir / "checkpoints").glob("step_*"), default=None)
                print(f"graft train: stopped at once; --resume continues from "
                      f"{'step ' + last.name.split('_')[1].lstrip('0') if last else 'the start'} in {self.run_dir}")
            raise
        finally:
            self._prefetch_until = 0
            self._prefetched.clear()  # a generation started for a step this call does not run: dropped
            stop.restore()
            bar.close()
            self.lock.release()
        return all_lines

    def close(self) -> None:
        """Release the run-directory lock and any Ray actors and placement groups."""
        self.lock.release()
        if self.cfg.execution != "ray":
            return
        import ray

        from graft_rl.distributed import ActorGroup

        for w in self.workers.values():
            if isinstance(w, ActorGroup):
                w.shutdown()
            else:
                ray.kill(w)
        self.workers = {}

    def _write_metrics(self, lines: list[dict]) -> None:
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            for line in lines:
                f.write(json.dumps(finite_json(line), default=_json_default) + "\n")
        if self._tb is not None:
            for line in lines:
                for k, v in line.items():
                    if isinstance(v, (int, float)) and k not in ("step",) and v is not None:
                        self._tb.add_scalar(f"{line['policy']}/{k}", v, line["step"])

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("graft train: tensorboard is not installed; metrics go to metrics.jsonl only")
            return None
        return SummaryWriter(self.run_dir / "tensorboard")

    @classmethod
    def resume(cls, run_dir: str | Path, show_progress: bool = True, overrides: list[str] | None = None) -> Trainer:
        """Continue a run; ``overrides`` may change only :data:`~graft_rl.rundir.HARMLESS_KEYS` (e.g. ``steps=200``)."""
        cfg_path = Path(run_dir) / "config.yaml"
        if not cfg_path.is_file():
            raise ConfigError(f"{run_dir}: not a run directory (no config.yaml)")
        try:
            load_config(cfg_path, [f"run_dir={run_dir}"], saved=True)
            source: Path | dict = cfg_path
        except ConfigError as exc:  # torn or edited config.yaml: every checkpoint holds the config it ran with
            source = _config_from_checkpoints(Path(run_dir), cfg_path, exc)
        cfg = load_config(source, [*(overrides or []), f"run_dir={run_dir}"], saved=True)
        return cls(cfg, resume=True, show_progress=show_progress)


def _config_from_checkpoints(run_dir: Path, cfg_path: Path, exc: Exception) -> dict:
    """The config saved in the newest checkpoint's ``trainer_state.json``, when ``config.yaml`` is damaged."""
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*"), reverse=True):
        try:
            saved = json.loads((ckpt / "trainer_state.json").read_text()).get("config")
        except (OSError, ValueError):
            continue
        if saved:
            print(f"graft train: {cfg_path} is damaged ({exc}); resuming with the config saved in checkpoint {ckpt.name}")
            return saved
    raise ConfigError(f"{cfg_path} is damaged ({exc}) and no checkpoint holds a copy of the config") from None


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling found too few prompts with mixed rewards within ``method.max_num_gen_batches``."""


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
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals keep their handlers
                pass

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\ngraft train: {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              f"(send it again to stop at once)", flush=True)

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self.previous = {}


def _check_fresh_run_dir(run_dir: Path) -> None:
    """A fresh run needs an absent or empty run directory (or one left by an immediately failed start)."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"run_dir {run_dir} exists and is not a directory")
    held = sorted(p.name for p in run_dir.iterdir() if p.name != ".lock")
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
