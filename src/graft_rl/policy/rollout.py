"""Rollout backends: one interface, two engines (docs/design.md, layer 3).

``hf``: a KV-cached sampling loop over any transformers causal LM (CPU or GPU). It samples
from, and records the log-prob of each token under, the *sampling distribution*:
``log_softmax(top_p(top_k(logits / temperature)))``, renormalised after filtering. At
temperature 1, top-p 1, top-k 0 that is the model's own distribution, so scoring the
response again reproduces the generation log-probs (tested to 1e-4 in float32). Otherwise
the recorded log-probs are those of the tempered/truncated distribution, which is the
behaviour policy the compatibility score divides by (paper Section 4.2, :math:`\\pi_\\phi`).

``vllm``: vLLM's engine, imported only when chosen. vLLM reports ``logprobs`` of the raw
model distribution unless ``logprobs_mode="processed_logprobs"`` is set, which we set so
that the log-probs match what was sampled (after temperature and top-p/top-k). Weights are
pushed from the trainer's model into the engine once per step, before generation, without a
restart; on a GPU the engine sleeps between generations (vLLM sleep mode).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from graft_rl.policy.types import SamplingParams
from graft_rl.seeding import derive_seed

__all__ = [
    "Sample",
    "RolloutBackend",
    "HFBackend",
    "VLLMBackend",
    "VLLMEngineError",
    "request_seeds",
    "sampling_logprobs",
    "make_backend",
    "GEN_MEMORY_BUDGET_BYTES",
    "kv_bytes_per_token",
    "auto_gen_batch_rows",
    "shield_from_vllm_patches",
]

#: Bytes of KV cache plus sampling logits one HF generate call may hold when ``gen_batch_size`` is
#: automatic (null): every row of a testbed step in one call, ~70 rows of SmolLM2-135M at 512 new tokens.
GEN_MEMORY_BUDGET_BYTES = 2 << 30


def kv_bytes_per_token(model) -> int | None:
    """KV-cache bytes one token takes in ``model`` (keys and values of every layer), or None if
    its config does not say (layers, key/value heads and head size under their usual names)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    elem = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * elem


