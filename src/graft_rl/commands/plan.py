"""``graft plan CONFIG``: memory per GPU and GPUs per policy, before anything is loaded.

Estimates, per policy sharded with FSDP2 over ``world_size`` GPUs (full sharding, fp32 master
weights, fp32 gradients, AdamW's two fp32 moments, ``dtype`` compute):

=====================  =========================================================================
state                  bytes per GPU
=====================  =========================================================================
master + grad + Adam   ``16 N / W``  (4 + 4 + 8 bytes per parameter, sharded)
compute copy           ``c (N_root + 2 N_layer)``: FSDP gathers the root (embeddings, head, final
                       norm) and at most two decoder layers (one computing, one prefetched) in the
                       compute dtype (``c`` bytes), and their compute-dtype gradients in backward
                       (x2)
activations            with checkpointing: ``c t H L`` (each layer's input) + one layer's
                       recomputed internals ``c t (8 H + 4 I)``; without: ``L`` times the latter
logits chunk           ``k V (c + 4 + 4)``: one chunk of ``k = logprob_chunk`` tokens (compute
                       logits, float32 copy, float32 gradient); naive scoring would need ``t V``
                       of each instead
KL reference           ``4 N / W`` when ``method.kl_coef > 0`` (HACPO rows): the frozen initial
                       weights, sharded like the master weights
LoRA (``lora``)        the frozen base ``c N / W`` in the compute dtype plus ``16 A / W`` for the
                       ``A`` adapter parameters (masters, gradients, Adam); no base gradients in
                       the compute copy; no KL reference (the base with the adapter disabled)
hf rollout copy        ``4 N`` on every rank of a sharded policy with the ``hf`` backend (an
                       unsharded float32 copy, sampled under autocast), held throughout
vLLM (generation)      with ``sleep`` the engine frees its memory during training and the
                       trainer's state stays; during generation the engine's share of the GPU
                       (``gpu_memory_utilization``: its weights ``c N``, a workspace, the KV cache)
                       lives beside the master weights and Adam moments
runtime                :data:`RUNTIME_BYTES` per GPU (CUDA context, NCCL buffers, cuBLAS
                       workspaces) and :data:`ALLOCATOR_MARGIN` of the tensors' peak (the caching
                       allocator's retained, fragmented blocks): stated margins, not measured here
=====================  =========================================================================

``t`` = ``micro_batch_tokens`` (padded tokens per forward pass), ``H`` hidden size, ``I``
MLP size, ``L`` layers, ``V`` vocabulary. Model shapes come from the model's ``config.json``
when it is a local directory, else from the published configs of the paper's models below.

KV cache: an awake engine holds ``(share x GPU - c N - workspace) / (2 L kv_heads head_dim c)``
tokens; a step asks each rank for ``prompt_batch / W x (P + n x max_new_tokens)`` at most (prefix
caching keeps one copy of a prompt's ``P`` <= :data:`PROMPT_TOKENS` tokens for its ``n`` samples).
When the second is larger, vLLM runs the step's sequences in waves (the plan says how many at most,
and what they cost: each wave is ``max_new_tokens`` decode steps, each reading the engine's ``c N``
weights at :data:`DECODE_BYTES_PER_S`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from graft_rl.engine.config import ConfigError, TrainConfig
from graft_rl.engine.resources import one_engine_per_process
from graft_rl.policy import PolicyConfig
from graft_rl.policy.config import auto_micro_batch_tokens, uses_fused_head
from graft_rl.policy.lora import LoraSettings
from graft_rl.policy.vllm_backend import VLLM_MEMORY_SHARE

__all__ = [
    "ModelShape",
    "PolicyPlan",
    "plan",
    "format_plan",
    "KNOWN_SHAPES",
    "eval_estimate",
    "EVAL_TOKENS_PER_GPU_S",
    "RUNTIME_BYTES",
    "ALLOCATOR_MARGIN",
    "PROMPT_TOKENS",
    "ENGINE_WORKSPACE_BYTES",
    "StepWork",
    "step_work",
    "suggest_split",
    "format_pace",
    "TRAIN_FLOPS_PER_GPU_S",
    "GEN_FLOPS_PER_GPU_S",
    "DECODE_BYTES_PER_S",
    "lora_params",
]

#: Planning figure for ``graft eval``'s throughput: generated tokens per second per GPU for a 1.7-3B
#: model in bf16 under vLLM on an H100/H200 class GPU with hundreds of sequences in flight. An
#: assumption (not measured in this project: no GPU has run it), on the low side of what a decode
#: bound by memory bandwidth allows; scale the estimate by your own measured figure.
EVAL_TOKENS_PER_GPU_S = 10_000

GiB = 1 << 30

#: Per GPU, outside the tensors the plan counts: the CUDA context (~0.5-0.8 GiB on H100/H200), NCCL's
#: communication buffers and cuBLAS/cuDNN workspaces. A stated margin (typical figures), not measured here.
RUNTIME_BYTES = 1.5 * GiB

#: The PyTorch caching allocator keeps freed blocks and fragments: planned as this share of the tensors' peak.
ALLOCATOR_MARGIN = 0.10

#: vLLM's own non-KV memory beside its weights while awake (activations of a max-size batch, sampler
#: buffers, CUDA graphs): a planning figure.
ENGINE_WORKSPACE_BYTES = 2 * GiB

#: Planning figure for a decode step's floor: the engine reads all its weights once per generated token
#: of a wave, at this memory bandwidth (RTX 4090 ~1.0, L40S 0.86, A6000 0.77, H100 3.35, H200 4.8 TB/s).
#: An assumption, not measured here.
DECODE_BYTES_PER_S = 2e12

#: Prompt tokens planned per prompt for the KV cache (a MATH prompt with the paper's suffix is ~100-300).
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @property
    def layer_params(self) -> int:
        H, hd = self.hidden, self.head_dim
        attn = H * self.heads * hd + 2 * H * self.kv_heads * hd + self.heads * hd * H
        return attn + 3 * H * self.intermediate + 2 * H

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.root_params + self.layers * self.layer_params


#: Published ``config.json`` shapes of the paper's models (Hugging Face model cards), so that a
#: plan needs no download. Parameter counts they give: 3.08 B, 1.72 B, 3.21 B; SAPO's 0.49 B.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "HuggingFaceTB/SmolLM3-3B-Base": ModelShape(2048, 36, 11008, 128256, 16, 4, 128, True),
    "Qwen/Qwen3-1.7B-Base": ModelShape(2048, 28, 6144, 151936, 16, 8, 128, True),
    "OctoThinker/OctoThinker-3B-Hybrid-Base": ModelShape(3072, 28, 8192, 128256, 24, 8, 128, True),
    # SAPO's swarm model (configs/sapo/): 0.49 B (its attention biases, 0.2 M, not counted)
    "Qwen/Qwen2.5-0.5B": ModelShape(896, 24, 4864, 151936, 14, 2, 64, True),
    # the PyPI-shipped GGUF models of graft_rl.policy.zoo: 134.5 M and 268 M parameters
    "zoo:smollm2-135m-instruct": ModelShape(576, 30, 1536, 49152, 9, 3, 64, True),
    "zoo:gemma3-270m": ModelShape(640, 18, 2048, 262144, 4, 1, 256, True),
}

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: A decoder layer's linear layers: (name, fan in, fan out) from a shape (``lora_params``).
_LINEARS = {
    "q_proj": lambda s: (s.hidden, s.heads * s.head_dim),
    "k_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "v_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "o_proj": lambda s: (s.heads * s.head_dim, s.hidden),
    "gate_proj": lambda s: (s.hidden, s.intermediate),
    "up_proj": lambda s: (s.hidden, s.intermediate),
    "down_proj": lambda s: (s.intermediate, s.hidden),
}


def lora_params(s: ModelShape, lora: LoraSettings) -> int:
    """Adapter parameters: ``r (fan in + fan out)`` per adapted linear layer of every decoder layer
    (``all-linear``: all seven of a Llama-style layer; a list: those of its names the table knows)."""
    names = _LINEARS if lora.target_modules == "all-linear" else [n for n in lora.target_modules if n in _LINEARS]
    return s.layers * sum(lora.r * sum(_LINEARS[n](s)) for n in names)


def model_shape(pc: PolicyConfig) -> ModelShape:
    """The shape of a policy's model: its local ``config.json`` (a shipped ``zoo:`` directory
    included), else :data:`KNOWN_SHAPES`."""
    model = pc.model
    if model.startswith("zoo:") and model not in KNOWN_SHAPES:
        from graft_rl.policy import zoo

        try:
            model = zoo.resolve(model)
        except FileNotFoundError as exc:
            raise ConfigError(f"policy {pc.name!r}: {exc}") from None
    cfg_file = Path(model).expanduser() / "config.json"
    if cfg_file.is_file():
        c = json.loads(cfg_file.read_text())
        c = c.get("text_config", c)
        H = c.get("hidden_size") or c.get("n_embd")
        heads = c.get("num_attention_heads") or c.get("n_head")
        return ModelShape(
            hidden=H,
            layers=c.get("num_hidden_layers") or c.get("n_layer"),
            intermediate=c.get("intermediate_size") or c.get("n_inner") or 4 * H,
            vocab=c["vocab_size"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or H // heads,
            tied=bool(c.get("tie_word_embeddings", True)),
        )
    if pc.model in KNOWN_SHAPES:
        return KNOWN_SHAPES[pc.model]
    raise ConfigError(f"policy {pc.name!r}: no config.json at {pc.model} and no published shape known; plan needs one")


@dataclass
class PolicyPlan:
    name: str
    params: int
    world_size: int
    sharded_state: float  # bytes per GPU: master + grads + Adam
    compute_copy: float
    activations: float
    activations_no_ckpt: float
    logits_chunk: float
    naive_logits: float
    train_peak: float  # the tensors at the training peak (runtime and allocator margin not included)
    vllm_weights: float  # an engine's compute-dtype weights (0: hf backend)
    gradient_checkpointing: bool
    vllm_share: float = 0.0  # gpu_memory_utilization of an awake engine (0 = hf backend)
    sleep: bool = True
    reference: float = 0.0  # the sharded frozen KL reference (method.kl_coef > 0)
    hf_copy: float = 0.0  # a sharded hf policy's unsharded float32 rollout copy, on every rank
    kv_bytes_per_token: float = 0.0
    rollout_tokens: float = 0.0  # per rank per step, every response at max_new_tokens
    resident: float = 0.0  # bytes per GPU kept between updates: master weights + Adam (LoRA: base + adapters')
    lora_params: int = 0  # adapter parameters (0: full fine-tuning)
    reference_saved: float = 0.0  # a LoRA policy's KL reference that needs no copy (kl_coef > 0)
    wave_seconds: float = 0.0  # one generation wave's floor: max_new_tokens decode steps reading c N each
    lora_alternative: PolicyPlan | None = None  # full fine-tuning: the same policy with lora r=16, all-linear
    quantized: bool = False  # a quantised engine (vllm_kwargs.quantization): it sleeps at level 1 throughout
    lag: int = 0  # rollout.lag: pushes the engine lags by
    lag_host: float = 0.0  # host bytes per rank of the lag history: lag + 1 copies of the trainable fp32 params

    def generate_peak(self, gpu_bytes: float) -> float:
        """Tensors during generation: master weights + Adam (gradients are freed after each update),
        the KL reference and hf rollout copy if any, plus an awake vLLM engine's share of the GPU."""
        resident = self.resident + self.reference + self.hf_copy
        return resident + (self.vllm_share * gpu_bytes if self.vllm_share else 0.0)

    def waves(self, gpu_bytes: float) -> float | None:
        """Generation waves a step needs at most (None: hf backend)."""
        kv = self.kv_tokens(gpu_bytes)
        if kv is None:
            return None
        return -(-self.rollout_tokens // kv) if kv > 0 else float("inf")

    def training_peak(self, gpu_bytes: float) -> float:
        """Tensors at the training peak; an engine that does not sleep keeps its share of the GPU."""
        return self.train_peak + (self.vllm_share * gpu_bytes if self.vllm_share and not self.sleep else 0.0)

    def peak(self, gpu_bytes: float) -> float:
        """The planned per-GPU peak: the larger phase's tensors, plus the allocator margin and the runtime."""
        return (
            max(self.training_peak(gpu_bytes), self.generate_peak(gpu_bytes)) * (1 + ALLOCATOR_MARGIN) + RUNTIME_BYTES
        )

    def kv_tokens(self, gpu_bytes: float) -> float | None:
        """Tokens an awake engine's KV cache holds on one GPU (None: hf backend)."""
        if not self.vllm_share or not self.kv_bytes_per_token:
            return None
        free = self.vllm_share * gpu_bytes - self.vllm_weights - ENGINE_WORKSPACE_BYTES
        return max(free, 0.0) / self.kv_bytes_per_token

    @property
    def gpus(self) -> int:
        return self.world_size


def plan_policy(pc: PolicyConfig, cfg: TrainConfig) -> PolicyPlan:
    s = model_shape(pc)
    c = _BYTES[pc.dtype]
    W = pc.world_size
    N = s.params
    t = budget_tokens = pc.micro_batch_tokens or auto_micro_batch_tokens(s.vocab)
    t = min(t, pc.max_prompt_tokens + cfg.max_new_tokens) if pc.micro_batch_tokens is None else t
    A = lora_params(s, pc.lora) if pc.lora is not None else 0
    if pc.lora is None:
        sharded, resident = 16 * N / W, 12 * N / W
        compute = 2 * c * (s.root_params + 2 * s.layer_params)
    else:  # the base frozen in the compute dtype; the adapters' masters, gradients and Adam in float32
        sharded, resident = c * N / W + 16 * A / W, c * N / W + 12 * A / W
        compute = c * (s.root_params + 2 * s.layer_params) + 2 * c * A / max(s.layers, 1)
    layer_internal = c * t * (8 * s.hidden + 4 * s.intermediate)
    act_ckpt = c * t * s.hidden * s.layers + layer_internal
    act_full = s.layers * layer_internal
    k = pc.logprob_chunk
    chunk = k * s.vocab * (c + 8)
    naive = t * s.vocab * (c + 8)
    act = act_ckpt if pc.gradient_checkpointing else act_full
    logits = chunk if uses_fused_head(pc.fused_logprobs, s.vocab, budget_tokens) else naive
    vllm = c * N if pc.backend == "vllm" else 0.0
    share = float(pc.vllm_kwargs.get("gpu_memory_utilization", VLLM_MEMORY_SHARE)) if pc.backend == "vllm" else 0.0
    sleep = bool(pc.vllm_kwargs.get("sleep", True))
    reference = 4 * N / W if cfg.method.kl_coef > 0 and pc.lora is None else 0.0
    saved = 4 * N / W if cfg.method.kl_coef > 0 and pc.lora is not None else 0.0
    copy = 4 * N if pc.lora is None else c * N + 4 * A
    hf_copy = copy if pc.backend == "hf" and W > 1 else 0.0  # one process samples from its own model
    kv = 2 * s.layers * s.kv_heads * s.head_dim * c
    rollout = cfg.prompt_batch / W * (min(PROMPT_TOKENS, pc.max_prompt_tokens) + cfg.n * cfg.max_new_tokens)
    return PolicyPlan(
        pc.name,
        N,
        W,
        sharded,
        compute,
        act_ckpt,
        act_full,
        chunk,
        naive,
        sharded + compute + act + logits + reference + hf_copy,
        vllm,
        pc.gradient_checkpointing,
        share,
        sleep,
        reference,
        hf_copy,
        kv,
        rollout,
        resident,
        A,
        saved,
        cfg.max_new_tokens * c * N / DECODE_BYTES_PER_S if pc.backend == "vllm" else 0.0,
        quantized=pc.backend == "vllm" and bool(pc.vllm_kwargs.get("quantization")),
        lag=cfg.rollout.lag,
        lag_host=(cfg.rollout.lag + 1) * 4 * (A if pc.lora is not None else N) / W if cfg.rollout.lag else 0.0,
    )


def plan(cfg: TrainConfig) -> list[PolicyPlan]:
    from dataclasses import replace

    out = []
    for pc in cfg.policies:
        p = plan_policy(pc, cfg)
        if pc.lora is None:
            p.lora_alternative = plan_policy(replace(pc, lora=LoraSettings()), cfg)
        out.append(p)
    return out


def format_plan(plans: list[PolicyPlan], gpu_gib: float = 141.0, shared: bool = False) -> str:
    """A Markdown table (GiB per GPU), the KV cache against a step's rollouts, and the GPUs the run
    needs; ``shared``: the policies run in one process on one device (``execution: local``), so
    their memory adds up on it."""
    G = gpu_gib * GiB
    head = (
        "| policy | params | GPUs | master+grad+Adam | compute copy | activations (ckpt / none) | logits chunk "
        "(naive) | KL ref + hf copy | train peak | generate peak | + runtime, margin | fits |"
    )
    lines = [head, "|" + "---|" * 12]
    for p in plans:
        act = f"{p.activations / GiB:.1f} / {p.activations_no_ckpt / GiB:.1f}"
        fits = "yes" if p.peak(G) <= G else "NO"
        lines.append(
            f"| {p.name} | {p.params / 1e9:.2f} B | {p.gpus} | {p.sharded_state / GiB:.1f} | {p.compute_copy / GiB:.1f} | "
            f"{act} | {p.logits_chunk / GiB:.2f} ({p.naive_logits / GiB:.1f}) | {(p.reference + p.hf_copy) / GiB:.1f} | "
            f"{p.training_peak(G) / GiB:.1f} | {p.generate_peak(G) / GiB:.1f} | {p.peak(G) / GiB:.1f} | {fits} |"
        )
    lines.append("")
    lines.append(
        f"+ runtime, margin: the larger peak + {ALLOCATOR_MARGIN:.0%} (caching allocator) + "
        f"{RUNTIME_BYTES / GiB:g} GiB (CUDA context, NCCL, workspaces): stated margins, not measured."
    )
    for p in plans:
        kv, waves = p.kv_tokens(G), p.waves(G)
        if kv is None or waves is None:
            continue
        verdict = (
            "fits in one wave"
            if waves <= 1
            else f"up to {waves:.0f} waves of generation, each at least ~{p.wave_seconds:.0f} s "
            f"(~{waves * p.wave_seconds / 60:.0f} min a step; vLLM queues the rest; raise gpu_memory_utilization "
            f"or world_size to cut them)"
        )
        lines.append(
            f"{p.name}: KV cache ~{kv / 1e6:.2f} M tokens per rank (gpu_memory_utilization {p.vllm_share:g}) vs "
            f"up to {p.rollout_tokens / 1e6:.2f} M per rank per step (every response at max_new_tokens): {verdict}."
        )
    lines += _lora_lines(plans, G)
    lines += _host_lines(plans)
    if shared:
        engines = [p.name for p in plans if p.vllm_share]
        if len(engines) > 1:
            lines.append(f"execution local: NOT supported as configured: {one_engine_per_process(engines)}.")
        peak = sum(p.peak(G) for p in plans)
        lines.append(
            f"execution local: the policies share one device, about {peak / GiB:.1f} GiB at peak in all "
            f"({'fits' if peak <= G else 'does NOT fit'} a GPU of {gpu_gib:g} GiB)."
        )
        return "\n".join(lines)
    total = sum(p.gpus for p in plans)
    lines.append(
        f"GPUs: {total} in all ({', '.join(f'{p.name}: {p.gpus}' for p in plans)}); "
        f"a GPU of {gpu_gib:g} GiB; train peak = master+grad+Adam + compute copy + activations "
        f"({'with' if all(p.gradient_checkpointing for p in plans) else 'as configured:'} checkpointing) + logits chunk "
        f"+ KL reference + hf rollout copy."
    )
    return "\n".join(lines)


def _host_lines(plans: list[PolicyPlan]) -> list[str]:
    """Host memory a sleeping vLLM engine keeps per rank (pinned, in torch's host cache): the CUDA-graph
    pool's copy at both sleep levels (its size is vLLM's, not estimated here), and a level-1 sleep's copy
    of the weights, released at the first level-2 sleep, but kept for the run by a quantised engine."""
    lines = []
    for p in plans:
        if p.lag:
            what = "adapters" if p.lora_params else "parameters"
            lines.append(
                f"{p.name}: host RAM per rank for rollout.lag {p.lag}: {p.lag + 1} float32 copies of its trainable "
                f"{what}, ~{p.lag_host / GiB:.2f} GiB (each checkpoint holds them too, ~{p.lag_host * p.world_size / GiB:.2f} GiB)."
            )
        if not (p.vllm_share and p.sleep):
            continue
        weights = p.vllm_weights / GiB
        if p.quantized:
            held = f"its weights' copy, ~{weights:.1f} GiB, stays for the run (a quantised engine sleeps at level 1)"
        else:
            held = f"its weights' level-1 copy (~{weights:.1f} GiB) only until the first level-2 sleep"
        lines.append(
            f"{p.name}: host RAM per rank while its engine sleeps: the CUDA-graph pool's pinned copy, plus {held}."
        )
    return lines


def _lora_lines(plans: list[PolicyPlan], G: float) -> list[str]:
    """LoRA policies: adapter size and the KL reference they need not hold; a full fine-tuning policy that
    does not fit: whether LoRA (r=16, all-linear) would, and at how many generation waves."""
    lines = []
    for p in plans:
        if p.lora_params:
            ref = (
                f"; its KL reference is the base with the adapter disabled: {p.reference_saved / GiB:.1f} GiB per GPU not held"
                if p.reference_saved
                else ""
            )
            lines.append(
                f"{p.name}: LoRA, {p.lora_params / 1e6:.1f} M adapter parameters ({p.lora_params / p.params:.2%} of "
                f"{p.params / 1e9:.2f} B) train; the base stays frozen in the compute dtype{ref}."
            )
        alt = p.lora_alternative
        if alt is not None and p.peak(G) > G:
            w = alt.waves(G)
            at = f", at up to {w:.0f} generation waves a step" if w is not None and w > 1 else ""
            fits = "fits" if alt.peak(G) <= G else "does NOT fit either"
            lines.append(
                f"{p.name}: full fine-tuning does not fit a GPU of {G / GiB:g} GiB ({p.peak(G) / GiB:.1f} GiB); with "
                f"lora: {{r: 16, alpha: 32, target_modules: all-linear}} it {fits} ({alt.peak(G) / GiB:.1f} GiB{at})."
            )
    return lines


def eval_estimate(
    cfg: TrainConfig,
    samples: int = 8,
    runs: int = 5,
    typical_tokens: int = 1000,
    tokens_per_gpu_s: float = EVAL_TOKENS_PER_GPU_S,
) -> str | None:
    """One line: the time ``graft eval RUN_DIR`` needs with the paper's protocol (``samples`` x ``runs``
    on every problem of the run's validation sets) per checkpoint, on the run's GPUs, from
    :data:`EVAL_TOKENS_PER_GPU_S`; None when the run validates on nothing or runs on no GPU."""
    from graft_rl.data import DatasetError, load_dataset

    if not cfg.validation.data or not any(pc.device.startswith("cuda") for pc in cfg.policies):
        return None
    try:
        problems = sum(len(load_dataset(vs["data"], None, vs["columns"])) for vs in cfg.validation.sets())
    except DatasetError:
        return None
    gpus = cfg.devices
    responses = problems * samples * runs
    cap = cfg.validation.max_new_tokens

    def minutes(tokens: int) -> float:
        return responses * tokens / (tokens_per_gpu_s * gpus) / 60

    return (
        f"graft eval, paper protocol ({problems} problems x {samples} samples x {runs} runs = {responses:,} responses "
        f"per checkpoint, spread over the run's {gpus} GPU(s)): ~{minutes(typical_tokens):.0f} min at {typical_tokens:,} "
        f"tokens per response, ~{minutes(cap):.0f} min if every response runs to {cap:,}; per policy, assuming "
        f"{tokens_per_gpu_s:,.0f} generated tokens/s per GPU (vLLM, bf16; a planning figure, not measured here)."
    )


#: Planning figure for the update phase: achieved bf16 FLOP/s per GPU in forward + backward passes
#: (35 % of an H100/H200's 989 TFLOP/s dense bf16). An assumption, not measured here.
TRAIN_FLOPS_PER_GPU_S = 0.35 * 989e12

#: Planning figure for generation (decode is bound by memory bandwidth, not FLOPs): what
#: :data:`EVAL_TOKENS_PER_GPU_S` tokens/s of a 3 B model are in FLOPs (2 per parameter per token).
GEN_FLOPS_PER_GPU_S = 2 * 3e9 * EVAL_TOKENS_PER_GPU_S


@dataclass(frozen=True)
class StepWork:
    """One policy's FLOPs in a training step (every response at ``max_new_tokens``; attention's own
    FLOPs left out: ``2 N`` per token forward, ``6 N`` forward + backward, ``+2 N`` recomputed under
    gradient checkpointing)."""

    name: str
    gen_flops: float  # decode 2 N per generated token, prefill 2 N per prompt token (once per prompt)
    update_flops: float  # old log-probs 2 N (+2 N KL reference) and the update 6 N (+2 N recompute) per token

    def seconds(self, gpus: int) -> tuple[float, float]:
        """(generation, scoring + update) seconds on ``gpus`` GPUs at the planning figures."""
        return self.gen_flops / (GEN_FLOPS_PER_GPU_S * gpus), self.update_flops / (TRAIN_FLOPS_PER_GPU_S * gpus)

    def step_seconds(self, gpus: int) -> float:
        return sum(self.seconds(gpus))


def step_work(pc: PolicyConfig, cfg: TrainConfig) -> StepWork:
    N = model_shape(pc).params
    P, R = min(PROMPT_TOKENS, pc.max_prompt_tokens), cfg.max_new_tokens
    responses = cfg.prompt_batch * cfg.n
    gen = 2 * N * (responses * R + cfg.prompt_batch * P)
    tokens = responses * (P + R)  # own or grafted groups: a step trains on prompt_batch groups either way
    score = 2 * N * tokens * (2 if cfg.method.kl_coef > 0 else 1)
    update = (6 + (2 if pc.gradient_checkpointing else 0)) * N * tokens
    return StepWork(pc.name, gen, score + update)


def suggest_split(works: list[StepWork], gpus: int) -> tuple[list[int], float]:
    """The integer split of ``gpus`` (each policy >= 1) that minimises the slower policy's step time
    (the policies run concurrently under ``execution: ray``; the slower sets the step). Returns
    ``(GPUs per policy, that step time)``; ties keep the most even split."""
    best: tuple[float, int, list[int]] | None = None

    def splits(k: int, left: int):
        if k == 1:
            yield [left]
            return
        for g in range(1, left - k + 2):
            for rest in splits(k - 1, left - g):
                yield [g, *rest]

    for split in splits(len(works), gpus):
        t = max(w.step_seconds(g) for w, g in zip(works, split, strict=True))
        key = (float(f"{t:.9g}"), max(split) - min(split), split)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2], best[0]


