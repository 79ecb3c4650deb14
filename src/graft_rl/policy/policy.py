"""A policy unit: one model + its tokenizer + optimizer (SPEC §4 layer 3).

It formats prompts its own way (chat template, or plain text for base models), generates
groups through a rollout backend, scores any (prompt, response text) pair under its *own*
tokenisation, takes minibatch optimiser steps with micro-batching, and saves/loads itself
in ``save_pretrained`` format (so transformers and vLLM load checkpoints directly).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from graft_rl.data import PROMPT_SUFFIX, make_prompt
from graft_rl.policy import zoo
from graft_rl.policy.heads import logprob_head
from graft_rl.policy.rollout import make_backend, shield_from_vllm_patches
from graft_rl.policy.types import RolloutGroup, SamplingParams, TokenBatch

__all__ = [
    "POLICY_SETTINGS", "length_micro_batches", "PASS_OVERHEAD", "Policy", "PolicyConfig", "PolicyError", "saved_policy_config", "PromptTooLongError", "auto_micro_batch_tokens", "disable_dropout",
    "token_logprobs_from_logits",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: File in every saved policy directory holding the policy's settings (prompt format etc.).
POLICY_SETTINGS = "graft_policy.json"


def saved_policy_config(model_dir: str | Path, **overrides) -> PolicyConfig | None:
    """The :class:`PolicyConfig` a checkpoint was saved with (its ``graft_policy.json``), pointed at
    ``model_dir`` and run as one process; None if the directory has no such file."""
    import dataclasses
    import json

    f = Path(model_dir).expanduser() / POLICY_SETTINGS
    if not f.is_file():
        return None
    saved = json.loads(f.read_text())
    known = {fl.name for fl in dataclasses.fields(PolicyConfig)}
    kw = {k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k in known}
    kw.update(model=str(model_dir), world_size=1)
    kw.update(overrides)
    return PolicyConfig(**kw)


class PolicyError(ValueError):
    """A policy that cannot be built as configured; the message names the field or path."""


class PromptTooLongError(PolicyError):
    pass


@dataclass(frozen=True)
class PolicyConfig:
    """Everything that defines one policy. Optimiser defaults are the paper's Table 3."""

    name: str
    model: str  # a save_pretrained directory, or a GGUF file / directory with gguf_file
    gguf_file: str | None = None  # GGUF file name inside `model` (or None)
    tokenizer: str | None = None  # tokenizer directory if not beside the model
    # compute dtype (forward/backward matmuls). Trainable weights and AdamW state stay in
    # `master_dtype`, float32 by default, as verl/FSDP mixed precision does (SPEC §2 Precision).
    dtype: str = "float32"  # float32 | bfloat16 | float16
    # float32 (default). Setting it equal to a low-precision `dtype` is pure low-precision training,
    # an explicit opt-in: at the paper's lr 1e-6 most bf16 weights never change (Adam steps below
    # half an ulp), see docs/benchmarks.md "Paper-scale path".
    master_dtype: str = "float32"
    # recompute each decoder layer's activations in backward (transformers' gradient checkpointing):
    # activation memory ~ one layer instead of all layers; on in the paper presets
    gradient_checkpointing: bool = False
    # GPUs (ranks) this policy is sharded over with FSDP2 (execution: ray); 1 = one process
    world_size: int = 1
    device: str = "cpu"
    prompt_format: str = "auto"  # auto (chat if the tokenizer has a template) | chat | plain
    plain_template: str = "{prompt}\n"  # used by `plain`; {prompt} is the problem + suffix
    system_prompt: str | None = None
    prompt_suffix: str | None = PROMPT_SUFFIX
    # strings that end a response as EOS does (kept in it): "\n\n" for a base model under a few-shot
    # prompt, which would otherwise write the next example's question and answer, whose \boxed{} the
    # verifier would read as the response's last. Matched in the decoded text, however it is tokenised
    stop: list[str] = field(default_factory=list)
    max_prompt_tokens: int = 2048
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    # padded (sequences x length) tokens per forward pass; None = from the vocabulary size, so the
    # logits of one pass stay near LOGITS_BUDGET_BYTES (16384 for small vocabularies, ~1k for Gemma's 262k)
    micro_batch_tokens: int | None = None
    # tokens per LM-head chunk when scoring: log-probs of the sampled tokens are computed from
    # `logprob_chunk` hidden states at a time (checkpointed), never from [tokens x vocab] logits
    logprob_chunk: int = 512
    # the chunked LM head above; false = logits_to_keep + chunked log-softmax; None = chunked when a
    # micro-batch's logits would exceed FUSED_HEAD_ABOVE_BYTES (large vocabularies), else plain (faster)
    fused_logprobs: bool | None = None
    # rows (prompt x sample) per HF generate call; None = as many as fit GEN_MEMORY_BUDGET_BYTES of
    # KV cache (policy.rollout.auto_gen_batch_rows: a testbed step's 256 rows at once, ~70 of SmolLM2 at 512 tokens)
    gen_batch_size: int | None = None
    # the KL reference (method.kl_coef > 0): None = the weights this policy starts from; a resumed
    # run points it at the original model so the reference stays the initial policy
    reference_model: str | None = None
    reference_gguf_file: str | None = None
    backend: str = "hf"  # hf | vllm
    vllm_kwargs: dict = field(default_factory=dict)
    # world_size > 1: every rank samples its share of the prompts (rows rank, rank + W, ...) with a
    # seed of its own (default). True: rank 0 samples the whole batch with the run's seed, as one
    # process does (a sharded run then equals a one-process run: for checking sharding; slower)
    rollout_on_rank0: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise PolicyError(f"policy {self.name!r}: dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.master_dtype not in ("float32", self.dtype):
            raise PolicyError(
                f"policy {self.name!r}: master_dtype must be float32 (mixed precision) or equal to dtype "
                f"{self.dtype!r} (pure low precision, opt-in), got {self.master_dtype!r}"
            )
        if self.world_size < 1:
            raise PolicyError(f"policy {self.name!r}: world_size must be >= 1, got {self.world_size}")
        if not (0 < self.lr < math.inf):  # NaN fails too
            raise PolicyError(f"policy {self.name!r}: lr must be a finite number > 0, got {self.lr}")
        if not (0 < self.max_grad_norm < math.inf) or not (0 <= self.weight_decay < math.inf):
            raise PolicyError(f"policy {self.name!r}: max_grad_norm must be > 0 and weight_decay >= 0, got "
                              f"{self.max_grad_norm}, {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise PolicyError(f"policy {self.name!r}: betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.logprob_chunk < 1:
            raise PolicyError(f"policy {self.name!r}: logprob_chunk must be >= 1, got {self.logprob_chunk}")
        if self.prompt_format not in ("auto", "chat", "plain"):
            raise PolicyError(f"policy {self.name!r}: prompt_format must be auto, chat or plain, got {self.prompt_format!r}")
        if "{prompt}" not in self.plain_template:
            raise PolicyError(f"policy {self.name!r}: plain_template must contain {{prompt}}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(x, str) and x for x in self.stop):
            raise PolicyError(f"policy {self.name!r}: stop must be a list of non-empty strings, got {self.stop!r}")
        if self.gen_batch_size is not None and self.gen_batch_size < 1:
            raise PolicyError(f"policy {self.name!r}: gen_batch_size must be >= 1 (or null for automatic), got {self.gen_batch_size}")
        tp = self.vllm_kwargs.get("tensor_parallel_size", 1) if isinstance(self.vllm_kwargs, dict) else 1
        if tp != 1:
            raise PolicyError(
                f"policy {self.name!r}: vllm_kwargs.tensor_parallel_size={tp} is not supported: each vLLM engine lives in "
                f"one rank actor with one GPU; shard the policy with world_size (every rank's engine samples its share)"
            )
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise PolicyError(f"policy {self.name!r}: micro_batch_tokens must be >= 1 (or null for automatic), got {self.micro_batch_tokens}")


#: Bytes of float32 logits one forward pass may produce when ``micro_batch_tokens`` is automatic.
LOGITS_BUDGET_BYTES = 1 << 30


#: With ``fused_logprobs`` automatic, the LM head is chunked when one micro-batch's float32 logits
#: would exceed this (SmolLM2's 49k and Gemma's 262k vocabularies); below it the plain logits path
#: is cheaper (no recomputation in backward): the testbed's 259 tokens take 17 MB.
FUSED_HEAD_ABOVE_BYTES = 256 << 20


def uses_fused_head(setting: bool | None, vocab_size: int, micro_batch_tokens: int) -> bool:
    """Whether scoring goes through the chunked LM head (before the model's own self-check)."""
    if setting is not None:
        return setting
    return micro_batch_tokens * vocab_size * 4 > FUSED_HEAD_ABOVE_BYTES


def auto_micro_batch_tokens(vocab_size: int, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
    """Padded tokens per forward pass so that ``tokens x vocab`` float32 logits fit ``budget_bytes``.

    Clamped to [512, 16384]: e.g. 16384 for the testbed's 38-320 token vocabularies, 5461 for
    SmolLM2's 49k, 1024 for Gemma 3's 262k.
    """
    return max(512, min(16384, budget_bytes // (4 * max(vocab_size, 1))))


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """``log softmax(logits)[target]`` for ``[B, L, V]`` logits and ``[B, L]`` targets, in float32.

    Computed ``chunk`` positions at a time as ``logit[target] - logsumexp(logits)``, so the
    full float32 ``[B, L, V]`` log-softmax never exists at once (Gemma's 262k vocabulary
    would need 18.5 GB for a 16 x 192 batch).
    """
    out = []
    for s in range(0, logits.shape[1], chunk):
        part = logits[:, s : s + chunk].float()
        tgt = targets[:, s : s + chunk]
        out.append(part.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - part.logsumexp(-1))
    return torch.cat(out, dim=1) if out else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


#: A forward/backward pass's fixed cost, in tokens' worth of compute, as a share of the pass budget:
#: kernel launches, reading the weights, FSDP's all-gather of each layer. A planning figure: on an
#: H200 a 3B model's 32k-token pass takes ~1 s, its all-gathers ~10-20 ms.
PASS_OVERHEAD = 1 / 64


def length_micro_batches(lengths: Sequence[int], budget: int, ranks: int = 1,
                         overhead: float = PASS_OVERHEAD) -> list[list[int]]:
    """Rows in forward passes of at most ``budget`` padded tokens per rank (rows x longest row),
    formed by length; with ``ranks`` > 1 each pass is dealt over the ranks (rows ``r, r + ranks, ...``
    of it to rank ``r``), which run it in lock step (FSDP's collectives).

    A pass pads every row to its longest, so passes are runs of the rows sorted by length (longest
    first, ties in arrival order): some optimal split is such a run (swapping a longer row of a
    shorter-max pass with a shorter row of a longer-max pass never costs more), and over runs the
    split minimising ``computed tokens + overhead x budget x passes`` is exact by dynamic
    programming. Each pass then holds rows of similar length: its padding is what one length class
    differs by, not what the batch's shortest and longest responses differ by (math RL responses run
    from tens of tokens to the 4,096 cap). A batch that fits one pass stays one pass in arrival
    order; a row longer than ``budget`` is a pass of its own. The loss does not depend on the order
    (every pass scores its rows by index); ``benchmarks/padding.py`` measures useful / computed tokens.
    """
    n = len(lengths)
    if n == 0:
        return []
    if max(lengths) * -(-n // ranks) <= budget:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -lengths[i])
    ln = [lengths[i] for i in order]
    fixed = overhead * budget
    best = [0.0] + [math.inf] * n  # best[j]: cost of the j longest rows in passes
    cut = [0] * (n + 1)
    for i in range(n):  # a pass starting at row i (its longest) takes rows i .. j-1
        rows = max(1, budget // ln[i]) * ranks
        base = best[i] + fixed
        for j in range(i + 1, min(n, i + rows) + 1):
            c = base + -(-(j - i) // ranks) * ranks * ln[i]  # every rank computes the pass's widest share
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j] : j])
        j = cut[j]
    return out[::-1]


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout: ``nn.Dropout`` modules and the float ``*dropout*`` attributes that
    attention layers read in train mode (so train mode, needed by gradient checkpointing, computes
    exactly what eval mode does)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr, val in list(vars(module).items()):
            if "dropout" in attr and isinstance(val, float):
                setattr(module, attr, 0.0)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for attr in list(vars(cfg)):
            if ("dropout" in attr or attr.endswith("pdrop")) and isinstance(getattr(cfg, attr), float):
                setattr(cfg, attr, 0.0)


def _is_hub_id(name: str) -> bool:
    """``org/name`` (a Hugging Face hub id, fetched by transformers where a network allows it)."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not Path(name.split("/")[0]).exists()


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class Policy:
    """One trainable model with its tokenizer, optimiser and rollout backend."""

    def __init__(self, config: PolicyConfig, with_reference: bool = False):
        """``with_reference``: load the frozen KL reference too (:meth:`init_reference`), before the
        rollout engine is built (see :func:`~graft_rl.policy.rollout.shield_from_vllm_patches`)."""
        from transformers import AutoTokenizer

        _quiet_transformers()
        self.config = config
        self.name = config.name
        path, gguf = self._resolve(config.model, config.gguf_file)
        self.model_dir = path
        tok_path = Path(config.tokenizer) if config.tokenizer else path
        if not path.exists():  # a hub id: keep it a string for transformers
            path = config.model  # type: ignore[assignment]
            tok_path = config.tokenizer or config.model  # type: ignore[assignment]
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_path, gguf_file=gguf if not config.tokenizer else None)
        except Exception as exc:
            where = f"{tok_path}" + (f" (gguf_file={gguf})" if gguf and not config.tokenizer else "")
            raise PolicyError(f"policy {config.name!r}: no usable tokenizer at {where}: {type(exc).__name__}: {exc}") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if config.prompt_format == "chat" and not self.tokenizer.chat_template:
            raise PolicyError(f"policy {config.name!r}: prompt_format 'chat' but the tokenizer at {tok_path} has no chat template")
        self.compute_dtype = _DTYPES[config.dtype]
        self.master_dtype = _DTYPES[config.master_dtype]
        self.model = self._load_model(path, gguf)
        self.model.to(config.device)
        # no dropout anywhere: log-probs must be deterministic functions of the weights, in eval
        # mode and in the train mode that gradient checkpointing needs
        disable_dropout(self.model)
        self.model.eval()
        if config.gradient_checkpointing:
            if not getattr(self.model, "supports_gradient_checkpointing", False):
                raise PolicyError(f"policy {config.name!r}: {type(self.model).__name__} does not support gradient_checkpointing")
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.use_chat = config.prompt_format == "chat" or (config.prompt_format == "auto" and bool(self.tokenizer.chat_template))
        self.eos_token_ids = self._eos_ids()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=tuple(config.betas),
            weight_decay=config.weight_decay,
        )
        head = self.model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else len(self.tokenizer)
        self.micro_batch_tokens = config.micro_batch_tokens or auto_micro_batch_tokens(vocab)
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.reference = None  # the frozen KL reference, once init_reference() ran
        self.weights_version, self._synced_version = 0, 0  # optimiser steps taken / pushed to the rollout engine
        # logits are divided by this before every log-softmax that scores or trains (SPEC §2: the
        # rollout temperature, as verl does), so ratios and compatibility use the sampling distribution
        self.logprob_temperature = 1.0
        self._setup_parallel()
        self.fused_head = (uses_fused_head(config.fused_logprobs, vocab, self.micro_batch_tokens) and self._keeps_logits
                           and self._fused_head_matches())
        if with_reference:
            self.init_reference()
        self.backend = make_backend(config.backend, self)
        if config.backend == "vllm":  # the engine may have patched this process's transformers classes
            shield_from_vllm_patches(self.model, self.reference, getattr(self, "rollout_model", None))

    def _setup_parallel(self) -> None:
        """Hook for sharded subclasses (FSDP2): called after the model is built, before any forward."""
        if self.config.world_size > 1:
            raise PolicyError(
                f"policy {self.name!r}: world_size={self.config.world_size} needs execution: ray "
                "(each rank a Ray actor; see README 'Paper scale')"
            )

    def compute_context(self):
        """Autocast to the compute dtype when the master weights are float32 (mixed precision)."""
        return self.autocast_context()

    def autocast_context(self):
        """Autocast to the compute dtype when the master weights are float32; the ``hf`` rollout copy
        of a sharded policy (float32, unsharded) samples under it too."""
        if self.compute_dtype == self.master_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.config.device).type, dtype=self.compute_dtype)

    @torch.no_grad()
    def _fused_head_matches(self) -> bool:
        """Self-check of the chunked LM head on a fixed input: equal to the model's own logits?

        False for models that transform logits after the head (e.g. final soft-capping); those
        score through ``logits_to_keep`` and a chunked log-softmax instead.
        """
        head = self.model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.weight.shape[0] < 2:
            return False
        ids = torch.arange(1, 9).remainder(head.weight.shape[0])[None].to(self.config.device)
        batch = TokenBatch([ids[0, :3].tolist()], [ids[0, 3:].tolist()])
        naive = self._forward(batch, fused=False)
        fused = self._forward(batch, fused=True)
        tol = 1e-4 if self.compute_dtype == torch.float32 else 5e-2
        return bool(torch.allclose(naive, fused, atol=tol, rtol=0))

    def _resolve(self, model: str, gguf: str | None) -> tuple[Path, str | None]:
        """``(directory, gguf file or None)`` of a model path, GGUF file, ``zoo:`` name or hub id."""
        try:
            path = Path(zoo.resolve(model)).expanduser()
        except FileNotFoundError as exc:
            raise PolicyError(f"policy {self.name!r}: {exc}") from None
        if not path.exists() and not _is_hub_id(model):
            raise PolicyError(f"policy {self.name!r}: model path {model!r} does not exist")
        if gguf is None and path.is_file() and path.suffix == ".gguf":
            path, gguf = path.parent, path.name
        return path, gguf

    def _load_model(self, path, gguf: str | None):
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=_DTYPES[self.config.master_dtype])
        except Exception as exc:
            raise PolicyError(f"policy {self.name!r}: cannot load model from {path}: {type(exc).__name__}: {exc}") from None
        if gguf:  # a dequantised GGUF model: drop the quantizer marker so save_pretrained works
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.is_quantized = False
        return model

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(gen_eos)
        if self.use_chat:
            im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
                ids.add(im_end)
        return sorted(i for i in ids if i is not None)

    # ------------------------------------------------------------------ prompts
    def format_prompt(self, problem: str) -> str:
        """The full text this model is conditioned on: chat template or plain template."""
        user = make_prompt(problem, self.config.prompt_suffix)
        if self.use_chat:
            msgs = ([{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []) + [
                {"role": "user", "content": user}
            ]
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.config.plain_template.replace("{prompt}", user)

    def context_length(self) -> int | None:
        """The model's context in tokens (``max_position_embeddings`` / ``n_positions``), if it states one."""
        c = getattr(getattr(self, "model", None), "config", None)
        return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)

    def prompt_token_ids(self, problem: str, prompt_id: str = "") -> list[int]:
        text = self.format_prompt(problem)
        ids = self.tokenizer(text, add_special_tokens=not self.use_chat).input_ids
        if len(ids) > self.config.max_prompt_tokens:
            raise PromptTooLongError(
                f"policy {self.name!r}: prompt {prompt_id or problem[:40]!r} has {len(ids)} tokens, "
                f"over max_prompt_tokens={self.config.max_prompt_tokens}"
            )
        return ids

    # ------------------------------------------------------------------ rollouts
    def generate(
        self, prompts: Sequence[tuple[str, str]], sampling: SamplingParams, seed: int = 0
    ) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for each ``(prompt_id, problem)``."""
        ids = [self.prompt_token_ids(p, pid) for pid, p in prompts]
        ctx = self.context_length()
        if ctx is not None and ids and max(map(len, ids)) + sampling.max_new_tokens > ctx:
            # a response never runs past the model's positions (a learned-position model would index out
            # of its table); the rows stop at the context with finish_reason "length", as in vLLM
            left = ctx - max(map(len, ids))
            if left < 1:
                raise PromptTooLongError(f"policy {self.name!r}: a prompt has {max(map(len, ids))} tokens, "
                                         f"over the model's {ctx}-token context")
            sampling = replace(sampling, max_new_tokens=left)
        self.sync_rollout_weights()  # one weight push per step, not one per minibatch update
        samples = self.backend.generate(ids, sampling, seed)
        groups = []
        for (pid, problem), group in zip(prompts, samples, strict=True):
            groups.append(
                RolloutGroup(
                    prompt_id=pid,
                    prompt=problem,
                    policy=self.name,
                    texts=[self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group],
                    token_ids=[s.token_ids for s in group],
                    gen_logprobs=[s.logprobs for s in group],
                    finish_reasons=[s.finish_reason for s in group],
                )
            )
        return groups

    # ------------------------------------------------------------------ tokenisation
    def encode_own(self, groups: Sequence[RolloutGroup]) -> TokenBatch:
        """This policy's own responses with their generated token ids (no re-tokenisation)."""
        prompts, responses = [], []
        for g in groups:
            if g.policy != self.name:
                raise PolicyError(f"policy {self.name!r}: encode_own got a group generated by {g.policy!r}")
            p = self.prompt_token_ids(g.prompt, g.prompt_id)
            prompts.extend([p] * g.n)
            responses.extend(g.token_ids)
        return TokenBatch(prompts, responses)

    def encode_texts(self, problems: Sequence[str], responses: Sequence[str], finished: Sequence[bool],
                     max_tokens: int | None = None) -> TokenBatch:
        """Re-tokenise response *texts* after this policy's own prompt formatting (SPEC §2).

        EOS: a response that stopped on its own gets *this* policy's EOS appended
        (:meth:`end_token_ids`: its chat end-of-turn token under a chat template, its first stop
        string if it has any and the text does not end in one already), because the source's stop token does not survive
        decoding to text, and without it a finished answer would read to the receiver as a cut-off
        prefix: the receiver learns to stop where the source stopped, as its own finished responses
        do. A truncated response gets none.

        Length: a response is cut to ``max_tokens`` (the receiver's own ``max_new_tokens``) and to
        what the model's context leaves after the prompt, tokens counted in *this* tokenizer (a
        peer's 4,096 tokens can be more here). A cut response has no EOS; :attr:`TokenBatch.cut`
        lists the cut rows (the trainer leaves them out of the loss).
        """
        if not (len(problems) == len(responses) == len(finished)):
            raise PolicyError("encode_texts: problems, responses and finished differ in length")
        cache: dict[str, list[int]] = {}
        end = self.end_token_ids()
        ctx = self.context_length()
        prompt_ids, response_ids, cut = [], [], []
        for row, (prob, text, done) in enumerate(zip(problems, responses, finished, strict=True)):
            if prob not in cache:
                cache[prob] = self.prompt_token_ids(prob)
            ends = done and not (self.config.stop and text.endswith(tuple(self.config.stop)))  # ends in a stop string already
            ids = self.tokenizer(text, add_special_tokens=False).input_ids + (end if ends else [])
            cap = min(max_tokens or len(ids), (ctx - len(cache[prob])) if ctx else len(ids))
            if len(ids) > cap:
                ids = ids[: max(cap, 0)]
                cut.append(row)
            prompt_ids.append(cache[prob])
            response_ids.append(ids)
        return TokenBatch(prompt_ids, response_ids, cut)

    def end_token_ids(self) -> list[int]:
        """What this policy ends its own responses with: its first ``stop`` string's tokens if it has
        any, else its chat end-of-turn token under a chat template, else its EOS."""
        if self.config.stop:
            return self.tokenizer(self.config.stop[0], add_special_tokens=False).input_ids
        return [self._chat_eos() if self.use_chat else self.tokenizer.eos_token_id]

    def _chat_eos(self) -> int:
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end in self.eos_token_ids:
            return im_end
        return self.tokenizer.eos_token_id

    # ------------------------------------------------------------------ log-probs
    def _micro_batches(self, batch: TokenBatch) -> list[list[int]]:
        """Row lists of the forward passes over ``batch``: :func:`length_micro_batches` within
        ``micro_batch_tokens`` padded tokens per pass."""
        return length_micro_batches(batch.lengths(), self.micro_batch_tokens)

    def _forward(self, batch: TokenBatch, model=None, fused: bool | None = None) -> torch.Tensor:
        """Response-token log-probs ``[M, T]`` (float32) for a batch that fits one forward pass.

        ``fused`` (default: :attr:`fused_head`) scores through the chunked LM head
        (:mod:`graft_rl.policy.heads`); otherwise the logits of the response positions are built.
        """
        model = self.model if model is None else model
        fused = self.fused_head if fused is None else fused
        device = self.config.device
        seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
        L = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id
        inp = torch.full((len(seqs), L), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: positions start at 0 for every row
            inp[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        inp, attn = inp.to(device), attn.to(device)
        # only positions from the earliest response start on predict response tokens: skip the
        # prompt-only positions' logits (with long prompts they dominate the [B, L, V] tensor)
        starts = [len(p) - 1 for p in batch.prompt_ids]
        first = min(starts)
        targets = inp[:, first + 1 :]
        with self.compute_context():
            if fused:  # hidden state k (position first + k) predicts token first + k + 1
                with logprob_head(model, targets, self.config.logprob_chunk, self.logprob_temperature):
                    lp_all = model(input_ids=inp, attention_mask=attn, use_cache=False, logits_to_keep=L - first).logits[..., 0]
            else:
                if self._keeps_logits:
                    logits = model(input_ids=inp, attention_mask=attn, use_cache=False, logits_to_keep=L - first).logits
                else:
                    logits = model(input_ids=inp, attention_mask=attn, use_cache=False).logits[:, first:]
                if self.logprob_temperature != 1.0:
                    logits = logits / self.logprob_temperature
                # logits[:, k] is position first + k and predicts token first + k + 1
                lp_all = token_logprobs_from_logits(logits[:, :-1], targets, self.config.logprob_chunk)
        T = batch.max_response_len
        rel = torch.tensor(starts, device=device) - first
        idx = (rel[:, None] + torch.arange(T, device=device)[None, :]).clamp(max=max(L - 2 - first, 0))
        mask = batch.response_mask().to(device)
        return lp_all.gather(1, idx) * mask

    @torch.no_grad()
    def token_logprobs(self, batch: TokenBatch, model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score every response under this policy: ``(logprobs [M, T], mask [M, T])`` on CPU, float32.

        Micro-batched by ``micro_batch_tokens``; no gradient. ``model`` scores with another
        module sharing this tokenizer (the frozen reference of :meth:`init_reference`).
        """
        T = batch.max_response_len
        out = torch.zeros(len(batch), T)
        for rows in self._passes(batch):
            lp = self._forward(batch.select(rows or [0]), model).cpu()
            if rows is not None:
                out[rows, : lp.shape[1]] = lp
        return self._gather_rows(out), batch.response_mask()

    # hooks a sharded policy overrides (policy.fsdp): which micro-batches this process runs, and
    # how per-process results combine. One process: all micro-batches, nothing to combine.
    def _passes(self, batch: TokenBatch) -> list[list[int] | None]:
        """Row lists of the forward passes this process runs; ``None`` is a padding pass (result unused)."""
        return self._micro_batches(batch)

    def _gather_rows(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Combine the rows each process scored into the full ``[M, T]`` matrix."""
        return logprobs

    def _reduce_sums(self, values: list[float]) -> list[float]:
        """Sum per-process scalars over the processes of this policy."""
        return values

    #: each micro-batch's loss is multiplied by this before backward (FSDP averages over ranks)
    loss_scale = 1.0

    def init_reference(self) -> None:
        """Load the frozen KL reference: ``config.reference_model`` if set (a resumed run's original
        model), else a copy of the weights as loaded (call before any update)."""
        import copy

        if self.reference is not None:
            return
        if self.config.reference_model:
            path, gguf = self._resolve(self.config.reference_model, self.config.reference_gguf_file)
            ref = self._load_model(path if path.exists() else self.config.reference_model, gguf).to(self.config.device)
        else:
            ref = copy.deepcopy(self.model)
        self.reference = ref.eval().requires_grad_(False)

    def reference_logprobs(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_logprobs` under the frozen reference (:meth:`init_reference` first)."""
        if self.reference is None:
            raise PolicyError(f"policy {self.name!r}: no reference model; call init_reference() before training")
        return self.token_logprobs(batch, self.reference)

    def score_texts(self, problems: Sequence[str], responses: Sequence[str], finished: Sequence[bool] | None = None):
        """Convenience: :meth:`encode_texts` then :meth:`token_logprobs`."""
        finished = [True] * len(responses) if finished is None else finished
        return self.token_logprobs(self.encode_texts(problems, responses, finished))

    # ------------------------------------------------------------------ optimisation
    def update(
        self,
        batch: TokenBatch,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, list[int]], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """One optimiser step on a minibatch, with gradient accumulation over micro-batches.

        ``loss_fn(logprobs [m, T_m], mask [m, T_m], rows)`` returns this micro-batch's
        *contribution* to the minibatch loss (the caller scales token-mean losses by
        ``micro tokens / minibatch tokens``) and a stats dict. A non-finite loss or gradient
        norm skips the step (``skipped = 1``) and leaves the weights untouched.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.gradient_checkpointing:
            self.model.train()  # transformers checkpoints layers only in train mode (dropout is off)
        try:
            total_loss, stats_sum, n_micro, bad = self._accumulate(batch, loss_fn)
        finally:
            self.model.eval()
        grad_norm = self._clip_grad_norm()
        if bad or not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return {"loss": float("nan"), "grad_norm": grad_norm, "skipped": 1.0}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_version += 1
        out = {k: v / max(n_micro, 1) for k, v in stats_sum.items()}
        out.update(loss=total_loss, grad_norm=grad_norm, skipped=0.0)
        return out

    def _accumulate(self, batch: TokenBatch, loss_fn):
        """Forward + backward of each micro-batch; ``(loss, stats sums, micro-batches, non-finite?)``.

        A padding pass, or one whose loss is not finite, still runs a zero backward (a sharded
        policy's collectives need every rank to take part); a non-finite loss marks the whole
        update for skipping.
        """
        total_loss, stats_sum, n_micro, bad = 0.0, {}, 0, False
        for rows in self._passes(batch):
            sub = batch.select(rows or [0])
            lp = self._forward(sub)
            loss, stats = loss_fn(lp, sub.response_mask().to(lp.device), rows) if rows is not None else (None, {})
            if loss is None or bad or not torch.isfinite(loss):
                bad = bad or loss is not None
                (lp.sum() * 0.0).backward()
                continue
            (loss * self.loss_scale).backward()
            total_loss += float(loss.detach())
            n_micro += 1
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v)
        keys = sorted(stats_sum)
        sums = self._reduce_sums([total_loss, float(n_micro), float(bad)] + [stats_sum[k] for k in keys])
        return sums[0], dict(zip(keys, sums[3:], strict=True)), int(sums[1]), sums[2] > 0

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)) if params else 0.0

    def sync_rollout_weights(self) -> None:
        """Push the current weights to the rollout engine, once per step and only if they changed."""
        if self._synced_version != self.weights_version:
            self.backend.sync_weights()
            self._synced_version = self.weights_version

    def param_digest(self) -> list[float]:
        """Per-parameter sums (float64): a cheap fingerprint to compare weights across processes."""
        return [float(p.detach().double().sum()) for p in self.model.parameters()]

    def rollout_check(self, prompts: Sequence[tuple[str, str]], max_new_tokens: int = 16, seed: int = 0,
                      reference: dict | None = None) -> dict:
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
    def save(self, out_dir: str | Path) -> Path:
        """``save_pretrained`` model + tokenizer, ``graft_policy.json`` (how this policy formats
        prompts, so ``graft eval CHECKPOINT`` prompts it as training did), and ``policy_state.pt``
        (optimiser, RNG)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        self.save_settings(out)
        state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        tmp = out / "policy_state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, out / "policy_state.pt")
        return out

    def save_settings(self, out: Path) -> None:
        """Write ``graft_policy.json``: this policy's config (prompt format, template, suffix, lengths,
        backend, dtype), read back by :func:`saved_policy_config`."""
        import dataclasses
        import json

        keep = {k: v for k, v in dataclasses.asdict(self.config).items()
                if k not in ("model", "gguf_file", "tokenizer", "reference_model", "reference_gguf_file")}
        (Path(out) / POLICY_SETTINGS).write_text(json.dumps(keep, indent=1))

    def load_state(self, ckpt_dir: str | Path) -> None:
        """Restore optimiser and RNG from :meth:`save` (weights come from loading the directory)."""
        state = torch.load(Path(ckpt_dir) / "policy_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