def auto_gen_batch_rows(model, rows: int, tokens: int, vocab: int, budget: int = GEN_MEMORY_BUDGET_BYTES) -> int:
    """Rows per generate call so that ``tokens`` (longest prompt + new tokens) of KV cache and three
    float32 ``vocab``-wide sampling buffers per row fit ``budget``; all ``rows`` if they fit, 64 if
    the model's KV size is unknown."""
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        return min(rows, 64)
    per_row = tokens * per_token + 3 * 4 * vocab
    return max(1, min(rows, budget // per_row))


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


class RolloutBackend(Protocol):
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, in prompt order."""

    def sync_weights(self) -> None:
        """Make the engine sample from the trainer's current weights."""


def sampling_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Log-probs ``[B, V]`` of the sampling distribution: temperature, then top-k, then top-p, renormalised.

    Filtered tokens get ``-inf``. Top-p keeps the smallest set of most likely tokens whose
    mass reaches ``top_p`` (the most likely token is always kept).
    """
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.log_softmax(-1)


def _cache_of(res):
    cache = res.get("cache")
    return cache if cache is not None else res.get("past_key_values")


#: Tokens a stop string may span (the text of a row's last STOP_WINDOW tokens is searched).
STOP_WINDOW = 8


class HFBackend:
    """KV-cached ancestral sampling with a transformers model (the trainer's own module)."""

    def __init__(
        self,
        model,
        eos_token_ids: list[int],
        pad_token_id: int,
        batch_size: int | None = None,
        compute_context=None,
        stop: list[str] | None = None,
        decode=None,
    ):
        self.model = model
        # stop strings: matched on the decoded text of a row's last STOP_WINDOW tokens after each token
        self.stop = list(stop or [])
        if self.stop and decode is None:
            raise ValueError("HFBackend: stop strings need the tokenizer's decode")
        self.decode = decode
        self.compute_context = compute_context or contextlib.nullcontext  # autocast under mixed precision
        self.eos = torch.tensor(sorted(set(eos_token_ids)))
        self.pad = pad_token_id
        self.batch_size = batch_size  # rows per generate call; None: auto_gen_batch_rows per call
        self.compact = True  # finished rows leave the decode batch (see _generate_batch)
        head = model.get_output_embeddings()  # vocabulary width of the sampling buffers (auto batch size)
        self._vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
        # transformers >= 5.2x names the KV cache `cache`; earlier versions `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def sync_weights(self) -> None:  # samples from the live module
        pass

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(sampling.n)]
        if not rows:
            return [[] for _ in prompt_ids]
        size = self.batch_size or auto_gen_batch_rows(
            self.model, len(rows), max(map(len, rows)) + sampling.max_new_tokens, self._vocab, GEN_MEMORY_BUDGET_BYTES
        )
        out: list[Sample] = []
        with self.compute_context():
            for s in range(0, len(rows), size):
                out.extend(self._generate_batch(rows[s : s + size], sampling, gen, device))
        n = sampling.n
        return [out[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _generate_batch(self, rows, sp: SamplingParams, gen, device) -> list[Sample]:
        """Sample ``rows`` (left-padded together) up to EOS or ``max_new_tokens``.

        Finished rows leave the batch (and the KV cache) once they are a quarter of it, so the
        decode steps of a step's long tail run on the rows still generating; with ``compact``
        off, or a cache that cannot select rows, every row runs to the end.
        """
        was_training = self.model.training
        self.model.eval()
        B, L = len(rows), max(len(r) for r in rows)
        inp = torch.full((B, L), self.pad, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            inp[i, L - len(r) :] = torch.tensor(r)
            attn[i, L - len(r) :] = 1
        inp, attn = inp.to(device), attn.to(device)
        eos = self.eos.to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=inp, attention_mask=attn, position_ids=pos, use_cache=True)
        past, logits = _cache_of(res), res.logits[:, -1]
        live = torch.arange(B, device=device)  # batch row -> index in `rows`
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        stopped_at = [None] * B  # the token of each row that completed a stop string
        tok_m = torch.full((B, sp.max_new_tokens), self.pad, dtype=torch.long, device=device)
        lp_m = torch.zeros((B, sp.max_new_tokens), device=device)
        steps = 0
        for step in range(sp.max_new_tokens):
            lp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k)
            tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
            tok_lp = lp.gather(1, tok[:, None]).squeeze(1)
            tok = torch.where(finished, torch.full_like(tok, self.pad), tok)
            tok_m[live, step] = tok
            lp_m[live, step] = tok_lp.float()
            steps = step + 1
            finished = finished | torch.isin(tok, eos)
            if self.stop:
                hit = self._stopped(tok_m, live, step, finished)
                for j in hit.nonzero().flatten().tolist():
                    stopped_at[int(live[j])] = step
                finished = finished | hit
            if bool(finished.all()) or step == sp.max_new_tokens - 1:
                break
            if self.compact and 4 * int(finished.sum()) >= len(finished) and hasattr(past, "batch_select_indices"):
                keep = (~finished).nonzero().squeeze(1)
                past.batch_select_indices(keep)
                live, attn, pos, tok, finished = live[keep], attn[keep], pos[keep], tok[keep], finished[keep]
            attn = torch.cat([attn, torch.ones((len(live), 1), dtype=attn.dtype, device=device)], dim=1)
            pos = pos[:, -1:] + 1
            res = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=pos, use_cache=True, **{self._cache_kw: past}
            )
            past, logits = _cache_of(res), res.logits[:, -1]
        if was_training:
            self.model.train()
        tok_m = tok_m[:, :steps].cpu()
        lp_m = lp_m[:, :steps].cpu()
        eos_cpu = self.eos
        samples = []
        for i in range(B):
            ids = tok_m[i].tolist()
            hit = torch.isin(tok_m[i], eos_cpu).nonzero()
            end = int(hit[0]) + 1 if hit.numel() else None
            if stopped_at[i] is not None:  # a stop string, completed before any EOS (the row stopped there)
                end = stopped_at[i] + 1
            if end is not None:
                samples.append(Sample(ids[:end], lp_m[i, :end].tolist(), "stop"))
            else:
                samples.append(Sample(ids, lp_m[i].tolist(), "length"))
        return samples

    def _stopped(self, tok_m: torch.Tensor, live: torch.Tensor, step: int, finished: torch.Tensor) -> torch.Tensor:
        """Rows of the decode batch whose token at ``step`` completes a stop string: one is in the
        text of their last :data:`STOP_WINDOW` tokens (an earlier window with one would have stopped
        the row already). Only those tokens are copied and decoded."""
        out = torch.zeros_like(finished)
        window = tok_m[live, max(0, step + 1 - STOP_WINDOW) : step + 1].tolist()
        for j, ids in enumerate(window):
            if not bool(finished[j]) and any(x in self.decode(ids) for x in self.stop):
                out[j] = True
        return out


#: vLLM versions whose APIs the backend uses (``logprobs_mode``, ``reload_weights`` with a weights
#: iterator, sleep/wake_up with tags); the ``vllm`` extra pins the same range.
VLLM_VERSIONS = ((0, 32), (0, 34))


def _check_vllm_version(version: str) -> None:
    parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())
    lo, hi = VLLM_VERSIONS
    if not lo <= parts < hi:
        raise ImportError(
            f"rollout backend 'vllm' needs vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (logprobs_mode, reload_weights, "
            f"sleep mode); found {version}: pip install 'graft-rl[vllm]'"
        )


class VLLMEngineError(RuntimeError):
    """A vLLM engine cannot be built or kept here; the message names what to change."""


#: The log line vLLM's ``reload_weights`` writes when a push left parameters untouched (a level-2 sleep
#: would then leave them as garbage): captured by :func:`_unloaded_weights`.
_NOT_LOADED = "Following weights were not loaded"


def request_seeds(seed: int, prompts: int) -> list[int]:
    """The seed of each request of a generation call: one per prompt, derived from the call's seed
    (itself derived from run seed, step, policy and rank; :mod:`graft_rl.seeding`). vLLM seeds child
    ``i`` of a request with ``seed + i``; seeds 63 bits apart never share a stream in practice."""
    return [derive_seed(seed, i) for i in range(prompts)]


def _sleep_allocator_usage() -> int:
    """Bytes vLLM's sleep-mode allocator holds in this process (sleeping ones included), 0 where it
    has none (a CPU build). vLLM asserts this is 0 when an engine with sleep mode loads its weights."""
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

    Sleep (``sleep``, default on a GPU): the engine sleeps from the end of each generation until the
    next, so scoring and updates have the GPU to themselves. Level 1 (weights backed up to host
    memory) until a push has reloaded every weight (vLLM reports none "not loaded"); then level 2
    (weights discarded: the push before the next generation rewrites them all, so backing them up
    would copy ~2 bytes x parameters each way for nothing). :attr:`needs_push` says when the
    weights were discarded; :meth:`Policy.sync_rollout_weights` then pushes them.
    One engine with sleep mode per process: vLLM's sleep allocator is one per process and refuses a
    second engine, so a second one is refused here in one line (``execution: ray`` gives each policy
    its own process).
    """

    def __init__(
        self,
        model,
        model_dir: str,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.4,
        sleep: bool | None = None,
        weights_fn=None,
        stop: list[str] | None = None,
        name: str = "",
        **engine_kwargs,
    ):
        # The engine runs in this process: no spawned engine (so no __main__ guard is needed), and the
        # weight push and the reseed callable pass Python objects directly. Set, not defaulted: an
        # inherited 1 would move the engine into a child process where neither can travel.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("rollout backend 'vllm' needs vLLM: pip install 'graft-rl[vllm]'") from exc
        _check_vllm_version(vllm.__version__)
        self.model = model
        self.name = name
        self.stop = list(stop or [])  # strings that end a response as EOS does (PolicyConfig.stop)
        # the weights to push: the trainer's state dict (a sharded policy gathers its full weights)
        self.weights_fn = weights_fn or (lambda: [(name, p.detach()) for name, p in model.state_dict().items()])
        self.sleep = torch.cuda.is_available() if sleep is None else sleep
        self.sleeping: set[str] = set()  # memory tags vLLM has put to sleep: weights, kv_cache
        self.full_push = False  # a push has reloaded every weight: level-2 sleep from then on
        self.needs_push = False  # the weights were discarded by a level-2 sleep: push before the next generation
        if self.sleep:
            held = _sleep_allocator_usage()
            if held:
                who = f"policy {name!r}: " if name else ""
                raise VLLMEngineError(
                    f"{who}a second vLLM engine with sleep mode in this process (another holds {held / 2**30:.1f} GiB "
                    f"of vLLM's sleep allocator, one per process); use execution: ray (each policy in its own "
                    f"process), or set vllm_kwargs.sleep: false for this policy"
                )
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            enable_sleep_mode=self.sleep,
            **engine_kwargs,
        )
        _check_in_process(self.llm)
        self._fall_asleep()

    def _fall_asleep(self) -> None:
        """Sleep whenever the weights are awake (a push wakes them alone: the KV cache may sleep still)."""
        if self.sleep and "weights" not in self.sleeping:
            level = 2 if self.full_push else 1
            self.llm.sleep(level=level)
            self.sleeping = {"weights", "kv_cache"}
            self.needs_push = level == 2

    def rest(self) -> None:
        """Sleep now (a rank that pushed weights but does not generate: ``rollout_on_rank0``)."""
        self._fall_asleep()

    def _wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Wake ``tags`` one at a time (never one twice), handing the caching allocator's free blocks
        back to the GPU before each (as verl does), so the engine's weights and then its KV cache find
        the memory the trainer's scoring and updates left cached."""
        for tag in [t for t in tags if t in self.sleeping]:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=[tag])
            self.sleeping.discard(tag)

    def sync_weights(self) -> None:
        """Reload the trainer's weights into the engine in place (vLLM's ``reload_weights``).

        The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the tensors are
        handed over without serialisation. A sleeping engine wakes its weights only; the KV cache is
        allocated at generation. A push that reloads every weight allows level-2 sleep from then on;
        one that leaves weights unloaded after a level-2 sleep is an error (they would be garbage).
        """
        self._wake(("weights",))
        with _unloaded_weights() as (missing, observed):
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": self.weights_fn(), "is_checkpoint_format": True}
            )
        if missing and self.needs_push:
            who = f"policy {self.name!r}: " if self.name else ""
            raise VLLMEngineError(
                f"{who}the weight push left {', '.join(sorted(missing)[:3])} unloaded after a level-2 sleep "
                f"discarded them; set vllm_kwargs.sleep: false for this policy and report this"
            )
        # level 2 only where vLLM can say what a push missed: its check runs for unquantised models, and
        # its log line must reach us (a logging level above WARNING or logging.disable would hide it)
        quantized = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "quantization", None)
        self.full_push = self.full_push or (observed and not missing and quantized is None)
        self.needs_push = False
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        if self.needs_push:
            raise VLLMEngineError(
                "vLLM engine: generation after a level-2 sleep without a weight push (Policy.sync_rollout_weights)"
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
        # the engine's global generators too (anything vLLM draws without a request seed)
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
        """Shut the engine down and free its memory (the next engine in this process may then start)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        del llm
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _check_in_process(llm) -> None:
    """The engine core must run in this process (the weight push hands tensors over directly)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and any(c.__name__ == "MPClient" for c in type(core).__mro__):
        raise VLLMEngineError(
            f"vLLM started its engine in another process ({type(core).__name__}); graft-rl needs it in-process "
            f"(VLLM_ENABLE_V1_MULTIPROCESSING=0, which it sets: something reset it)"
        )


@contextlib.contextmanager
def _unloaded_weights():
    """``(names vLLM's reload_weights reports as not loaded, whether its report can be seen)``, from its
    log line, read whatever the vLLM logging level (its own handlers still filter what is shown)."""
    import logging

    missing: set[str] = set()

    class _Catch(logging.Handler):
        def emit(self, record):
            if str(record.msg).startswith(_NOT_LOADED):
                arg = record.args[0] if isinstance(record.args, tuple) and record.args else record.args
                missing.update(arg if isinstance(arg, (set, list, tuple)) else {str(arg)})

    handler = _Catch(logging.WARNING)
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.WARNING)  # whatever VLLM_LOGGING_LEVEL says: the line is read here, not shown
    logger.disabled = False
    logger.addHandler(handler)
    observed = logging.root.manager.disable < logging.WARNING  # logging.disable(WARNING) hides it from everyone
    try:
        yield missing, observed
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled


