"""One policy sharded over several processes with PyTorch FSDP2 (docs/design.md, layer 3).

Each rank (one GPU, or one CPU process with gloo) runs a :class:`ShardedPolicy` over the same
``torch.distributed`` process group; to the worker and the driver it is an ordinary
:class:`~graft_rl.policy.Policy`. What changes under the hood:

- **Sharding and precision.** Every decoder layer and then the whole model are wrapped with
  ``fully_shard`` and ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``: the
  sharded master weights and AdamW state are float32, forward/backward run in the compute dtype,
  gradients are reduced in float32 (verl's FSDP recipe).
- **Data parallel scoring and updates.** Every rank holds the whole receiver batch; each scores
  and trains on rows ``rank, rank + W, ...``. The objective normalises by the *global* token count
  of the minibatch (every rank knows it, since every rank holds the batch), and gradients are
  *summed* over ranks (each rank's loss scaled by W under FSDP's average), so the update equals the single-process one: the loss is
  still the token mean over the whole minibatch, weights and peer-last order unchanged.
  Ranks run the same number of forward/backward passes (padding with zero-weight passes), as
  FSDP's collectives require.
- **Rollouts.** Every rank samples its share of the prompts (``rank, rank + W, ...``) with a seed
  of its own (:func:`~graft_rl.seeding.rank_seed`): ``vllm`` in its engine, ``hf`` from an
  unsharded float32 copy of the weights under the compute dtype's autocast, refreshed once per
  step from the shards (an all-gather per tensor). The groups are gathered, so every rank
  returns the whole batch. ``rollout_on_rank0`` makes rank 0 sample the whole batch with the
  run's seed, as one process does (a sharded run then equals a one-process run).
- **Checkpoints.** Rank 0 writes the full weights in ``save_pretrained`` format (transformers and
  vLLM load them); every rank writes its optimiser shard (``policy_state.rank{r}.pt``). Resuming
  needs the same ``world_size``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from graft_rl.policy.lag import LAG_FILE
from graft_rl.policy.loading import load_model, resolve_model
from graft_rl.policy.logprobs import length_micro_batches
from graft_rl.policy.lora import save_adapter
from graft_rl.policy.policy import Policy
from graft_rl.policy.training import load_state_file
from graft_rl.policy.types import PolicyError, RankFault, TokenBatch
from graft_rl.seeding import rank_seed
from graft_rl.stats import StepStats

__all__ = ["RankFault", "ShardedPolicy", "agree", "shard_model"]


def agree(error: BaseException | None, what: str, device: torch.device | str = "cpu") -> None:
    """Every rank of the group calls this at the same point of a collective phase, with the error it met
    since the last such point (None: none). Returns on every rank when no rank brings one; else raises
    :class:`RankFault` on every rank, naming each failed rank's error (on a failed rank chained from it).

    The rule that keeps a group from waiting forever: a rank that fails anywhere outside a collective
    makes its *next* collective this one, which every other rank also reaches next (they call it before
    each collective of the phase). One int all-reduce (MIN); the messages travel only on a failure.
    A failure inside a collective itself (a lost peer, NCCL) is bounded by the group's timeout instead
    (``ray.collective_timeout``)."""
    flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 1:
        return
    texts: list = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    dist.all_gather_object(texts, mine)
    failed = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t is not None)
    raise RankFault(f"{what} failed on {failed}") from error


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; fp32 reduction, ``compute_dtype`` params."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = [m for m in model.modules() if type(m).__name__ in _layer_classes(model)]
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _layer_classes(model) -> set[str]:
    """Names of the model's repeated blocks: transformers' ``_no_split_modules`` (the decoder layer)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise PolicyError(f"{type(model).__name__}: no _no_split_modules to shard by; cannot use world_size > 1")
    return names


