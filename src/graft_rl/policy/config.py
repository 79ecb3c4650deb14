"""A policy's configuration (``policies:`` in a run's config; `graft config show policies`): its model, tokenizer,
optimiser, precision, devices and rollout backend, and the defaults derived from its vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graft_rl.data import PROMPT_SUFFIX
from graft_rl.policy.lora import LoraSettings
from graft_rl.policy.training import POLICY_SETTINGS
from graft_rl.policy.types import PolicyError

__all__ = [
    "PolicyConfig",
    "saved_policy_config",
    "auto_micro_batch_tokens",
    "uses_fused_head",
    "LOGITS_BUDGET_BYTES",
    "FUSED_HEAD_ABOVE_BYTES",
]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PolicyConfig:
    """Everything that defines one policy. Optimiser defaults are the paper's Table 3."""

    name: str  # the policy's name in metrics, records and checkpoints (unique in a run)
    model: str  # a save_pretrained directory, or a GGUF file / directory with gguf_file
    gguf_file: str | None = None  # GGUF file name inside `model` (or None)
    tokenizer: str | None = None  # tokenizer directory if not beside the model
    # compute dtype (forward/backward matmuls). Trainable weights and AdamW state stay in
    # `master_dtype`, float32 by default, as verl/FSDP mixed precision does (docs/fidelity.md).
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
    device: str = "cpu"  # cpu | cuda (a rank of a sharded policy takes the GPU Ray gives it)
    prompt_format: str = "auto"  # auto (chat if the tokenizer has a template) | chat | plain
    plain_template: str = "{prompt}\n"  # used by `plain`; {prompt} is the problem + suffix
    system_prompt: str | None = None  # a system message before the problem (chat format only)
    # appended to every problem (the paper's "Let's think step by step and output ... \boxed{}.")
    prompt_suffix: str | None = PROMPT_SUFFIX
    # strings that end a response as EOS does (kept in it): "\n\n" for a base model under a few-shot
    # prompt, which would otherwise write the next example's question and answer, whose \boxed{} the
    # verifier would read as the response's last. Matched in the decoded text, however it is tokenised
    stop: list[str] = field(default_factory=list)
    max_prompt_tokens: int = 2048  # a longer prompt stops the run before step 1, naming it
    lr: float = 1e-6  # AdamW learning rate (Table 3)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    weight_decay: float = 0.01  # AdamW weight decay
    # gradient norm clip per update; null: no clip (the norm is still computed and logged; SAPO's presets)
    max_grad_norm: float | None = 1.0
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
    # KV cache (policy.hf_backend.auto_gen_batch_rows: a testbed step's 256 rows at once, ~70 of SmolLM2 at 512 tokens)
    gen_batch_size: int | None = None
    # the KL reference (method.kl_coef > 0): None = the weights this policy starts from; a resumed
    # run points it at the original model so the reference stays the initial policy
    reference_model: str | None = None
    reference_gguf_file: str | None = None  # GGUF file name inside reference_model
    backend: str = "hf"  # hf | vllm
    vllm_kwargs: dict = field(default_factory=dict)  # extra vllm.LLM(...) arguments (backend: vllm)
    # world_size > 1: every rank samples its share of the prompts (rows rank, rank + W, ...) with a
    # seed of its own (default). True: rank 0 samples the whole batch with the run's seed, as one
    # process does (a sharded run then equals a one-process run: for checking sharding; slower)
    rollout_on_rank0: bool = False
    # low-rank adapters (peft) on a frozen base: {r, alpha, target_modules}; null = every weight trains.
    # The base is held in `dtype`, the adapters' masters and AdamW state in `master_dtype`; the KL
    # reference is the base (adapter disabled). Adapters want a larger lr (about 10x: docs/benchmarks.md, "LoRA against full fine-tuning")
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        self._check_lora()
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
        clip_ok = self.max_grad_norm is None or 0 < self.max_grad_norm < math.inf
        if not clip_ok or not (0 <= self.weight_decay < math.inf):
            raise PolicyError(
                f"policy {self.name!r}: max_grad_norm must be > 0 (or null: no clip) and weight_decay >= 0, got "
                f"{self.max_grad_norm}, {self.weight_decay}"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise PolicyError(f"policy {self.name!r}: betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.logprob_chunk < 1:
            raise PolicyError(f"policy {self.name!r}: logprob_chunk must be >= 1, got {self.logprob_chunk}")
        if self.prompt_format not in ("auto", "chat", "plain"):
            raise PolicyError(
                f"policy {self.name!r}: prompt_format must be auto, chat or plain, got {self.prompt_format!r}"
            )
        if "{prompt}" not in self.plain_template:
            raise PolicyError(f"policy {self.name!r}: plain_template must contain {{prompt}}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(x, str) and x for x in self.stop):
            raise PolicyError(f"policy {self.name!r}: stop must be a list of non-empty strings, got {self.stop!r}")
        if self.gen_batch_size is not None and self.gen_batch_size < 1:
            raise PolicyError(
                f"policy {self.name!r}: gen_batch_size must be >= 1 (or null for automatic), got {self.gen_batch_size}"
            )
        tp = self.vllm_kwargs.get("tensor_parallel_size", 1) if isinstance(self.vllm_kwargs, dict) else 1
        if tp != 1:
            raise PolicyError(
                f"policy {self.name!r}: vllm_kwargs.tensor_parallel_size={tp} is not supported: each vLLM engine lives in "
                f"one rank actor with one GPU; shard the policy with world_size (every rank's engine samples its share)"
            )
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise PolicyError(
                f"policy {self.name!r}: micro_batch_tokens must be >= 1 (or null for automatic), got {self.micro_batch_tokens}"
            )

    @property
    def grad_clip(self) -> float:
        """The norm gradients are clipped to: ``max_grad_norm``, or infinity for none (``clip_grad_norm_``
        then only measures: its factor is exactly 1)."""
        return math.inf if self.max_grad_norm is None else self.max_grad_norm

    def _check_lora(self) -> None:
        """``lora`` as :class:`LoraSettings` (from a mapping); without a second KL reference model."""
        try:
            object.__setattr__(self, "lora", LoraSettings.of(self.lora))
        except PolicyError as exc:
            raise PolicyError(f"policy {self.name!r}: {exc}") from None
        if self.lora is not None and self.reference_model:
            raise PolicyError(
                f"policy {self.name!r}: reference_model is not used with lora (the KL reference is the base with "
                "the adapter disabled); remove one of them"
            )


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
