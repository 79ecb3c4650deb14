"""The ``vllm`` rollout backend: one vLLM engine per policy (or per rank), in the trainer's process
(docs/design.md, layer 3; "Where FSDP2, Ray and vLLM sit").

vLLM is imported only when this backend is built. vLLM reports ``logprobs`` of the raw model
distribution unless ``logprobs_mode="processed_logprobs"`` is set, which we set so that the log-probs
match what was sampled (after temperature and top-p/top-k). Weights are pushed from the trainer's model
into the engine once per step, before generation, without a restart, and every push is verified
against the trainer's parameters (:mod:`graft_rl.policy.pushcheck`). On a GPU the engine sleeps
between generations (vLLM sleep mode).

Three things vLLM keeps per *process*, not per engine, decide what may share a process:
its sleep-mode allocator (one per process), its rotary-embedding cache (``_ROPE_DICT``: a second engine
with the same rotary settings reuses the first one's ``cos_sin_cache``, allocated in the first one's
sleep pool and unmapped whenever it sleeps), and ``torch.distributed``'s default group (its engine
shutdown destroys it). So on CUDA one engine at a time lives in a process wherever one sleeps; an
engine is woken before it is shut down (the allocator's free unmaps unconditionally, and a failed
unmap of sleeping memory poisons it for the rest of the process); the rotary cache is cleared when an
engine closes; and a process group that existed before the engine outlives it.

Engines of *different* processes may share a GPU (Ray actors with ``ray.num_gpus=0.5``). vLLM's
``Worker.sleep`` reads the device-wide free memory before and after it frees its pools and asserts it
did not drop ("Memory usage increased after sleeping.", no retry on CUDA); another engine waking in
between, or starting (its memory profiling and pools), would trip it. So an engine's start, every sleep
and every wake take their GPU's turn (:func:`gpu_turn`, a lock file per physical GPU, shared by every
process of the machine): on one GPU they never overlap. An engine's start joins its process group's
collectives, so only one-rank policies may share a GPU (``check_cluster`` refuses a sharded vLLM policy
on a fraction of a GPU): no holder of a turn then waits on another process.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import tempfile
import weakref

import torch

from graft_rl.locks import flocked
from graft_rl.policy import pushcheck
from graft_rl.policy.types import Sample, SamplingParams
from graft_rl.seeding import derive_seed

__all__ = [
    "VLLMBackend",
    "VLLMEngineError",
    "gpu_key",
    "gpu_turn",
    "request_seeds",
    "shield_from_vllm_patches",
    "VLLM_VERSIONS",
]

#: vLLM versions whose APIs the backend uses (``logprobs_mode``, ``reload_weights`` with a weights
#: iterator, sleep/wake_up with tags); the ``vllm`` extra pins the same range.
VLLM_VERSIONS = ((0, 32), (0, 35))

#: Engines of this process not yet closed (one at a time on CUDA wherever one sleeps).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _check_vllm_version(version: str) -> None:
    parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())
    lo, hi = VLLM_VERSIONS
    if not lo <= parts < hi:
        raise ImportError(
            f"rollout backend 'vllm' needs vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (logprobs_mode, reload_weights, "
            f"sleep mode); found {version}: pip install 'graft-rl[vllm]'"
        )


class VLLMEngineError(RuntimeError):
    """A vLLM engine cannot be built, kept or trusted here; the message names what to change."""


def request_seeds(seed: int, prompts: int) -> list[int]:
    """The seed of each request of a generation call: one per prompt, derived from the call's seed
    (itself derived from run seed, step, policy and rank; :mod:`graft_rl.seeding`). vLLM seeds child
    ``i`` of a request with ``seed + i``; seeds 63 bits apart never share a stream in practice."""
    return [derive_seed(seed, i) for i in range(prompts)]


def gpu_key(device: str = "cuda") -> str | None:
    """The physical GPU behind ``device`` (its UUID, the same in every process whatever
    ``CUDA_VISIBLE_DEVICES`` numbers it), or None off CUDA."""
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        props = torch.cuda.get_device_properties(d.index or 0)
    except (AssertionError, RuntimeError):  # CUDA reported but not usable here: no turn to take
        return None
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"pci-{getattr(props, 'pci_domain_id', 0)}-{getattr(props, 'pci_bus_id', 0)}-{getattr(props, 'pci_device_id', 0)}"


def _turn_dir() -> str:
    """Where the per-GPU turn files live: every process of the machine must agree (``GRAFT_GPU_LOCK_DIR``
    overrides the system's temporary directory)."""
    return os.environ.get("GRAFT_GPU_LOCK_DIR") or tempfile.gettempdir()


@contextlib.contextmanager
def gpu_turn(key: str | None):
    """Hold GPU ``key``'s turn (an exclusive ``flock`` on ``graft-rl-gpu-<key>.lock``) for the block:
    one vLLM sleep or wake at a time per physical GPU across this machine's processes (module
    docstring). ``None`` (no GPU): no turn. The lock dies with its process, so a crashed holder
    never blocks the others."""
    if key is None:
        yield
        return
    # mode 0o666 (fchmod, not narrowed by the umask) and opened read-only: every user's processes take it
    with flocked(os.path.join(_turn_dir(), f"graft-rl-gpu-{key}.lock"), 0o666):
        yield


def _sleep_allocator_usage() -> int:
    """Bytes vLLM's sleep-mode allocator holds in this process (sleeping ones included), 0 where it
    has none (a CPU build). vLLM 0.32-0.33 assert this is 0 when an engine with sleep mode loads its
    weights; 0.34 dropped that assertion, so this check (:meth:`VLLMBackend._refuse_second_engine`) is
    the only one left."""
    try:
        from vllm.device_allocator import get_mem_allocator_instance

        allocator = get_mem_allocator_instance()
    except ImportError:
        try:
            from vllm.device_allocator.cumem import CuMemAllocator
        except ImportError:
            return 0
        allocator = CuMemAllocator.get_instance()
    except Exception:  # no such allocator on this platform
        return 0
    return int(allocator.get_current_usage())


def _empty_host_cache() -> None:
    """Hand torch's cached pinned host blocks back to the system (CUDA only; torch >= 2.9)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if torch.cuda.is_available() and callable(empty):
        empty()


def _clear_rotary_cache() -> None:
    """Forget vLLM's process-wide rotary modules (their ``cos_sin_cache`` lived in a closed engine's memory)."""
    with contextlib.suppress(ImportError, AttributeError):
        from vllm.model_executor.layers import rotary_embedding

        rotary_embedding._ROPE_DICT.clear()


def _check_device(device: str, who: str) -> None:
    """vLLM binds ``cuda:local_rank`` (0 in one process): an engine asked for another GPU would sit on GPU 0."""
    d = torch.device(device)
    if d.type == "cuda" and d.index not in (None, 0):
        raise VLLMEngineError(
            f"{who}device {device} with backend vllm: vLLM puts its engine on cuda:0 of the visible devices; "
            f"run with CUDA_VISIBLE_DEVICES={d.index} and device cuda, or use execution: ray"
        )


def _plain_cpu_linears() -> None:
    """On vLLM's CPU build (tests and rehearsals), linear layers keep their weights as parameters and run
    ``F.linear`` (the build's own path for layers it does not pack, ``_cpu_skip_gemm_dispatch``) instead
    of moving them into opaque oneDNN/SGL handles and leaving empty parameters: the engine then computes
    with the very tensors a push is verified on. No effect on a GPU build."""
    with contextlib.suppress(ImportError, AttributeError):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.model_executor.layers.linear import LinearBase

            LinearBase._cpu_skip_gemm_dispatch = True


def _engine_kwargs(sleep: bool, kwargs: dict, device: str = "cuda", sized: bool | None = None) -> dict:
    """``kwargs`` plus what this backend needs of the engine where this vLLM has the option and the user
    did not choose (each probed in ``EngineArgs``):

    - CUDA-graph offload in sleep: graph memory then leaves the GPU with the engine. vLLM backs the
      graph pool up to pinned host memory at both sleep levels and restores it on every wake
      (``cudagraph`` is not a deferrable tag), so the first wake, of the weights, brings the graphs back
      before any generation.
    - no extensible KV cache (vLLM 0.34, on by default on CUDA): it caps the whole process's torch memory
      with ``set_per_process_memory_fraction`` from the engine's start to its shutdown, sleep included,
      and this process also trains: the memory a sleeping engine frees would stay out of the trainer's reach.
    - on CPU, a KV cache of :data:`CPU_KV_CACHE_BYTES` unless ``gpu_memory_utilization`` or
      ``kv_cache_memory_bytes`` is given: vLLM's CPU build otherwise takes a share of the machine's memory
      less the whole process's resident memory, which a second engine in the process (two policies,
      ``execution: local``) finds already spent. ``sized``: the user chose ``gpu_memory_utilization``
      (default: whether ``kwargs`` holds it).
    - on CPU, an eager engine unless ``enforce_eager`` or ``compilation_config`` is given: vLLM's CPU
      build otherwise compiles the model with torch.compile at every engine start (27 s against 5 s for
      ``build_tiny_pair``'s first model, ``vllm.LLM(..., enforce_eager=False/True)`` in vLLM 0.32.0 CPU on
      2 cores of an AMD EPYC), longer than a rehearsal's or a test's generation. On a GPU
      vLLM's own default (compiled, CUDA graphs) stands."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        known = set(inspect.signature(EngineArgs).parameters)
    except ImportError:
        known = set()
    extra = {}
    if sleep and "sleep_mode_offload_cudagraph" in known:
        extra["sleep_mode_offload_cudagraph"] = True
    if "enable_extensible_kv_cache" in known:
        extra["enable_extensible_kv_cache"] = False
    sized = "gpu_memory_utilization" in kwargs if sized is None else sized
    cpu_sized = sized or "kv_cache_memory_bytes" in kwargs
    if (
        device == "cpu"
        and not cpu_sized
        and "kv_cache_memory_bytes" in known
        and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    ):
        extra["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if device == "cpu" and "enforce_eager" in known and not {"enforce_eager", "compilation_config"} & set(kwargs):
        extra["enforce_eager"] = True
    return {**extra, **kwargs}


def _start_llm(llm_cls, model_dir, dtype: str, sleep: bool, share: float | None, device: str, kwargs: dict):
    """``vllm.LLM`` as this backend needs it: log-probs of the sampling distribution, prefix caching, sleep
    mode where ``sleep``, ``share`` of the GPU (default :data:`VLLM_MEMORY_SHARE`), :func:`_engine_kwargs`."""
    options = {"gpu_memory_utilization": VLLM_MEMORY_SHARE if share is None else share, **kwargs}
    return llm_cls(
        model=str(model_dir),
        dtype=dtype,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        enable_sleep_mode=sleep,
        **_engine_kwargs(sleep, options, device, sized=share is not None),
    )


#: The KV cache of an engine on vLLM's CPU build (tests and rehearsals) unless ``vllm_kwargs`` sizes it:
#: 2 GiB, 46,600 tokens of SmolLM2-135M in float32 (30 layers x 3 KV heads x 64 x 2 x 4 bytes a token).
CPU_KV_CACHE_BYTES = 2 << 30


#: The share of its GPU a vLLM engine takes unless ``vllm_kwargs.gpu_memory_utilization`` says otherwise
#: (the backend's default; ``graft plan`` and the Ray resource check read the same number).
VLLM_MEMORY_SHARE = 0.4


class VLLMBackend:
    """vLLM engine for one policy (or one rank of a sharded policy), beside the trainer.

    Needs the ``vllm`` extra (``pip install graft-rl[vllm]``) and a ``save_pretrained``
    model directory (vLLM does not load GGUF here). ``gpu_memory_utilization`` bounds the
    engine's share of the GPU while it is awake. Extra keys of ``vllm_kwargs`` go to ``vllm.LLM``,
    e.g. ``max_model_len``. Tensor parallelism is refused (:class:`~graft_rl.policy.PolicyConfig`):
    each engine lives in one rank actor with one GPU.

    Sampling: every request carries its own seed (:func:`request_seeds`), so a call reproduces given
    its seed and prompts, and ranks, policies, steps and eval runs draw independent samples, on both
    of vLLM's model runners (the V2 runner on CUDA seeds unseeded requests from numpy's global RNG,
    which every engine resets to the model seed, and never reads torch's generator).

    Pushes (:meth:`sync_weights`) are verified: after vLLM's ``reload_weights`` every engine tensor's
    row digest must equal the trainer's (``digest_fn``, from the trainer's parameters; fused tensors
    compose from their parts), or the push is refused naming the tensor, and nothing is sampled until a
    push verifies. The engine as loaded from disk is verified the same way when it is built.

    Sleep (``sleep``, default on a GPU): the engine sleeps from the end of each generation until the
    next, so scoring and updates have the GPU to themselves. Level 1 (weights backed up to host
    memory) until a push has been *verified*; then level 2 (weights discarded: the push before the
    next generation rewrites them all and is verified again). :attr:`needs_push` says when the engine's
    weights are not the trainer's (discarded, or a push that failed verification);
    :meth:`Policy.sync_rollout_weights` then pushes them. A quantised engine (fp8) is verified for
    coverage only and stays at level 1.
    """

    def __init__(
        self,
        model,
        model_dir: str,
        dtype: str = "float32",
        gpu_memory_utilization: float | None = None,
        sleep: bool | None = None,
        weights_fn=None,
        digest_fn=None,
        tied: set[str] | None = None,
        state_fn=None,
        push_at_start: bool = False,
        digest_stream: bool = False,
        agree=None,
        stop: list[str] | None = None,
        name: str = "",
        device: str = "cuda",
        **engine_kwargs,
    ):
        # The engine runs in this process: no spawned engine (so no __main__ guard is needed), and the
        # weight push and the reseed callable pass Python objects directly. Set, not defaulted: an
        # inherited 1 would move the engine into a child process where neither can travel.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM 0.34's reload modes: the push check is reasoned on the layerwise one (each layer processed
        # once all its tensors arrived; a layer that got none keeps its tensors), 0.32's only mode
        os.environ["VLLM_RELOAD_MODE"] = "layerwise"
        self.name = name
        self.who = f"policy {name!r}: " if name else ""
        _check_device(device, self.who)
        try:
            import vllm
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("rollout backend 'vllm' needs vLLM: pip install 'graft-rl[vllm]'") from exc
        _check_vllm_version(vllm.__version__)
        self.model = model
        self.stop = list(stop or [])  # strings that end a response as EOS does (PolicyConfig.stop)
        # the trainer's tensors under the model's own names: its state dict, or a LoRA policy's merged
        # weights (policy.lora.MergedState, each merged as it is read)
        # (closures over the local, never over self: a failed start must not leave a cycle that keeps the
        # engine alive, and counted as open, until the garbage collector runs)
        state_fn = self.state_fn = state_fn or model.state_dict
        # the weights to push: that state, one tensor at a time (a sharded policy gathers its full weights),
        # called as weights_fn(dtypes, digests): each tensor in its engine dtype where ``dtypes`` names it,
        # its row digest recorded in ``digests`` (when a dict) as it is made (digest_stream)
        self.weights_fn = weights_fn or _state_stream(state_fn)
        # digest the pushed tensors as they are made rather than a second time from the state: for a LoRA
        # policy, whose merged tensors (a sharded one: gathered whole) would otherwise be made twice a push
        self.digest_stream = digest_stream
        # the push's reference: row digests of the trainer's own tensors (a sharded policy: a collective)
        self.digest_fn = digest_fn or (lambda dtypes: pushcheck.state_digest(state_fn(), dtypes))
        self.tied = set(tied) if tied is not None else pushcheck.tied_names(state_fn())
        # a sharded policy's agreement (ShardedPolicy.agree): a push, with its check, ends on every rank alike
        self.agree = agree
        self.sleep = torch.cuda.is_available() if sleep is None else sleep
        self.gpu = gpu_key(device)  # whose turn the engine's start, sleeps and wakes take (gpu_turn)
        self.reseed_globals = True  # also seed the workers' torch/numpy generators (off: gpu_check's seed row)
        self.sleeping: set[str] = set()  # memory tags vLLM has put to sleep: weights, kv_cache
        self.full_push = False  # a push was verified: level-2 sleep from then on
        self.host_backup = False  # a level-1 sleep's pinned host copy of the weights may sit in torch's host cache
        self.needs_push = False  # the engine's weights are not the trainer's: push before the next generation
        self._last: tuple[dict, dict] | None = None  # quantised engines: (trainer, engine) digests of the last push
        self._refuse_second_engine()
        self._keeps_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        _clear_rotary_cache()  # nothing of an earlier engine's memory may be reused
        _plain_cpu_linears()
        with gpu_turn(self.gpu):  # its memory profiling and pools: never inside another engine's sleep
            self.llm = _start_llm(LLM, model_dir, dtype, self.sleep, gpu_memory_utilization, device, engine_kwargs)
        _LIVE.add(self)
        _check_in_process(self.llm)
        _together(self.agree, lambda: self._start_check(push_at_start), "the engine's start check")
        # level 1 whatever was verified: the engine holds the trainer's weights, so the first generation
        # needs no push (a level-2 sleep here would discard a LoRA policy's start push, then push again)
        self._fall_asleep(level=1)

    def _refuse_second_engine(self) -> None:
        """On CUDA one engine at a time in a process wherever one sleeps (module docstring)."""
        others = [b for b in _LIVE if getattr(b, "llm", None) is not None]
        if others and torch.cuda.is_available() and (self.sleep or any(b.sleep for b in others)):
            names = ", ".join(repr(b.name) for b in others)
            raise VLLMEngineError(
                f"{self.who}a second vLLM engine in this process while {names}'s is open (vLLM's sleep allocator and "
                f"rotary cache are per process, and one engine's sleep unmaps what the other uses); use "
                f"execution: ray (each policy in its own process), or close() the first engine"
            )
        held = _sleep_allocator_usage() if self.sleep else 0
        if held:
            raise VLLMEngineError(
                f"{self.who}vLLM's sleep allocator already holds {held / 2**30:.1f} GiB in this process (another "
                f"engine, open or not shut down); one vLLM engine per process: use execution: ray"
            )

    # ------------------------------------------------------------------ push verification
    def _start_check(self, push_at_start: bool) -> None:
        self.layout = self._layout()
        if push_at_start:  # a LoRA policy: the engine loaded the base; the trainer's weights are merged
            self._push()
        else:
            self._verify("as loaded from the model directory")

    def _layout(self) -> pushcheck.EngineLayout:
        names = list(self.state_fn())  # the pushed tensors' names (nothing gathered)
        quantized = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "quantization", None)
        transposed = {n: s for n, s in pushcheck.transposed_names(self.model).items() if n in names}
        args = (names, quantized is not None, sorted(self.tied), transposed)
        layout = self.llm.collective_rpc(_layout_rpc, args=args)[0]
        unplaced = layout.unplaced  # a tied alias too, unless the engine's tensor behind it was found
        empty = [e for e, parts in layout.parts.items() if not parts and not layout.quantized]
        if unplaced or empty:
            what = [f"trainer tensor {t} has no place in the engine" for t in unplaced[:3]]
            what += [f"engine tensor {e} receives no trainer tensor" for e in empty[:3]]
            raise VLLMEngineError(
                f"{self.who}cannot verify weight pushes into this vLLM model: {'; '.join(what)}"
                f"{' (and more)' if len(unplaced) + len(empty) > 3 else ''}; report this with the model's architecture"
            )
        return layout

    def _verify(self, what: str) -> None:
        """Digest the trainer and the engine and compare; refuse (naming tensors) on any difference."""
        ref = self.digest_fn(self.layout.trainer_dtypes())
        self._check(ref, what)

    def _check(self, ref: dict, what: str, entered: dict | None = None) -> None:
        """Refuse unless the engine holds ``ref`` (a push: and ``entered``, what entered the engine, is all of it)."""
        got = self.llm.collective_rpc(pushcheck.engine_digest, args=(sorted(self.layout.columns),))[0]
        problems = [] if entered is None else pushcheck.delivery(self.layout, ref, entered)
        if self.layout.quantized:
            before = self._last
            problems += pushcheck.stale_coverage(self.layout, ref, before[0], got, before[1]) if before else []
            self._last = (ref, got)
        else:
            problems += pushcheck.compare(self.layout, ref, got)
        if problems:
            self.needs_push, self.full_push = True, False  # nothing is sampled until a push verifies
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise VLLMEngineError(
                f"{self.who}the vLLM engine's weights {what} are not the trainer's: {'; '.join(problems[:3])}{more}; "
                f"nothing was sampled from them"
            )

    # ------------------------------------------------------------------ sleep
    def _fall_asleep(self, level: int | None = None) -> None:
        """Sleep whenever the weights are awake (a push wakes them alone: the KV cache may sleep still);
        ``level`` default: 2 once a push was verified, else 1.

        Host memory: a level-1 sleep copies the weights into pinned host tensors that vLLM drops on wake,
        into torch's pinned-host cache, which keeps them for the life of the process (3.4-6 GB a rank at
        1.7B-3B in bf16). The first level-2 sleep after level-1 ones empties that cache, as nothing will
        use those blocks again; an engine that stays at level 1 (quantised) keeps them, reused each step
        (pinning gigabytes anew every step costs seconds). vLLM 0.34 backs up into host buffers of its own
        (``mmap`` + ``cudaHostRegister``), kept across wakes and released by its level-2 sleep: emptying
        torch's cache then frees nothing, harmlessly."""
        if self.sleep and "weights" not in self.sleeping:
            level = level or (2 if self.full_push else 1)
            with gpu_turn(self.gpu):  # vLLM measures the whole device around its sleep
                self.llm.sleep(level=level)
            self.sleeping = {"weights", "kv_cache"}
            self.needs_push = self.needs_push or level == 2
            if level == 1:
                self.host_backup = True
            elif self.host_backup:
                _empty_host_cache()
                self.host_backup = False

    def rest(self) -> None:
        """Sleep now (a rank that pushed weights but does not generate)."""
        self._fall_asleep()

    def _wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Wake ``tags`` one at a time (never one twice), handing the caching allocator's free blocks
        back to the GPU before each (as verl does), so the engine's weights and then its KV cache find
        the memory the trainer's scoring and updates left cached."""
        for tag in [t for t in tags if t in self.sleeping]:
            with gpu_turn(self.gpu):  # never inside another engine's sleep, wake or start-up profiling
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # frees device memory: inside the turn, as vLLM's own calls
                self.llm.wake_up(tags=[tag])
            self.sleeping.discard(tag)

    # ------------------------------------------------------------------ push and generate
    def sync_weights(self) -> None:
        """:meth:`_push`; on the ranks of a sharded policy (``agree``) it ends alike on every rank: a rank
        that fails (its engine's loader, a cast, a merge, a digest, the check) brings its error to the
        group's next agreement, which every other rank reaches before its next collective, and every
        rank raises :class:`~graft_rl.policy.types.RankFault` naming each failed rank's error."""
        _together(self.agree, self._push, "the weight push")

    def _push(self) -> None:
        """Reload the trainer's weights into the engine in place (vLLM's ``reload_weights``) and verify them.

        The trainer's digest is taken first, from its parameters (``digest_stream``: from each tensor as
        the stream makes it, before it leaves for the engine); then the stream is pushed (the engine
        runs in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so tensors are handed over without
        serialisation); then the engine's tensors are digested and compared. A sleeping engine wakes
        its weights only; the KV cache is allocated at generation. A verified push allows level-2 sleep
        from then on; one that is not verified is an error and leaves :attr:`needs_push` set.
        """
        self._wake(("weights",))
        dtypes = self.layout.trainer_dtypes()
        exact = (
            not self.layout.quantized
        )  # a quantised engine quantises on load: it is streamed as the trainer holds it
        streamed = self.digest_stream and exact
        ref = {} if streamed else self.digest_fn(dtypes)
        self.needs_push = True  # until verified
        stream = self.weights_fn(dtypes if exact else None, ref if streamed else None)
        entered: dict = {}  # what the engine's loader read: every tensor, each alias with its digest
        aliases = {a: dtypes[a] for a in self.layout.aliases}
        stream = pushcheck.entering(stream, aliases, entered)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        missed = {n: dt for n, dt in dtypes.items() if n not in ref}
        if missed:  # digest_stream: a tensor the stream never made is digested from the state (every rank alike)
            ref.update(self.digest_fn(missed))
        self._check(ref, "after the push", entered)
        self.full_push = not self.layout.quantized
        self.needs_push = False
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        if self.needs_push:
            raise VLLMEngineError(
                f"{self.who}vLLM engine: generation from weights that are not the trainer's (discarded by a level-2 "
                f"sleep, or a push that was not verified) without a verified weight push (Policy.sync_rollout_weights)"
            )
        try:
            self._wake()
            return self._generate(prompt_ids, sampling, seed)
        finally:
            self._fall_asleep()

    def _generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        params = [
            VSP(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,
                stop=self.stop or None,  # matched on the text; the tokens through the match are kept
                include_stop_str_in_output=True,
                seed=s,
            )
            for s in request_seeds(seed, len(prompt_ids))
        ]
        if self.reseed_globals:  # the engine's global generators too (anything vLLM draws without a request seed)
            self.llm.collective_rpc(_reseed_worker, args=(seed,))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        result = []
        for o in outs:
            group = []
            for c in o.outputs:
                ids = list(c.token_ids)
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)]
                group.append(Sample(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
            result.append(group)
        return result

    def close(self) -> None:
        """Wake, shut the engine down and free its memory; the next engine in this process may then start.

        A sleeping engine is woken first (shutting down unmapped memory breaks vLLM's allocator for the
        process). vLLM's shutdown destroys ``torch.distributed``'s default group: one that existed
        before the engine (a sharded policy's FSDP group) is kept, so scoring still works."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):
            self._wake()
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            with _keep_default_group(self._keeps_group), contextlib.suppress(Exception):
                shutdown()
        del llm, core, shutdown
        _LIVE.discard(self)
        _clear_rotary_cache()
        gc.collect()
        if torch.cuda.is_available():
            with gpu_turn(self.gpu):  # hands device memory back: never inside another engine's sleep or start
                torch.cuda.empty_cache()


def _together(agree, fn, what: str) -> None:
    """``fn()``; then, on the ranks of a sharded policy (``agree``: :meth:`ShardedPolicy.agree`), every
    rank's outcome agreed: all return, or all raise :class:`~graft_rl.policy.types.RankFault` with each
    failed rank's error. ``fn`` must end with no collective pending on this rank (each of a sharded
    policy's push collectives is preceded by an agreement, which a failed rank's error here answers)."""
    from graft_rl.policy.types import RankFault

    try:
        fn()
    except RankFault:
        raise  # agreed already: every rank raises it
    except Exception as exc:
        if agree is None:
            raise
        agree(exc, what)  # raises on every rank
        raise
    if agree is not None:
        agree(None, what)  # done here: and on every other rank?


@contextlib.contextmanager
def _keep_default_group(keep: bool):
    """While vLLM shuts down: ``torch.distributed.destroy_process_group()`` of the default group is a
    no-op when ``keep`` (vLLM's own subgroups are still destroyed)."""
    if not keep:
        yield
        return
    dist = torch.distributed
    real = dist.destroy_process_group

    def destroy(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return
        real(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = real


def _state_stream(state_fn):
    """The default push stream: ``state_fn()``'s tensors one at a time, through
    :func:`pushcheck.digesting` (called as ``weights_fn(dtypes, digests)``)."""

    def stream(dtypes=None, digests=None):
        state = state_fn()
        return pushcheck.digesting(((n, state[n].detach()) for n in state), dtypes, digests)

    return stream


def _layout_rpc(worker, names: list[str], quantized: bool, tied=(), transposed=None) -> pushcheck.EngineLayout:
    """Run in the engine's worker: where each trainer tensor lands (:func:`pushcheck.engine_layout`)."""
    return pushcheck.engine_layout(pushcheck._model_of(worker), names, quantized, tied, transposed)


def _check_in_process(llm) -> None:
    """The engine core must run in this process (the weight push hands tensors over directly)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and any(c.__name__ == "MPClient" for c in type(core).__mro__):
        raise VLLMEngineError(
            f"vLLM started its engine in another process ({type(core).__name__}); graft-rl needs it in-process "
            f"(VLLM_ENABLE_V1_MULTIPROCESSING=0, which it sets: something reset it)"
        )


def _reseed_worker(worker, seed: int) -> None:
    """Run in each vLLM worker (``collective_rpc``): seed the global generators its sampler may draw
    from (torch's, read by the V1 runner of vLLM 0.32-0.33 for unseeded requests; numpy's, from which the V2 runner
    draws an unseeded request's seed). Every request carries its own seed, so neither should be read."""
    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def shield_from_vllm_patches(*models) -> int:
    """Keep the trainer's modules callable after a vLLM engine was built in this process.

    vLLM's Transformers backend (the models it has no implementation of its own for, e.g. SmolLM3
    in vLLM 0.32) decorates the *transformers* decoder class for ``torch.compile``: it adds a base
    class whose ``__call__`` reads an attribute set only by the patched ``__init__``, so modules
    of that class built earlier (the trainer's own model) raise ``AttributeError: ... has no
    attribute 'do_not_compile'``, and modules built later need a vLLM config (so a KL reference is
    loaded before the engine). Marks each earlier-built module of a patched class ``do_not_compile``:
    it then runs its plain ``forward``, as it did before. Returns how many modules were marked.
    """
    marked = 0
    for model in models:
        if model is None:
            continue
        for m in model.modules():
            patched = any(c.__name__ == "TorchCompileWithNoGuardsWrapper" for c in type(m).__mro__)
            if patched and "do_not_compile" not in vars(m):
                m.do_not_compile = True
                marked += 1
    return marked
