"""A policy's optimisation, weight sync and checkpoints (:class:`PolicyTraining`, a part of
:class:`~graft_rl.policy.policy.Policy`): minibatch optimiser steps with gradient accumulation over
micro-batches, skipping non-finite updates; the once-per-step push of weights to the rollout
engine; ``save_pretrained`` checkpoints with optimiser and RNG state."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from graft_rl.policy.lag import LAG_FILE
from graft_rl.policy.types import PolicyError, SamplingParams, TokenBatch
from graft_rl.stats import StepStats

__all__ = ["POLICY_SETTINGS", "OptimiserStep", "PolicyTraining", "StateFileError", "load_state_file"]

#: File in every saved policy directory holding the policy's settings (prompt format etc.).
POLICY_SETTINGS = "graft_policy.json"


class StateFileError(PolicyError):
    """A ``policy_state*.pt`` that holds anything but tensors and plain values (it could run code)."""


def load_state_file(path: str | Path) -> dict:
    """A checkpoint's optimiser and RNG state, read with ``weights_only=True``: tensors, numbers,
    strings and containers only. A pickle that names anything else (a function, a class to build) is
    refused in one line and nothing of it runs (docs/reliability.md, "Security")."""
    import pickle

    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateFileError(
            f"{path}: refused, it holds more than tensors and plain values and loading it could run code "
            f"({first[:160]}); a checkpoint graft-rl wrote never does: resume from one you trust"
        ) from None
    if not isinstance(state, dict):
        raise StateFileError(f"{path}: expected a dict of optimiser and RNG state, got {type(state).__name__}")
    return state


class OptimiserStep:
    """One optimiser step of a policy, accumulated over its forward passes (micro-batches).

    :meth:`backward` takes each pass's loss contribution; a padding pass (``None``: a sharded rank with
    no row in this pass) or a non-finite loss still runs a zero backward, since a sharded policy's
    collectives need every rank in every pass, and a non-finite loss marks the whole step for skipping.
    :meth:`finish` reduces over the ranks, clips the gradient norm and steps the optimiser, or skips:
    the weights stay untouched where any rank's loss or the gradient norm is not finite (SPEC §6).
    Used as a context manager: the model is in train mode (layer checkpointing) only inside it.
    """

    def __init__(self, policy: PolicyTraining):
        self.policy = policy
        self.loss = 0.0  # the step's loss: the sum of its passes' contributions (this rank's)
        self.passes = 0
        self.bad = False

    def __enter__(self) -> OptimiserStep:
        pol = self.policy
        pol.optimizer.zero_grad(set_to_none=True)
        if pol.config.gradient_checkpointing:
            pol.model.train()  # transformers checkpoints layers only in train mode (dropout is off)
        return self

    def __exit__(self, *exc) -> None:
        self.policy.model.eval()

    def backward(self, loss: torch.Tensor | None, lp: torch.Tensor) -> bool:
        """Backward of one pass's contribution (times the policy's ``loss_scale``); whether it counts: False
        for a padding pass, a non-finite loss, or any pass after one (each runs a zero backward)."""
        if loss is None or self.bad or not torch.isfinite(loss):
            self.bad = self.bad or loss is not None
            (lp.sum() * 0.0).backward()
            return False
        (loss * self.policy.loss_scale).backward()
        self.loss += float(loss.detach())
        self.passes += 1
        return True

    def finish(self) -> tuple[float, float, bool]:
        """``(loss, grad norm, skipped)``: the step's loss summed over ranks (NaN when skipped)."""
        pol = self.policy
        loss, _, bad = pol._reduce_sums([self.loss, float(self.passes), float(self.bad)])
        pol.model.eval()
        grad_norm = pol._clip_grad_norm()
        if bad > 0 or not math.isfinite(grad_norm):
            pol.optimizer.zero_grad(set_to_none=True)
            return float("nan"), grad_norm, True
        pol.optimizer.step()
        pol.optimizer.zero_grad(set_to_none=True)
        pol.weights_version += 1
        return loss, grad_norm, False