def format_pace(cfg: TrainConfig, gpus: int | None = None, gpu_gib: float = 141.0) -> str:
    """Each policy's step time at the planning figures and, for ``execution: ray``, the split of
    ``gpus`` (default: the config's own total) that equalises the policies' pace, with its reasoning."""
    works = [step_work(pc, cfg) for pc in cfg.policies]
    have = [pc.world_size for pc in cfg.policies]
    lines = [
        f"Step time per policy (planning figures, not measured: updates at {TRAIN_FLOPS_PER_GPU_S / 1e12:.0f} "
        f"TFLOP/s per GPU, generation at {GEN_FLOPS_PER_GPU_S / 1e12:.0f} TFLOP/s, i.e. "
        f"{EVAL_TOKENS_PER_GPU_S:,} tokens/s of a 3 B model; every response at max_new_tokens {cfg.max_new_tokens:,}):"
    ]
    for w, g in zip(works, have, strict=True):
        gen, upd = w.seconds(g)
        lines.append(
            f"- {w.name}: ~{gen + upd:.0f} s on {g} GPU(s) (generation {gen:.0f} s, scoring + update {upd:.0f} s)"
        )
    if cfg.execution != "ray" or len(works) < 2:
        return "\n".join(lines)
    total = gpus or sum(have)
    if total != sum(have):  # compare with the even split of that many GPUs
        have = [total // len(works) + (1 if i < total % len(works) else 0) for i in range(len(works))]
    base = "as configured" if total == sum(pc.world_size for pc in cfg.policies) else "split evenly"
    now = max(w.step_seconds(g) for w, g in zip(works, have, strict=True))
    split, t = suggest_split(works, total)
    fits = []
    for pc, g in zip(cfg.policies, split, strict=True):
        from dataclasses import replace

        p = plan_policy(replace(pc, world_size=g), cfg)
        fits.append(p.peak(gpu_gib * GiB) <= gpu_gib * GiB)
    ratio = " : ".join(f"{w.step_seconds(1) / min(x.step_seconds(1) for x in works):.2f}" for w in works)
    why = (
        f"the policies' work per step is {ratio} ({', '.join(w.name for w in works)}); they run at once, so the "
        f"slower one sets the step and the other's GPUs wait"
    )
    if split == have or t >= now * 0.995:
        lines.append(
            f"GPU split: {' / '.join(map(str, have))} of {total} ({base}) is already the split with the shortest step ({why})."
        )
    else:
        overrides = " ".join(f"policies.{i}.world_size={g}" for i, g in enumerate(split))
        lines.append(
            f"GPU split: of {total} GPUs, {' / '.join(f'{w.name} {g}' for w, g in zip(works, split, strict=True))} "
            f"gives a step of ~{t:.0f} s against ~{now:.0f} s {base} ({' / '.join(map(str, have))}; {(1 - t / now):.0%} "
            f"less; {why}): {overrides}"
            + (
                ""
                if all(fits)
                else f" — but at that split {', '.join(pc.name for pc, f in zip(cfg.policies, fits, strict=True) if not f)} does NOT fit a {gpu_gib:g} GiB GPU"
            )
        )
    return "\n".join(lines)