def _reseed_worker(worker, seed: int) -> None:
    """Run in each vLLM worker (``collective_rpc``): seed the global generators its sampler may draw
    from (torch's, read by the V1 runner for unseeded requests; numpy's, from which the V2 runner
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


def make_backend(kind: str, policy) -> RolloutBackend:
    """``hf`` or ``vllm`` for a :class:`~graft_rl.policy.Policy`."""
    if kind == "hf":
        # a sharded policy samples from its unsharded float32 rollout copy (FSDP2), under autocast
        copy = getattr(policy, "rollout_model", None)
        return HFBackend(
            copy or policy.model,
            policy.eos_token_ids,
            policy.tokenizer.pad_token_id,
            policy.config.gen_batch_size,
            policy.autocast_context if copy is not None else policy.compute_context,
            stop=policy.config.stop,
            decode=lambda ids: policy.tokenizer.decode(ids, skip_special_tokens=True),
        )  # as the texts are
    if kind == "vllm":
        weights_fn = getattr(policy, "rollout_weights", None)  # a sharded policy's gathered full weights
        return VLLMBackend(
            policy.model,
            policy.model_dir,
            dtype=policy.config.dtype,
            weights_fn=weights_fn,
            stop=policy.config.stop,
            name=policy.name,
            **policy.config.vllm_kwargs,
        )
    raise ValueError(f"unknown rollout backend {kind!r}; use 'hf' or 'vllm'")