class PolicyTraining:
    """Mixed into :class:`~graft_rl.policy.policy.Policy`, whose model, optimizer, config, backend,
    ``passes``/``_forward``/``_reduce_sums`` and generation/scoring it uses."""

    lora: Any = None  # a LoRA policy's peft model around `model` (policy.lora)
    base: dict | None = None  # a LoRA policy's frozen base: {model, gguf_file, digest}
    lag: Any = None  # the pushed weights a lagged rollout samples from (policy.lag.RolloutLag), rollout.lag > 0

    # ------------------------------------------------------------------ optimisation
    def optimiser_step(self) -> OptimiserStep:
        """One optimiser step accumulated over forward passes: ``with policy.optimiser_step() as opt:``,
        ``opt.backward(loss, lp)`` per pass, then ``opt.finish()`` (:class:`OptimiserStep`). The receiver's
        update (:func:`graft_rl.engine.update.receiver_update`) and :meth:`update` are written with it."""
        return OptimiserStep(self)

    def update(
        self,
        batch: TokenBatch,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, list[int]], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """One optimiser step on ``batch`` with a plain loss function (scripts, benchmarks, tests).

        ``loss_fn(logprobs [m, T_m], mask [m, T_m], rows)`` (``rows``: positions in ``batch``) returns this
        pass's *contribution* to the batch loss (a token-mean loss scaled by ``pass tokens / batch
        tokens``) and a stats dict whose ``X_total`` entries are summed over passes and ranks and ``X_peak``
        entries maxed (:meth:`graft_rl.stats.StepStats.from_loss_stats`; nothing else is kept). Returns
        ``loss``, ``grad_norm``, ``skipped`` (1.0: a non-finite loss or gradient norm left the weights
        untouched) and those sums and maxima under their names. A receiver's step does not come here.
        """
        with self.optimiser_step() as opt:
            stats = self._backward_passes(opt, batch, loss_fn)
            loss, grad_norm, skipped = opt.finish()
        stats = self.reduce_stats(stats)
        return {
            **{f"{k}_total": v for k, v in stats.sums.items()},
            **{f"{k}_peak": v for k, v in stats.peaks.items()},
            "loss": loss,
            "grad_norm": grad_norm,
            "skipped": float(skipped),
        }

    def accumulate(self, batch: TokenBatch, loss_fn) -> StepStats:
        """Forward and backward of every pass of ``batch`` under ``loss_fn`` as :meth:`update` runs them, without
        the optimiser step: the gradients stay in the parameters' ``.grad`` (memory and gradient checks)."""
        with self.optimiser_step() as opt:
            return self._backward_passes(opt, batch, loss_fn)

    def _backward_passes(self, opt: OptimiserStep, batch: TokenBatch, loss_fn) -> StepStats:
        stats = StepStats()
        for rows in self.passes(batch):
            sub = batch.select(rows or [0])
            lp = self._forward(sub)
            if rows is None:  # a sharded policy's padding pass
                opt.backward(None, lp)
                continue
            loss, st = loss_fn(lp, sub.response_mask().to(lp.device), rows)
            if opt.backward(loss, lp):
                stats.merge(StepStats.from_loss_stats(st))
        return stats

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)) if params else 0.0

    def sync_rollout_weights(self, target=None) -> None:
        """Push the current weights to the rollout engine, once per step and only if they changed (or
        the engine discarded its copy in a level-2 sleep: :attr:`VLLMBackend.needs_push`). ``target``:
        what the live parameters hold when it is not ``weights_version`` (a lagged snapshot's tag)."""
        target = self.weights_version if target is None else target
        if self._synced_version != target or getattr(self.backend, "needs_push", False):
            self.backend.sync_weights()
            self._synced_version = target

    @contextlib.contextmanager
    def sampling_weights(self, lag: int | None = None):
        """Within the block the rollout engine holds the weights a generation samples from: the current
        ones, or for a training generation under ``rollout.lag`` (``lag > 0``) those of ``lag`` pushes
        earlier, swapped into the live parameters for the block (:mod:`graft_rl.policy.lag`). ``lag=0``: a
        training generation of a run without lag, which keeps no history (one a checkpoint at ``lag > 0``
        brought is dropped: never sampled from nor saved again); None: any other generation (validation,
        eval), which leaves the history as it is."""
        from graft_rl.policy.lag import RolloutLag

        if lag == 0:
            self.lag = None
        if lag is not None and lag > 0 and (self.lag is None or self.lag.k != lag):
            self.lag = RolloutLag(lag) if self.lag is None else self.lag.resized(lag)
        if lag is None or lag <= 0:
            self.sync_rollout_weights()
            yield
            return
        assert self.lag is not None
        params = self._lag_params()
        self.lag.observe(params, self.weights_version)
        index = self.lag.chosen()
        if index is None:
            self.sync_rollout_weights()
            yield
            return
        with self.lag.swapped(params, index) as tag:
            self.sync_rollout_weights(tag)
            yield

    def _push_lag(self):
        """The one-step-off history (``rollout.mode: one_step_off``): a :class:`RolloutLag` of ``k = 1`` that has
        observed the live weights, as a ``rollout.lag: 1`` generation would at this point."""
        from graft_rl.policy.lag import RolloutLag

        if self.lag is None or self.lag.k != 1:
            self.lag = RolloutLag(1) if self.lag is None else self.lag.resized(1)
        self.lag.observe(self._lag_params(), self.weights_version)
        return self.lag

    def lag_choice(self) -> int | None:
        """The weights_version a ``rollout.lag: 1`` generation would sample now (one push back; the live
        weights on a run's first push). A one-step-off step compares it with its batch in flight."""
        return self._push_lag().chosen_version()

    @contextlib.contextmanager
    def generator_weights(self, chosen: bool):
        """Within the block the live parameters hold what a push to the generators sends, and it yields their
        weights_version: the live weights (the push of step t+1, made before step t's update), or with
        ``chosen`` the lag-1 choice (:meth:`lag_choice`: a step whose batch must be sampled again). An FSDP2
        policy: every rank calls (its shards are swapped)."""
        lag = self._push_lag()
        index = lag.chosen() if chosen else None
        if index is None:
            yield self.weights_version
            return
        with lag.swapped(self._lag_params(), index):
            yield lag.versions[index]

    def _lag_params(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors a lagged snapshot holds and is swapped into: the trainable parameters (an FSDP2
        rank's shards: resharded first, as a forward without backward leaves the root unsharded)."""
        from graft_rl.policy.lag import trainable

        if callable(getattr(self.model, "reshard", None)):
            self.model.reshard()
        return trainable(self.model)

    def close(self) -> None:
        """Shut the rollout engine down (a vLLM engine frees its GPU memory; another may then start in
        this process). The model stays usable for scoring; generation is over."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    def push_digest(self, dtypes: dict | None) -> dict[str, torch.Tensor]:
        """The reference a weight push is verified against: the row digest of each trainer tensor named in
        ``dtypes``, cast to its engine dtype (:mod:`graft_rl.policy.pushcheck`), from the parameters
        themselves rather than the pushed stream."""
        from graft_rl.policy.pushcheck import state_digest

        return state_digest(self.rollout_state(), dtypes)

    def tied_names(self) -> set[str]:
        """State-dict names that alias another's tensor (tied embeddings): pushed, held once by an engine."""
        from graft_rl.policy.pushcheck import tied_names

        # a LoRA policy's adapted weights are merged copies, never tied: the raw state's ties, own names
        return {n.replace(".base_layer.", ".") for n in tied_names(self.model.state_dict()) if ".lora_" not in n}

    def rollout_state(self):
        """The weights a rollout engine holds, under the model's own names: the state dict, or for a LoRA
        policy the base with every adapter merged (:class:`~graft_rl.policy.lora.MergedState`, computed as
        read, one tensor at a time)."""
        if self.lora is None:
            return self.model.state_dict()
        from graft_rl.policy.lora import MergedState

        return MergedState(self.model)

    def param_digest(self) -> list[float]:
        """Per-parameter sums (float64): a cheap fingerprint to compare weights across processes."""
        return [float(p.detach().double().sum()) for p in self.model.parameters()]

    def rollout_check(
        self, prompts: Sequence[tuple[str, str]], max_new_tokens: int = 16, seed: int = 0, reference: dict | None = None
    ) -> dict:
        """Does the rollout engine sample from the trainer's current weights? (``graft preflight``)

        Pushes the weights if they changed (as a step's generation does), samples two responses per
        prompt at temperature 1 / top-p 1 (where generation log-probs are the model's own) and scores
        them with the trainer's model: ``now_mean``/``now_max`` are the per-token ``|generation
        log-prob - trainer log-prob|``. The result also carries the sampled sequences and their
        trainer log-probs; given an earlier result as ``reference``, ``moved_mean`` is how far the
        trainer's log-probs of *those* sequences moved since (what a stale engine would be off by).
        """
        saved_t = self.logprob_temperature
        self.logprob_temperature = 1.0
        try:
            groups = self.generate(list(prompts), SamplingParams(n=2, max_new_tokens=max_new_tokens), seed=seed)
            batch = self.encode_own(groups)
            now, mask = self.token_logprobs(batch)
            moved = None
            if reference is not None:
                ref_batch = TokenBatch(*map(list, zip(*reference["sequences"], strict=True)))
                lp, ref_mask = self.token_logprobs(ref_batch)
                before = torch.zeros_like(lp)
                for i, row in enumerate(reference["logprobs"]):
                    before[i, : len(row)] = torch.tensor(row)
                moved = float(((lp - before).abs() * ref_mask).sum()) / max(float(ref_mask.sum()), 1.0)
        finally:
            self.logprob_temperature = saved_t
        gen = torch.zeros_like(now)
        for i, lp in enumerate(x for g in groups for x in g.gen_logprobs):
            gen[i, : len(lp)] = torch.tensor(lp)
        tokens = float(mask.sum())
        d = (gen - now).abs() * mask
        return {
            "tokens": tokens,
            "now_mean": float(d.sum()) / max(tokens, 1.0),
            "now_max": float(d.max()) if tokens else 0.0,
            "moved_mean": moved,
            "sequences": [[p, r] for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)],
            "logprobs": [now[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)],
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self, out_dir: str | Path, lag: bool = True) -> Path:
        """``save_pretrained`` model + tokenizer, ``graft_policy.json`` (how this policy formats
        prompts, so ``graft eval CHECKPOINT`` prompts it as training did), ``policy_state.pt``
        (optimiser, RNG) and, with ``lag``, the pushed weights a lagged rollout samples after a resume
        (``rollout.lag``; a best checkpoint, which nothing resumes from, leaves them out)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:  # the adapter alone: adapter_model.safetensors + adapter_config.json
            from graft_rl.policy.lora import save_adapter

            save_adapter(self.lora, out)
        else:
            self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        self.save_settings(out)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "weights_version": self.weights_version,
        }
        tmp = out / "policy_state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, out / "policy_state.pt")
        if lag:
            self.save_lag(out / LAG_FILE)
        return out

    def save_lag(self, path: Path) -> None:
        """The pushed weights a lagged rollout will sample from after a resume (``rollout.lag``)."""
        if self.lag is not None and self.lag.history:
            self.lag.save(path, self.weights_version)

    def load_lag(self, path: Path) -> None:
        from graft_rl.policy.lag import RolloutLag

        if path.is_file():
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                k = int(f.metadata()["k"])
            self.lag = RolloutLag(k)
            self.lag.load(path, self.weights_version)

    def save_settings(self, out: Path) -> None:
        """Write ``graft_policy.json``: this policy's config (prompt format, template, suffix, lengths,
        backend, dtype), read back by :func:`saved_policy_config`."""
        import dataclasses
        import json

        keep = {
            k: v
            for k, v in dataclasses.asdict(self.config).items()
            if k not in ("model", "gguf_file", "tokenizer", "reference_model", "reference_gguf_file")
            and not (k == "lora" and v is None)
        }
        if self.base is not None:  # an adapter's base: what it loads on, and the digest that must match
            keep["lora_base"] = self.base
        (Path(out) / POLICY_SETTINGS).write_text(json.dumps(keep, indent=1))

    def load_state(self, ckpt_dir: str | Path) -> None:
        """Restore optimiser and RNG from :meth:`save` (weights come from loading the directory)."""
        state = load_state_file(Path(ckpt_dir) / "policy_state.pt")
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        # optimiser steps taken (older checkpoints: counted again from 0; only the lag's sample_version reads it)
        self.weights_version = self._synced_version = int(state.get("weights_version", 0))
        self.load_lag(Path(ckpt_dir) / LAG_FILE)