class ShardedPolicy(Policy):
    """A :class:`Policy` whose model is sharded over the current process group with FSDP2."""

    def _setup_parallel(self) -> None:
        if not dist.is_initialized():
            raise PolicyError(
                f"policy {self.name!r}: world_size={self.config.world_size} needs torch.distributed initialised"
            )
        if dist.get_world_size() != self.config.world_size:
            raise PolicyError(
                f"policy {self.name!r}: world_size={self.config.world_size} but the process group has {dist.get_world_size()} ranks"
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.lora is not None and _torch_version() < (2, 8):
            # before pytorch#154103 (2.8) one FSDP2 unit needs one original dtype; a LoRA unit mixes the
            # frozen base's compute dtype with the adapters' float32
            raise PolicyError(
                f"policy {self.name!r}: lora with world_size > 1 needs torch >= 2.8 (FSDP2 units that mix a frozen "
                f"base's dtype with float32 adapters), this is {torch.__version__}"
            )
        # the unsharded rollout copy of the hf backend, on every rank that samples (vLLM engines hold their own)
        samples = self.rank == 0 or not self.config.rollout_on_rank0
        self.rollout_model = copy.deepcopy(self.model).eval() if self.config.backend == "hf" and samples else None
        self.model = shard_model(self.model, self.compute_dtype)
        # the sharded (DTensor) parameters: after a forward, FSDP2 may leave the root's parameters
        # registered unsharded on the module, so the optimiser, clipping and digests use these
        self.sharded_params = list(self.model.parameters())
        self._init_sharding()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.sharded_params if p.requires_grad],  # a LoRA policy: its adapters
            lr=self.config.lr,
            betas=tuple(self.config.betas),
            weight_decay=self.config.weight_decay,
        )

    @torch.no_grad()
    def _init_sharding(self) -> None:
        """A two-token forward (every rank) right after sharding. FSDP2 settles each unit's mixed-precision
        dtypes at the root's first forward from the parameters that require grad *then* (torch
        ``_fsdp_param_group.py``, ``_init_mp_dtypes``); a LoRA policy's first forward may be its KL
        reference under peft's ``disable_adapter()``, which clears that flag on the adapters: no reduce
        dtype, and the first backward would assign bf16 gradients to the float32 adapter shards."""
        tok = self.tokenizer.eos_token_id or 0
        self._forward(TokenBatch([[tok]], [[tok]]), fused=False)
        self.model.reshard()  # the root stays unsharded after a forward, for a backward that never comes

    def compute_context(self):
        return contextlib.nullcontext()  # FSDP's MixedPrecisionPolicy casts parameters; no autocast

    # ------------------------------------------------------------------ helpers
    def _local(self, n: int) -> list[int]:
        return list(range(self.rank, n, self.world))

    def _max_over_ranks(self, x: int) -> int:
        t = torch.tensor([x], dtype=torch.long, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _comm_device(self) -> torch.device:
        """gloo reduces host tensors; NCCL (also torch 2.15's ``nccl-legacy``) device ones."""
        return torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(self.config.device)

    def agree(self, error: BaseException | None, what: str) -> None:
        """:func:`agree` over this policy's group, the error naming the policy."""
        try:
            agree(error, what, self._comm_device())
        except RankFault as fault:
            own = f"policy {self.name!r}: "  # a rank's error that names the policy already: once is enough
            raise RankFault(own + str(fault).replace(f": {own}", ": ")) from fault.__cause__

    def _fused_head_matches(self) -> bool:
        ok = super()._fused_head_matches()
        return self._max_over_ranks(0 if ok else 1) == 0  # one decision for the whole group

    # ------------------------------------------------------------------ scoring and updates
    def passes(self, batch: TokenBatch) -> list[list[int] | None]:
        """This rank's rows of every pass: the passes are cut for the whole group by length
        (:func:`~graft_rl.policy.logprobs.length_micro_batches` with ``ranks = W``) and each is dealt
        over the ranks, so every rank runs the same number of passes of like size (FSDP's collectives
        need every rank in every pass; a rank with no row in a pass runs a padding pass, ``None``)."""
        passes = length_micro_batches(batch.lengths(), self.micro_batch_tokens, self.world)
        return [p[self.rank :: self.world] or None for p in passes]

    def _gather_rows(self, logprobs: torch.Tensor) -> torch.Tensor:
        # each rank filled its own rows, the others are zero: a sum gathers the whole matrix
        out = logprobs.to(self._comm_device())
        dist.all_reduce(out)
        return out.cpu()

    def _reduce_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def reduce_stats(self, stats: StepStats) -> StepStats:
        return reduce_stats(stats, self.world, self._comm_device())

    @property
    def loss_scale(self) -> float:
        # FSDP averages gradients over ranks; the loss is already the global token mean, so scaling
        # by W makes the reduction a sum (gloo has no PREMUL_SUM for a divide factor of 1)
        return float(self.world)

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.sharded_params if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm)

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All ranks call; rank 0 gets the full (unsharded, CPU, float32) weights, others ``{}`` (a LoRA
        policy: its adapters only, the frozen base is never gathered for a checkpoint)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None)
        return get_model_state_dict(self.model, options=opts)

    def _full_tensors(self, trainable_only: bool = False):
        """``(state-dict name, full tensor)`` one at a time (an all-gather each; every rank calls)."""
        names = {n for n, p in self.model.named_parameters() if p.requires_grad} if trainable_only else None
        for name, t in self.model.state_dict().items():
            if names is None or name in names:
                yield name, _full(t).detach()

    def rollout_state(self):
        """As :meth:`Policy.rollout_state`: the sharded state dict (names; :meth:`rollout_weights` gathers),
        or a LoRA policy's merged weights, each gathered whole as it is read (a collective)."""
        if self.lora is None:
            return self.model.state_dict()
        from graft_rl.policy.lora import MergedState

        state = self.model.state_dict()
        return MergedState(self.model, tensor=lambda n: self._gathered_one(state[n]))

    def _gathered_one(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s full tensor, once every rank has said it can go on (:meth:`agree`): a rank that failed
        since (merging, digesting, its engine's loader) brings its error here instead of leaving the
        others in the all-gather."""
        self.agree(None, "the weight push")
        return _full(t)

    def rollout_weights(self, dtypes: dict | None = None, digests: dict | None = None):
        """``(name, full tensor)`` one tensor at a time (every rank calls), under the model's own names
        (a LoRA policy's merged): what a rank's vLLM engine loads, without ever holding all full weights.

        ``dtypes``: each tensor's engine dtype; a shard is cast to it *before* the all-gather, so a bf16
        engine's push moves bf16, not the float32 masters (half the traffic; the values vLLM's loader would
        cast to, bit for bit). ``digests``: filled with each pushed tensor's row digest as it is made
        (:func:`~graft_rl.policy.pushcheck.digesting`): a LoRA push gathers each merged tensor once."""
        from graft_rl.policy.pushcheck import digesting

        if self.lora is None:
            yield from digesting(_gathered(self.model.state_dict(), dtypes, self._gathered_one), dtypes, digests)
        else:
            merged = self.rollout_state()
            yield from digesting(((name, merged[name].detach()) for name in merged), dtypes, digests)

    def sync_rollout_weights(self, target=None) -> None:
        """Collective: every rank pushes, or none (a level-2 sleep discards every rank's engine weights
        alike, since every rank's engine sleeps after each generation call: :meth:`generate`)."""
        if getattr(self, "_pushed_for_call", False):  # Policy.generate inside this class's generate: done
            return
        target = self.weights_version if target is None else target
        stale = self._synced_version != target or getattr(self.backend, "needs_push", False)
        if not self._max_over_ranks(int(stale)):  # one decision for the group: the push is a collective
            return
        if self.config.backend == "hf":
            copy_sd = self.rollout_model.state_dict() if self.rollout_model is not None else {}
            with torch.no_grad():
                # collective, one tensor at a time; a LoRA policy's base never changes: its adapters only
                for name, full in self._full_tensors(trainable_only=self.lora is not None):
                    if name in copy_sd:
                        copy_sd[name].copy_(full)
        else:
            self.backend.sync_weights()  # each rank's engine, fed by rollout_weights()
        self._synced_version = target

    def generate(self, prompts, sampling, seed: int = 0, lag: int | None = None):
        """Every rank samples its share (``rank, rank + W, ...``) seeded :func:`rank_seed`; all ranks
        return the whole batch in prompt order (``rollout_on_rank0``: rank 0 samples it all). ``lag``:
        from the weights of ``lag`` pushes earlier, each rank's shards swapped in (:mod:`graft_rl.policy.lag`)."""
        with self.sampling_weights(lag):  # collective: every rank takes part, sampling or not
            return self._generate_shares(prompts, sampling, seed)

    def _generate_shares(self, prompts, sampling, seed: int):
        self._pushed_for_call = True  # the per-rank Policy.generate below must not start another collective
        try:
            if self.config.rollout_on_rank0:
                box = [super().generate(prompts, sampling, seed) if self.rank == 0 else None]
                if self.rank != 0 and hasattr(self.backend, "rest"):
                    self.backend.rest()  # its engine sleeps as rank 0's does
                dist.broadcast_object_list(box, src=0)
                return box[0]
            mine = super().generate(
                [prompts[i] for i in self._local(len(prompts))], sampling, rank_seed(seed, self.rank, self.world)
            )
        finally:
            self._pushed_for_call = False
        parts: list = [None] * self.world
        dist.all_gather_object(parts, mine)
        return [parts[i % self.world][i // self.world] for i in range(len(prompts))]

    def push_digest(self, dtypes: dict) -> dict[str, torch.Tensor]:
        """Collective: the full tensors' row digests from each rank's shard (a ``Shard(0)`` shard is a block
        of rows, so each rank fills its rows and one all-reduce sums them). ``dtypes``: from this rank's
        engine layout; every rank builds its engine (under ``rollout_on_rank0`` too), so they agree."""
        from graft_rl.policy.pushcheck import row_digest

        names = sorted(dtypes)
        error = None
        try:  # a LoRA policy's merged tensors: gathered whole one at a time, digested on rank 0
            state = self.rollout_state() if self.lora is not None else self.model.state_dict()
            parts = [_shard_rows(state[n], dtypes[n], row_digest, self.rank) for n in names]
        except RankFault:
            raise
        except Exception as exc:  # noqa: BLE001 - brought to the agreement, raised there on every rank
            error = exc
        self.agree(error, "the push's reference digest")
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        flat = flat.to(self._comm_device())
        dist.all_reduce(flat)
        return dict(zip(names, flat.cpu().split([len(p) for p in parts]), strict=True))

    def param_digest(self) -> list[float]:
        sums = torch.tensor(
            [float(p.detach().to_local().double().sum()) for p in self.sharded_params],
            dtype=torch.float64,
            device=self._comm_device(),
        )
        dist.all_reduce(sums)
        return sums.tolist()

    # ------------------------------------------------------------------ reference (KL)
    def init_reference(self) -> None:
        if self.reference is not None or self.lora is not None:  # LoRA: the base, adapter disabled
            return
        path, gguf = resolve_model(
            self.name,
            self.config.reference_model or self.config.model,
            self.config.reference_gguf_file if self.config.reference_model else self.config.gguf_file,
        )
        ref = load_model(self.name, path, gguf, self.master_dtype).to(self.config.device).eval().requires_grad_(False)
        self.reference = shard_model(ref, self.compute_dtype)

    def reference_logprobs(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`Policy.reference_logprobs`, then the reference is resharded: FSDP2 keeps the root's
        parameters unsharded after forward for the backward that follows, which a frozen reference never
        runs, so without this its root (embeddings, LM head) would stay whole on every rank."""
        try:
            return super().reference_logprobs(batch)
        finally:
            if self.reference is not None:
                self.reference.reshard()

    # ------------------------------------------------------------------ checkpoints
    def save(self, out_dir: str | Path, lag: bool = True) -> Path:
        out = Path(out_dir)
        sd = self.full_state_dict()  # collective
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if self.lora is not None:  # the adapter alone, from the gathered state (peft's names)
                save_adapter(self.lora, out, state_dict={f"base_model.model.{k}": v for k, v in sd.items()})
            else:
                self.model.save_pretrained(out, state_dict=sd)
            self.tokenizer.save_pretrained(out)
            self.save_settings(out)
        dist.barrier()
        state = {"optimizer": _to_local(self.optimizer.state_dict()), "torch_rng": torch.get_rng_state()}
        state.update(world_size=self.world, weights_version=self.weights_version)
        tmp = out / f"policy_state.rank{self.rank}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, out / f"policy_state.rank{self.rank}.pt")
        if lag:
            self.save_lag(out / _rank_file(LAG_FILE, self.rank))  # this rank's shards of the lagged weights
        dist.barrier()
        return out

    def load_state(self, ckpt_dir: str | Path) -> None:
        path = Path(ckpt_dir) / f"policy_state.rank{self.rank}.pt"
        if not path.is_file():
            raise PolicyError(
                f"policy {self.name!r}: {path} is missing; resume with the world_size the run was saved with"
            )
        state = load_state_file(path)
        if state.get("world_size") != self.world:
            raise PolicyError(
                f"policy {self.name!r}: checkpoint saved with world_size={state.get('world_size')}, now {self.world}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        for p in self.sharded_params:  # back to DTensors laid out like their parameter
            for k, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    self.optimizer.state[p][k] = _like(p, v)
        torch.set_rng_state(state["torch_rng"])
        self.weights_version = self._synced_version = int(state.get("weights_version", 0))
        self.load_lag(Path(ckpt_dir) / _rank_file(LAG_FILE, self.rank))


def _rank_file(name: str, rank: int) -> str:
    """``rollout_lag.safetensors`` -> ``rollout_lag.rank{rank}.safetensors``."""
    stem, _, ext = name.partition(".")
    return f"{stem}.rank{rank}.{ext}"


def _shard_rows(t: torch.Tensor, dtype: torch.dtype, row_digest, rank: int) -> torch.Tensor:
    """This rank's rows of ``t``'s full row digest, zeros elsewhere (a replicated tensor: rank 0's)."""
    rows = t.shape[0] if t.dim() else 1
    out = torch.zeros(rows, dtype=torch.int64)
    if not hasattr(t, "to_local"):
        if rank == 0:
            out[:] = row_digest(t, dtype)
        return out
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    sharded = any(isinstance(p, Shard) and p.dim == 0 for p in t.placements)
    if sharded:
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if local.numel():
            out[offset[0] : offset[0] + local.shape[0]] = row_digest(local, dtype)
    elif rank == 0:
        out[:] = row_digest(local, dtype)
    return out


def _gathered(state: dict, dtypes: dict | None, gather):
    """``(name, full tensor)`` of a sharded state, each shard cast to its engine dtype (``dtypes``) before
    ``gather`` (:meth:`ShardedPolicy._gathered_one`: an agreement, then the all-gather). A tied alias
    (``lm_head.weight`` tied to the embeddings) is gathered and pushed too: vLLM's reload needs it, and
    the push check requires it (:func:`~graft_rl.policy.pushcheck.delivery`)."""
    # a tensor ``dtypes`` does not name (none is, for a quantised engine) is cast to the engine's one
    # dtype when it has one; decided from ``dtypes`` alone, so every rank gathers it alike
    engine = set((dtypes or {}).values())
    common = next(iter(engine)) if len(engine) == 1 else None
    for name, t in state.items():
        dt = (dtypes or {}).get(name, common)
        local = t.detach().to(dt) if dt is not None and t.is_floating_point() and t.dtype != dt else t
        yield name, gather(local).detach()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _to_local(sd: dict) -> dict:
    def conv(x):
        if hasattr(x, "to_local"):
            return x.to_local().cpu()
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(sd)


def _like(param, local: torch.Tensor):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(param.to_local().device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def reduce_stats(stats: StepStats, world: int, device: torch.device) -> StepStats:
    """A step's statistics over the ranks: each sum summed, each maximum the largest. The names are the
    union of every rank's: a rank whose passes were all padding has none."""
    names: list = [None] * world
    dist.all_gather_object(names, (sorted(stats.sums), sorted(stats.peaks)))
    sums = sorted({k for ks, _ in names for k in ks})
    peaks = sorted({k for _, ks in names for k in ks})
    out = StepStats()
    if sums:
        t = torch.tensor([stats.sums.get(k, 0.0) for k in sums], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        out.sums.update(zip(sums, t.tolist(), strict=True))
    if peaks:
        t = torch.tensor([stats.peaks.get(k, -math.inf) for k in peaks], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.peaks.update(zip(peaks, t.tolist(), strict=True))
    return out
