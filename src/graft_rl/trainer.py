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

import json
import math
import os
import shutil
import signal
import statistics
import time
from collections import deque
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from graft_rl.config import ConfigError, TrainConfig, load_config, to_dict
from graft_rl.data import Problem, load_dataset, verifier_for
from graft_rl.exchange import ReceiverBatch, build_exchange
from graft_rl.objectives import build_objective
from graft_rl.plan import check_resources
from graft_rl.policy import Policy, PolicyConfig, RolloutGroup, SamplingParams
from graft_rl.rewards import score_responses
from graft_rl.store import RecordStore
from graft_rl.worker import PolicyWorker

__all__ = ["Trainer", "derive_seed"]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix-style), stable across runs and platforms."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x ^= (p + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2)) & 0xFFFFFFFFFFFFFFFF
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return x & 0x7FFFFFFFFFFFFFFF


class Trainer:
    """Co-train the configured policies with the configured method."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, show_progress: bool = True):
        check_resources(cfg)  # one line, before any model or data is touched, if e.g. no GPU is there
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.show_progress = show_progress
        self.store = RecordStore(self.run_dir)
        self.data: list[Problem] = load_dataset(cfg.data.train, cfg.data.limit)
        if len(self.data) < cfg.prompt_batch:
            raise ConfigError(f"data.train {cfg.data.train!r} has {len(self.data)} problems, fewer than prompt_batch={cfg.prompt_batch}")
        self._by_id = {p.id: p for p in self.data}
        self.verifier = cfg.data.verifier if cfg.data.verifier != "auto" else verifier_for(cfg.data.train, self.data[0])
        self.steps_per_epoch = len(self.data) // cfg.prompt_batch
        self.total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * self.steps_per_epoch
        self.exchange = build_exchange(cfg.method)
        self.objective = build_objective(cfg.method)
        self.sampling = SamplingParams(cfg.n, cfg.temperature, cfg.top_p, 0, cfg.max_new_tokens)
        self.start_step = 1
        self._elapsed = {}
        self.success_history: dict[str, deque] = {}
        ckpt = self._latest_checkpoint() if resume else None
        if resume and ckpt is None:
            raise ConfigError(f"{self.run_dir}: no checkpoint to resume from")
        if not resume:
            if (self.run_dir / "metrics.jsonl").exists():
                raise ConfigError(f"run_dir {self.run_dir} already holds a run; use --resume or another run_dir")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        pcs = []
        for pc in cfg.policies:
            if ckpt is not None:
                ref = {"reference_model": pc.reference_model or pc.model,
                       "reference_gguf_file": pc.reference_gguf_file if pc.reference_model else pc.gguf_file}
                pc = PolicyConfig(**{**to_dict(pc), "model": str(ckpt / pc.name), "gguf_file": None, "tokenizer": None, **ref})
            pcs.append(pc)
        # in-process: the Policy objects live here (self.policies); with Ray each lives in its actor
        self.policies: dict[str, Policy] = {}
        self.workers: dict = {}
        if cfg.execution == "ray":
            from graft_rl.distributed import start_actors

            self.workers = start_actors(cfg, pcs)
            self.policies = {pc.name: pc for pc in pcs}  # type: ignore[misc]  # names only: no model here
        else:
            for pc in pcs:
                self.policies[pc.name] = Policy(pc)
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
        self.best: dict[str, dict] = self._best_from_log()

    # ------------------------------------------------------------------ workers
    _elapsed: dict

    def _submit(self, name: str, method: str, *args):
        """Start a call on a policy's worker: a Ray future, or (in-process) the finished result."""
        w = self.workers[name]
        if self.cfg.execution == "ray":
            return getattr(w, method).remote(*args)
        t0 = time.perf_counter()
        out = getattr(w, method)(*args)
        self._elapsed[name] = time.perf_counter() - t0
        return out

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
        )
        it = iter(scores)
        for g in groups:
            g.rewards = [next(it) for _ in range(g.n)]
        return {"verify_timeouts": st.timeout, "verify_errors": st.error + st.crash}

    # ------------------------------------------------------------------ generation
    def _generation_seed(self, name: str, step: int) -> int:
        return derive_seed(self.cfg.seed, 2, step, self.names.index(name))

    def _dynamic_sampling(self, name, prompts, groups, step, vstats) -> tuple[list, list, int]:
        """DAPO: keep non-zero-variance groups; draw more prompts (capped rounds) until the batch is full."""
        keep = [g for g in groups if 0 < g.k < g.n]
        extra_rollouts = 0
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 3, step, self.names.index(name)))
        used = {pid for pid, _ in prompts}
        pool = [p for p in torch.randperm(len(self.data), generator=g).tolist() if self.data[p].id not in used]
        rounds = 0
        while len(keep) < self.cfg.prompt_batch and rounds < self.cfg.method.dynamic_max_rounds and pool:
            rounds += 1
            take, pool = pool[: self.cfg.prompt_batch], pool[self.cfg.prompt_batch :]
            more_prompts = [(self.data[i].id, self.data[i].problem) for i in take]
            seed = derive_seed(self.cfg.seed, 4, step, self.names.index(name), rounds)
            more = self._call(name, "generate", more_prompts, self.sampling, seed)
            extra_rollouts += len(more) * self.cfg.n
            st = self._verify(more)
            for k, v in st.items():
                vstats[k] = vstats.get(k, 0) + v
            keep.extend(gr for gr in more if 0 < gr.k < gr.n)
        keep = keep[: self.cfg.prompt_batch] or groups  # nothing kept: train on the batch as is
        return keep, [(gr.prompt_id, gr.prompt) for gr in keep], extra_rollouts

    # ------------------------------------------------------------------ one receiver
    def _train_receiver(self, name: str, batch: ReceiverBatch, step: int) -> dict:
        """Score, weight and update one receiver (where its model lives); record what it grafted."""
        seed = derive_seed(self.cfg.seed, 5, step, self.names.index(name))
        caps = {n: self._capability(n) for n in self.names}
        stats, weights, exchange_rows = self._call(name, "train", batch, step, seed, caps)
        for r, w in zip(batch.rows, weights, strict=True):
            r.weight = w
        self.store.write_exchange(step, name, exchange_rows)
        if stats.pop("nonfinite_stop", False):
            raise FloatingPointError(f"step {step}, policy {name!r}: non-finite loss or gradient (nonfinite_loss=stop)")
        return stats

    def _capability(self, name: str) -> float:
        h = self.success_history.get(name)
        return max(statistics.fmean(h), 1e-3) if h else 0.5

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> list[dict]:
        prompts = self.prompts_for_step(step)
        groups: dict[str, list[RolloutGroup]] = {}
        lines: dict[str, dict] = {name: {"step": step, "policy": name} for name in self.policies}
        # all policies generate at once (overlapping in time with Ray; one after another in-process)
        t0 = time.perf_counter()
        pending = {
            name: self._submit(name, "generate", prompts, self.sampling, self._generation_seed(name, step))
            for name in self.policies
        }
        for name in self.policies:
            gs = self._result(pending[name])
            rollouts = len(gs) * self.cfg.n
            lines[name]["time_generate"] = self._elapsed.pop(name, time.perf_counter() - t0)
            t0 = time.perf_counter()
            vst = self._verify(gs)
            if self.cfg.method.dynamic_sampling:
                gs, _, extra = self._dynamic_sampling(name, prompts, gs, step, vst)
                rollouts += extra
            lines[name]["time_reward"] = time.perf_counter() - t0
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
        for name in self.policies:
            self.store.write(step, groups[name])
        for name, gs in groups.items():
            self.success_history[name].append(sum(g.k for g in gs) / max(1, sum(g.n for g in gs)))
        if isinstance(getattr(self.exchange, "capability", None), dict):
            self.exchange.capability.update({n: self._capability(n) for n in groups})
        for name in self.policies:
            gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 6, step, self.names.index(name)))
            own = groups[name]
            # GRPO + dynamic sampling trains each policy on its own filtered batch
            view = groups if not self.cfg.method.dynamic_sampling else {name: own}
            batch = self.exchange.build(name, view, self.live, self.cfg.n, gen)
            line = lines[name]
            rewards = [r for g in own for r in g.rewards]
            line["reward_mean"] = statistics.fmean(rewards)
            line["all_fail_frac"] = sum(1 for g in own if g.k == 0) / len(own)
            line["all_pass_frac"] = sum(1 for g in own if g.k == g.n) / len(own)
            lengths = [len(ids) for g in own for ids in g.token_ids]
            line["response_len_mean"] = statistics.fmean(lengths)
            line["truncated_frac"] = sum(1 for g in own for f in g.finish_reasons if f == "length") / len(lengths)
            line.update(self._train_receiver(name, batch, step))
        return [lines[n] for n in self.policies]

    # ------------------------------------------------------------------ validation
    def validate(self, step: int) -> list[dict]:
        """Evaluate every policy on the validation sets; keep each policy's best checkpoint."""
        if not self.val_sets:
            return []
        v = self.cfg.validation
        lines = []
        for name in self.policies:
            line: dict = {"step": step, "policy": name}
            t0 = time.perf_counter()
            scores = []
            for ds, problems in self.val_sets.items():
                res = self._call(
                    name, "evaluate", problems, verifier_for(ds, problems[0]), v.samples, v.temperature, v.top_p,
                    v.max_new_tokens, derive_seed(self.cfg.seed, 7, step, self.names.index(name)), self.cfg.data.verify_timeout,
                )
                line[f"val/{Path(ds).stem}"] = res["pass@1"]
                scores.append(res["pass@1"])
            line["val/score"] = statistics.fmean(scores)
            line["time_validate"] = time.perf_counter() - t0
            best = self.best.get(name)
            if best is None or line["val/score"] > best["score"]:
                self.best[name] = {"step": step, "score": line["val/score"]}
                self._call(name, "save", str(self.run_dir / "best" / name))
                (self.run_dir / "best" / "best.json").write_text(json.dumps(self.best, indent=1))
            line["best_step"] = self.best[name]["step"]
            lines.append(line)
        with (self.run_dir / "validation.jsonl").open("a") as f:
            for line in lines:
                f.write(json.dumps(_finite(line)) + "\n")
        return lines

    def _best_from_log(self) -> dict[str, dict]:
        best: dict[str, dict] = {}
        path = self.run_dir / "validation.jsonl"
        if path.is_file():
            for ln in path.read_text().splitlines():
                if ln.strip():
                    d = json.loads(ln)
                    b = best.get(d["policy"])
                    if b is None or d["val/score"] > b["score"]:
                        best[d["policy"]] = {"step": d["step"], "score": d["val/score"]}
        return best

    # ------------------------------------------------------------------ run
    def run(self, max_steps: int | None = None) -> list[dict]:
        """Train from ``start_step`` to the end (or ``max_steps`` steps, for tests); returns the metric lines."""
        end = self.total_steps if max_steps is None else min(self.total_steps, self.start_step + max_steps - 1)
        all_lines: list[dict] = []
        done = self.start_step - 1
        bar = tqdm(range(self.start_step, end + 1), desc="graft train", unit="step", disable=not self.show_progress,
                   initial=self.start_step - 1, total=self.total_steps)
        prev = signal.getsignal(signal.SIGTERM)
        try:  # SIGTERM (e.g. a scheduler's kill) saves a checkpoint like Ctrl-C
            signal.signal(signal.SIGTERM, _raise_interrupt)
        except ValueError:  # not the main thread
            pass
        try:
            if self.start_step == 1 and self.cfg.validation.at_start and self.val_sets:
                self.validate(0)
            for step in bar:
                lines = self.step(step)
                self._write_metrics(lines)
                all_lines.extend(lines)
                done = step
                bar.set_postfix_str(_summary(lines))
                if self.val_sets and (step % self.cfg.validation.every == 0 or step == self.total_steps):
                    self.validate(step)
                if step % self.cfg.checkpoint_every == 0 or step == self.total_steps:
                    self.save_checkpoint(step)
        except KeyboardInterrupt:
            self.store.truncate_after(done)  # an interrupted step leaves no records
            if done >= self.start_step:
                self.save_checkpoint(done)
            bar.close()
            print(f"graft train: interrupted; checkpoint at step {done} in {self.run_dir} (resume with --resume)")
            raise
        finally:
            try:
                signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
            except ValueError:
                pass
            bar.close()
        return all_lines

    def close(self) -> None:
        """Release Ray actors and placement groups (in-process: nothing to do)."""
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
                f.write(json.dumps(_finite(line), default=_json_default) + "\n")
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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> Path:
        root = self.run_dir / "checkpoints"
        final = root / f"step_{step:06d}"
        tmp = root / f".step_{step:06d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        for name in self.policies:
            self._call(name, "save", str(tmp / name))
        state = {"step": step, "success_history": {k: list(v) for k, v in self.success_history.items()}}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        kept = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in kept[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old)
        return final

    def _latest_checkpoint(self) -> Path | None:
        root = self.run_dir / "checkpoints"
        done = sorted(p for p in root.glob("step_*") if (p / "trainer_state.json").is_file()) if root.is_dir() else []
        return done[-1] if done else None

    def _restore(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        step = int(state["step"])
        for name in self.policies:
            self._call(name, "load_state", str(ckpt / name))
        for k, v in state["success_history"].items():
            if k in self.success_history:
                self.success_history[k].extend(v)
        self.start_step = step + 1
        # drop what the interrupted run wrote after the checkpoint: it is recomputed identically
        for log in (self.run_dir / "metrics.jsonl", self.run_dir / "validation.jsonl"):
            if log.exists():
                kept = [ln for ln in log.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
                tmp = log.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(ln + "\n" for ln in kept))
                os.replace(tmp, log)
        self.store.truncate_after(step)

    @classmethod
    def resume(cls, run_dir: str | Path, show_progress: bool = True) -> Trainer:
        cfg_path = Path(run_dir) / "config.yaml"
        if not cfg_path.is_file():
            raise ConfigError(f"{run_dir}: not a run directory (no config.yaml)")
        cfg = load_config(cfg_path, [f"run_dir={run_dir}"])
        return cls(cfg, resume=True, show_progress=show_progress)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _finite(x):
    """NaN/inf become null, so metrics.jsonl stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


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
        parts.append(f"{ln['policy']}: r={ln['reward_mean']:.2f} in={int(ex)}")
    return " | ".join(parts)
