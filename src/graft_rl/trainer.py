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

from graft_rl import algo
from graft_rl.config import ConfigError, TrainConfig, load_config, to_dict
from graft_rl.data import Problem, load_dataset, verifier_for
from graft_rl.exchange import ReceiverBatch, build_exchange
from graft_rl.objectives import RowTensors, build_objective
from graft_rl.policy import Policy, PolicyConfig, RolloutGroup, SamplingParams, TokenBatch
from graft_rl.rewards import score_responses
from graft_rl.store import RecordStore

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
        self.success_history: dict[str, deque] = {}
        ckpt = self._latest_checkpoint() if resume else None
        if resume and ckpt is None:
            raise ConfigError(f"{self.run_dir}: no checkpoint to resume from")
        if not resume:
            if (self.run_dir / "metrics.jsonl").exists():
                raise ConfigError(f"run_dir {self.run_dir} already holds a run; use --resume or another run_dir")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.policies: dict[str, Policy] = {}
        for pc in cfg.policies:
            if ckpt is not None:
                pc = PolicyConfig(**{**to_dict(pc), "model": str(ckpt / pc.name), "gguf_file": None, "tokenizer": None})
            self.policies[pc.name] = Policy(pc)
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
    def _generate(self, name: str, prompts, step: int) -> tuple[list[RolloutGroup], int]:
        pol = self.policies[name]
        seed = derive_seed(self.cfg.seed, 2, step, self.names.index(name))
        groups = pol.generate(prompts, self.sampling, seed=seed)
        return groups, len(groups) * self.cfg.n

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
            more = self.policies[name].generate(more_prompts, self.sampling, seed=seed)
            extra_rollouts += len(more) * self.cfg.n
            st = self._verify(more)
            for k, v in st.items():
                vstats[k] = vstats.get(k, 0) + v
            keep.extend(gr for gr in more if 0 < gr.k < gr.n)
        keep = keep[: self.cfg.prompt_batch] or groups  # nothing kept: train on the batch as is
        return keep, [(gr.prompt_id, gr.prompt) for gr in keep], extra_rollouts

    # ------------------------------------------------------------------ one receiver
    def _encode(self, pol: Policy, batch: ReceiverBatch) -> TokenBatch:
        prompt_ids, response_ids = [], []
        foreign = [(i, r) for i, r in enumerate(batch.rows) if r.source != pol.name]
        retok = pol.encode_texts([r.prompt for _, r in foreign], [r.text for _, r in foreign], [r.finished for _, r in foreign])
        foreign_idx = {i: j for j, (i, _) in enumerate(foreign)}
        cache: dict[str, list[int]] = {}
        for i, r in enumerate(batch.rows):
            if i in foreign_idx:
                j = foreign_idx[i]
                prompt_ids.append(retok.prompt_ids[j])
                response_ids.append(retok.response_ids[j])
            else:  # own response: the generated ids, no re-tokenisation
                if r.prompt not in cache:
                    cache[r.prompt] = pol.prompt_token_ids(r.prompt, r.prompt_id)
                prompt_ids.append(cache[r.prompt])
                response_ids.append(r.token_ids)
        return TokenBatch(prompt_ids, response_ids)

    def _train_receiver(self, name: str, batch: ReceiverBatch, step: int) -> dict:
        pol = self.policies[name]
        m = self.cfg.method
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 5, step, self.names.index(name)))
        t0 = time.perf_counter()
        tb = self._encode(pol, batch)
        old, mask = pol.token_logprobs(tb)  # pi_old: before the step's first update
        recv_sum = (old * mask).sum(1)
        recv_mean = algo.mean_token_logprob(old, mask)
        score_s = time.perf_counter() - t0
        stats: dict = {}
        # compatibility of peer responses (Section 4.2); per-character variant logged too
        peer_rows = [i for i, r in enumerate(batch.rows) if r.is_peer and not r.is_aux]
        s_tok_all, s_chr_all, weights_all = [], [], []
        compat: dict[int, tuple[float, float]] = {}
        for src in dict.fromkeys(batch.rows[i].source for i in peer_rows):
            rows = [i for i in peer_rows if batch.rows[i].source == src]
            src_mean = torch.tensor([batch.rows[i].src_mean_logprob for i in rows])
            s_tok = algo.compatibility_score(recv_mean[rows], src_mean)
            chars = torch.tensor([max(len(batch.rows[i].text), 1) for i in rows], dtype=torch.float32)
            src_sum = torch.tensor([batch.rows[i].src_logprob_sum for i in rows])
            s_chr = torch.exp((recv_sum[rows] - src_sum) / chars)
            w = self.exchange.weighting(s_tok if m.compatibility == "token_mean" else s_chr, gen)
            for i, wi, st, sc in zip(rows, w.tolist(), s_tok.tolist(), s_chr.tolist(), strict=True):
                batch.rows[i].weight = wi
                compat[i] = (st, sc)
            s_tok_all += s_tok.tolist()
            s_chr_all += s_chr.tolist()
            weights_all += w.tolist()
        kappa = []
        for r in batch.rows:
            if r.is_peer and m.name == "hacpo":
                p_src = self._capability(r.source)
                p_recv = self._capability(name)
                kappa.append(algo.hacpo_capability_ratio(p_src, p_recv))
            else:
                kappa.append(1.0)
        t = RowTensors(
            old,
            mask,
            [r.advantage for r in batch.rows],
            [r.weight for r in batch.rows],
            [r.is_peer for r in batch.rows],
            [r.include for r in batch.rows],
            [r.is_aux for r in batch.rows],
            [r.src_mean_logprob for r in batch.rows],
            kappa,
        )
        self.store.write_exchange(step, name, [
            {"prompt_id": r.prompt_id, "source": r.source, "group_index": r.index, "reward": r.reward,
             "advantage": r.advantage, "weight": r.weight, "compat_token": compat.get(i, (None, None))[0],
             "compat_char": compat.get(i, (None, None))[1], "included": r.include, "auxiliary": r.is_aux}
            for i, r in enumerate(batch.rows) if r.is_peer
        ])
        # peer-last minibatches over the receiver's prompt groups (Section 4.2)
        group_rows = batch.group_rows()
        order = algo.minibatch_order(torch.tensor(batch.group_is_peer), self.cfg.minibatch, m.position, gen)
        t0 = time.perf_counter()
        upd: list[dict] = []
        for mb_groups in order:
            rows = [r for gi in mb_groups.tolist() for r in group_rows[gi]]
            out = pol.update(tb.select(rows), self.objective.minibatch(t, rows, step))
            upd.append(out)
            if out["skipped"] and self.cfg.nonfinite_loss == "stop":
                raise FloatingPointError(f"step {step}, policy {name!r}: non-finite loss or gradient (nonfinite_loss=stop)")
        update_s = time.perf_counter() - t0

        def ssum(key):
            return sum(u.get(key, 0.0) for u in upd)

        stats.update(batch.stats)
        stats["admitted_frac"] = (sum(1 for w in weights_all if w > 0) / len(weights_all)) if weights_all else None
        stats["peer_weight_mean"] = statistics.fmean(weights_all) if weights_all else None
        stats["compat_token_median"] = statistics.median(s_tok_all) if s_tok_all else None
        stats["compat_char_median"] = statistics.median(s_chr_all) if s_chr_all else None
        stats["compat_token"] = [round(x, 5) for x in s_tok_all]
        stats["compat_char"] = [round(x, 5) for x in s_chr_all]
        stats["clip_frac_self"] = ssum("clipped_tokens_self") / max(ssum("tokens_self"), 1.0)
        stats["clip_frac_peer"] = ssum("clipped_tokens_peer") / max(ssum("tokens_peer"), 1.0) if ssum("tokens_peer") else None
        good = [u for u in upd if not u["skipped"]]
        stats["loss"] = statistics.fmean(u["loss"] for u in good) if good else None
        stats["grad_norm"] = statistics.fmean(u["grad_norm"] for u in good) if good else None
        stats["skipped_updates"] = len(upd) - len(good)
        stats["minibatches"] = len(upd)
        stats["time_score"] = score_s
        stats["time_update"] = update_s
        return stats

    def _capability(self, name: str) -> float:
        h = self.success_history.get(name)
        return max(statistics.fmean(h), 1e-3) if h else 0.5

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> list[dict]:
        prompts = self.prompts_for_step(step)
        groups: dict[str, list[RolloutGroup]] = {}
        lines: dict[str, dict] = {name: {"step": step, "policy": name} for name in self.policies}
        for name in self.policies:
            t0 = time.perf_counter()
            gs, rollouts = self._generate(name, prompts, step)
            lines[name]["time_generate"] = time.perf_counter() - t0
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
        from graft_rl.evaluation import evaluate_policy

        v = self.cfg.validation
        lines = []
        for name, pol in self.policies.items():
            line: dict = {"step": step, "policy": name}
            t0 = time.perf_counter()
            scores = []
            for ds, problems in self.val_sets.items():
                res = evaluate_policy(
                    pol, problems, verifier_for(ds, problems[0]), v.samples, v.temperature, v.top_p, v.max_new_tokens,
                    seed=derive_seed(self.cfg.seed, 7, step, self.names.index(name)), timeout=self.cfg.data.verify_timeout,
                )
                line[f"val/{Path(ds).stem}"] = res["pass@1"]
                scores.append(res["pass@1"])
            line["val/score"] = statistics.fmean(scores)
            line["time_validate"] = time.perf_counter() - t0
            best = self.best.get(name)
            if best is None or line["val/score"] > best["score"]:
                self.best[name] = {"step": step, "score": line["val/score"]}
                pol.save(self.run_dir / "best" / name)
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
        for name, pol in self.policies.items():
            pol.save(tmp / name)
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
        for name, pol in self.policies.items():
            pol.load_state(ckpt / name)
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
