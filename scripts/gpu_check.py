"""GPU check of the paper-scale path, needing nothing but torch + transformers + this source tree.

    python scripts/gpu_check.py                  # on one GPU: ~0.5B Qwen3-shaped model, 152k vocabulary
    python scripts/gpu_check.py --smoke          # seconds, on CPU: the same code path at toy sizes
    python scripts/gpu_check.py --skip fsdp,trainer --out results/

Builds a randomly initialised Qwen3-shaped model from a config (nothing fetched from a hub),
then measures, each in its own row of a Markdown table (``--skip`` name in brackets):

1. [generate] ``hf`` generation (KV-cached sampler, bf16 compute over fp32 master weights): tokens/s;
2. [logprobs] old log-probs through the chunked LM head (``fused_logprobs=True``, so the
   toy vocabulary of ``--smoke`` takes the same path as the 152k one): tokens/s, peak memory;
3. [naive] the same scoring through full logits (``fused_logprobs=False``, the path the chunked
   head replaces): peak memory, max |Δ logp| against row 2;
4. [update] minibatch updates, bf16 compute / fp32 master / gradient checkpointing: tokens/s, peak
   memory, and the fraction of weights (with a gradient) that changed after 3 AdamW steps at lr 1e-6;
5. [pure] the same with pure bf16 weights (the opt-in the default avoids): fraction changed;
6. [fsdp] FSDP2 (``ShardedPolicy``, world size 1, NCCL; gloo on CPU): update tokens/s, peak memory,
   log-prob agreement with the single-process path;
7. [trainer] a 3-step GRAFT run of the trainer on the tiny heterogeneous pair, on the device
   (needs ``pyarrow``, for the rollout store); [gap] the same pair, 3 GRPO steps with ``correction:
   tis``: the engine-trainer gap a run reports (``mismatch_kl``, the TIS weights);
8. [vllm] two update → push → generate cycles, eager: every push verified against the trainer; on a
   GPU sleep level 1, then level 2 after the first verified push (only where ``import vllm`` works);
9. [vllm_graphs] the same with CUDA graphs (no ``enforce_eager``);
10. [vllm_seeds] per-request seeds alone: graft-rl's worker reseed off and the global generators set
   to other values before each call;
11. [vllm_missing] a push with one tensor held back must be refused, naming it;
12. [vllm_fsdp] a world-1 FSDP2 policy with its engine (NCCL with ``device_id``; gloo on CPU);
13. [vllm_two] the one-engine-per-process rule and an engine after ``close()``;
14. [vllm_transformers] vLLM's Transformers backend (``model_impl="transformers"``, the path SmolLM3
   takes): two update → push → generate cycles beside the trainer;
15. [lora_fsdp] LoRA on FSDP2 (world 1, NCCL), bf16, KL on, the KL reference's forward first;
16. [vllm_share] two engines of two processes on one GPU at 0.2 ``gpu_memory_utilization`` each, one
   looping sleep/wake while the other sleeps 30 times: no "Memory usage increased after sleeping";
17. [vllm_tied] a push that leaves out the tied alias ``lm_head.weight``, and one that zeroes it, must
   each be refused on the real engine; a full push then works;
18. [vllm_gpt2] a GPT-2 model (``Conv1D`` weights, held transposed by vLLM): two update → push →
   generate cycles, every push verified;
19. [vllm_rank_fault] two FSDP2 ranks (NCCL on two GPUs; gloo on CPU), each with its engine; rank 1's
   engine loader fails mid-push: both ranks must raise ``RankFault`` within ``FAULT_LIMIT`` seconds
   (skipped with one GPU: two NCCL ranks need two devices).

Each row is judged by its rules (``RULES``; docs/benchmarks.md lists them); each vLLM row runs in a
process of its own under ``--row-timeout``. The run ends with one ``gpu_check verdict: PASS|FAIL`` line.

The columns "fused head" say which scoring path each policy really took (``Policy.fused_head``).

Every row runs on its own: a row that raises records ``error: <type>: <first line>`` (traceback
on stderr) and the others still run; a row whose optional package is missing records
``skipped: needs <package>``. Each row is printed as it finishes, and with ``--out DIR`` (or
``$OUT``) ``gpu_check.md`` / ``gpu_check.json`` are rewritten after every row, so a crash or a
timeout keeps the rows done so far. Exit status 0 when no row failed, 1 otherwise.

Module-level imports are torch + transformers (+ their own dependencies) only; pyarrow, vllm and
other optional packages are imported inside the row that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from graft_rl.algo import policy_loss  # noqa: E402
from graft_rl.policy import Policy, PolicyConfig, SamplingParams, TokenBatch  # noqa: E402

#: --skip name -> row title, in the order the rows run
ROWS = {
    "generate": "generate (hf, bf16 compute)",
    "logprobs": "old log-probs, chunked LM head",
    "naive": "old log-probs, full logits (replaced path)",
    "update": "update, bf16 compute / fp32 master / ckpt",
    "pure": "update, pure bf16 (opt-in)",
    "fsdp": "update, FSDP2 (world 1, ShardedPolicy)",
    "trainer": "trainer: GRAFT, tiny pair, 3 steps",
    "gap": "engine-trainer gap: hf sampler vs trainer, bf16, 3 GRPO steps, tis",
    "lora": "update, LoRA (bf16 base frozen, fp32 adapters)",
    "vllm": "vLLM: 2 × update → push → generate (sleep 1 → 2), eager",
    "vllm_graphs": "vLLM: 2 × update → push → generate, CUDA graphs",
    "vllm_seeds": "vLLM: per-request seeds alone (no global reseed)",
    "vllm_lora": "vLLM: LoRA, 2 × update → merged push → generate (sleep 1 → 2)",
    "vllm_missing": "vLLM: a push with one tensor held back",
    "vllm_fsdp": "vLLM beside FSDP2 (world 1, NCCL device_id)",
    "vllm_two": "vLLM: two engines in one process",
    "vllm_transformers": "vLLM Transformers backend (SmolLM3): 2 × update → push → generate",
    "lora_fsdp": "LoRA on FSDP2 (world 1), bf16, KL reference forward first",
    "vllm_share": "vLLM: two engines of two processes on one GPU (0.2 each), sleep/wake",
    "vllm_tied": "vLLM: a push without, or with a zeroed, tied alias (lm_head.weight)",
    "vllm_gpt2": "vLLM: GPT-2 (Conv1D), 2 × update → push → generate",
    "vllm_rank_fault": "vLLM: a fault on one of two FSDP2 ranks mid-push",
}

#: seconds within which both ranks of ``vllm_rank_fault`` must have raised (the group's timeout: ``FAULT_TIMEOUT``)
FAULT_LIMIT = 60
FAULT_TIMEOUT = 600

#: import name -> pip name, where they differ
PIP_NAMES = {"math_verify": "math-verify", "reasoning_gym": "reasoning-gym"}


class Skip(Exception):
    """A row that cannot run here (a missing optional package): recorded as ``skipped``, not a failure."""


# ---------------------------------------------------------------------------------------- helpers
def build_model(out: Path, smoke: bool) -> Path:
    """The Qwen3-shaped model of the check (:func:`graft_rl.policy.tiny.build_tiny_model`, the package's
    one toy-model builder), with a byte-level tokenizer; nothing fetched from a hub."""
    from graft_rl.policy.tiny import build_tiny_model, char_tokenizer

    sh = model_shape(smoke)
    return build_tiny_model(
        out,
        "qwen3",
        char_tokenizer(),
        hidden=sh["hidden_size"],
        layers=sh["num_hidden_layers"],
        heads=sh["num_attention_heads"],
        max_positions=8192,
        seed=0,
        intermediate=sh["intermediate_size"],
        kv_heads=sh["num_key_value_heads"],
        head_dim=sh["head_dim"],
        vocab_size=sh["vocab_size"],
    )


def model_shape(smoke: bool) -> dict:
    if smoke:  # head_dim 32: the smallest vLLM's CPU attention supports
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=4096,
        )
    # Qwen3-0.6B's shape: 0.6 B parameters, 151,936-token vocabulary
    return dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def random_batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, prompt + response), generator=g)
    return TokenBatch([r[:prompt].tolist() for r in ids], [r[prompt:].tolist() for r in ids])


def loss_fn(old, adv, total_tokens):
    def fn(lp, mask, rows):
        loss, _ = policy_loss(lp, old[rows, : lp.shape[1]].to(lp.device), adv[rows].to(lp.device), mask)
        return loss * (float(mask.sum()) / total_tokens), {}

    return fn


def changed_fraction(pol: Policy, batch: TokenBatch, steps: int = 3) -> float:
    """Fraction of weights that receive a gradient and change value after ``steps`` AdamW steps."""
    old, mask = pol.token_logprobs(batch)
    adv = torch.linspace(-1, 1, len(batch))
    pol.optimizer.zero_grad(set_to_none=True)
    pol.accumulate(batch, loss_fn(old, adv, float(mask.sum())))
    touched = [
        (p.grad != 0) if p.grad is not None else torch.zeros_like(p, dtype=torch.bool) for p in pol.model.parameters()
    ]
    pol.optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in pol.model.parameters()]
    for _ in range(steps):
        pol.update(batch, loss_fn(old, adv, float(mask.sum())))
    changed = sum(
        int(((p.detach() != b) & t).sum()) for p, b, t in zip(pol.model.parameters(), before, touched, strict=True)
    )
    return changed / max(1, sum(int(t.sum()) for t in touched))


def timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300]}" if msg else type(exc).__name__


def missing_package(exc: BaseException) -> str | None:
    """The top-level name of a package that is not installed, if ``exc`` (or its cause) says so."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            top = exc.name.split(".")[0]
            if top not in ("graft_rl", "__main__"):
                return top
        exc = exc.__cause__ or exc.__context__
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- state
class Check:
    """What the rows share, built on first use so that any row can run (or fail) on its own."""

    def __init__(self, smoke: bool, device: str, tmp: Path, env: dict):
        self.smoke, self.device, self.tmp, self.env = smoke, device, tmp, env
        # sizes: responses of 2k-4k tokens on the GPU (the paper's lengths), toys in the smoke test
        self.rows, self.prompt, self.response = (4, 16, 48) if smoke else (8, 256, 3840)
        self.gen_prompts, self.gen_tokens = (4, 16) if smoke else (64, 512)
        self.mbt = 128 if smoke else 16384
        self.vocab = model_shape(smoke)["vocab_size"]
        self.batch = random_batch(self.vocab, self.rows, self.prompt, self.response)
        self.tokens = self.rows * (self.prompt + self.response)
        self._mdir: Path | None = None
        self._setup_error: str | None = None
        self.pol: Policy | None = None  # the main policy (chunked LM head); dropped after the update row
        self.old: tuple[torch.Tensor, torch.Tensor] | None = None  # its scores of `batch` before any update

    def mdir(self) -> Path:
        if self._setup_error:
            raise RuntimeError(f"model setup failed earlier: {self._setup_error}")
        if self._mdir is None:
            try:
                self._mdir = build_model(self.tmp / "qwen3", self.smoke)
            except Exception as exc:
                self._setup_error = one_line(exc)
                raise
        return self._mdir

    def base(self, **over) -> dict:
        cfg = dict(
            name="P",
            model=str(self.mdir()),
            device=self.device,
            dtype="bfloat16",
            lr=1e-6,
            micro_batch_tokens=self.mbt,
            gradient_checkpointing=True,
            max_prompt_tokens=8192,
            gen_batch_size=self.gen_prompts,
            fused_logprobs=True,
        )
        cfg.update(over)
        return cfg

    def policy(self) -> Policy:
        if self.pol is None:
            self.pol = Policy(PolicyConfig(**self.base()))
            n_params = sum(p.numel() for p in self.pol.model.parameters())
            self.env["model"] = (
                f"Qwen3-shaped, {n_params / 1e9:.3f} B parameters, vocabulary "
                f"{self.pol.model.config.vocab_size}, random init"
            )
            print(f"model: {self.env['model']}", flush=True)
        return self.pol

    def old_logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The main policy's log-probs of ``batch`` before any update (row 2 computes them when it runs)."""
        if self.old is None:
            self.old = self.policy().token_logprobs(self.batch)
        return self.old


# ---------------------------------------------------------------------------------------- rows
def row_generate(c: Check) -> dict:
    pol = c.policy()
    prompts = [list(range(5, 5 + c.prompt // 4))] * c.gen_prompts
    peak_reset(c.device)
    samples, dt = timed(
        lambda: pol.backend.generate(prompts, SamplingParams(n=1, max_new_tokens=c.gen_tokens), 0), c.device
    )
    made = sum(len(s.token_ids) for g in samples for s in g)
    return {"tokens": made, "seconds": dt, "tok/s": made / dt, "peak GiB": peak_gib(c.device)}


def row_logprobs(c: Check) -> dict:
    pol = c.policy()
    peak_reset(c.device)
    c.old, dt = timed(lambda: pol.token_logprobs(c.batch), c.device)
    return {
        "tokens": c.tokens,
        "seconds": dt,
        "tok/s": c.tokens / dt,
        "peak GiB": peak_gib(c.device),
        "fused head": pol.fused_head,
    }


def row_naive(c: Check) -> dict:
    old, _ = c.old_logprobs()
    naive = Policy(PolicyConfig(**c.base(name="N", fused_logprobs=False)))
    peak_reset(c.device)
    (old_n, _), dt = timed(lambda: naive.token_logprobs(c.batch), c.device)
    return {
        "tokens": c.tokens,
        "seconds": dt,
        "tok/s": c.tokens / dt,
        "peak GiB": peak_gib(c.device),
        "fused head": naive.fused_head,
        "max |Δ logp| vs chunked": float((old_n - old).abs().max()),
    }


def row_update(c: Check) -> dict:
    old, mask = c.old_logprobs()
    pol = c.policy()
    c.pol = None  # updated weights are no use to later rows: freed when this row ends
    adv = torch.linspace(-1, 1, c.rows)
    peak_reset(c.device)
    _, dt = timed(lambda: pol.update(c.batch, loss_fn(old, adv, float(mask.sum()))), c.device)
    peak = peak_gib(c.device)
    frac = changed_fraction(pol, c.batch)
    return {
        "tokens": c.tokens,
        "seconds": dt,
        "tok/s": c.tokens / dt,
        "peak GiB": peak,
        "fused head": pol.fused_head,
        "changed after 3 steps @ lr 1e-6": frac,
    }


def row_pure(c: Check) -> dict:
    pure = Policy(PolicyConfig(**c.base(master_dtype="bfloat16", name="B")))
    return {"fused head": pure.fused_head, "changed after 3 steps @ lr 1e-6": changed_fraction(pure, c.batch)}


def row_fsdp(c: Check) -> dict:
    import torch.distributed as dist

    from graft_rl.policy.fsdp import ShardedPolicy

    old_single, _ = c.old_logprobs()
    c.pol = None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if c.device.startswith("cuda") else "gloo", rank=0, world_size=1)
    try:
        pol = ShardedPolicy(PolicyConfig(**c.base(name="S", world_size=1)))
        peak_reset(c.device)
        (old, mask), _ = timed(lambda: pol.token_logprobs(c.batch), c.device)
        adv = torch.linspace(-1, 1, len(c.batch))
        _, dt = timed(lambda: pol.update(c.batch, loss_fn(old, adv, float(mask.sum()))), c.device)
        return {
            "tokens": c.tokens,
            "seconds": dt,
            "tok/s": c.tokens / dt,
            "peak GiB": peak_gib(c.device),
            "fused head": pol.fused_head,
            "max |Δ logp| vs single process": float((old - old_single).abs().max()),
        }
    finally:
        if own_group:
            dist.destroy_process_group()


def _tiny_run(c: Check, name: str, method: dict) -> list[dict]:
    """A 3-step run of the trainer on the tiny heterogeneous pair, on the device, bf16 compute."""
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer  # needs pyarrow (graft_rl.engine.store)
    from graft_rl.policy.tiny import build_tiny_pair

    c.pol = None
    tmp = c.tmp / name
    a, b = build_tiny_pair(tmp / "pair")
    data = tmp / "arith.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    pol = {"device": c.device, "dtype": "bfloat16", "lr": 1e-3, "gradient_checkpointing": True}
    cfg = load_config(
        {
            "run_dir": str(tmp / "run"),
            "steps": 3,
            "prompt_batch": 8,
            "minibatch": 2,
            "n": 4,
            "max_new_tokens": 8,
            "checkpoint_every": 3,
            "data": {"train": str(data), "verifier": "gsm8k"},
            "method": method,
            "policies": [{"name": "A", "model": str(a), **pol}, {"name": "B", "model": str(b), **pol}],
        }
    )
    return Trainer(cfg, show_progress=False).run()


def row_trainer(c: Check) -> dict:
    t0 = time.perf_counter()
    lines = _tiny_run(c, "trainer", {"name": "graft"})
    return {
        "seconds": time.perf_counter() - t0,
        "metric lines": len(lines),
        "finite losses": all(ln.get("loss") is None or ln["loss"] == ln["loss"] for ln in lines),
    }


def row_gap(c: Check) -> dict:
    """The engine-trainer gap as a run reports it: the hf sampler (KV-cached decode under bf16 autocast)
    against the trainer's full forward, 3 GRPO steps with ``correction: tis``."""
    lines = _tiny_run(c, "gap", {"name": "grpo", "correction": "tis"})
    kls = [ln["mismatch_kl"] for ln in lines if ln.get("mismatch_kl") is not None]
    weights = [ln["correction_weight"] for ln in lines if ln.get("correction_weight") is not None]
    return {
        "steps measured": len(kls),
        "max mismatch_kl": max(kls) if kls else None,
        "max |Δ logp|": max((ln["mismatch_max"] for ln in lines if ln.get("mismatch_max") is not None), default=None),
        "tis weight range": [min(weights), max(weights)] if weights else None,
    }


def need_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as exc:
        if missing_package(exc) == "vllm":
            raise Skip("vLLM not installed") from None
        raise


def _vllm_kwargs(c: Check, **extra) -> tuple[dict, str]:
    """Engine arguments at vLLM's defaults (on a GPU: its default model runner, CUDA graphs captured)."""
    gpu = c.device.startswith("cuda")
    kwargs = {"max_model_len": 1024, **({"gpu_memory_utilization": 0.25} if gpu else {}), **extra}
    return kwargs, ("bfloat16" if gpu else "float32")


def _runner(worker) -> str:
    """Run inside the engine's worker (``collective_rpc``): its model runner's class."""
    r = type(worker.model_runner)
    return f"{r.__module__.replace('vllm.v1.worker.', '')}.{r.__name__}"


#: the LoRA rows' adapters (policy.lora); lr 1e-4 so that 3 updates move every adapter weight
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}


def row_lora(c: Check) -> dict:
    """A LoRA policy on the GPU: base bf16 and frozen, adapters fp32; an update changes adapters only; the
    KL reference (adapter disabled) scores as the base; the merged weights score as base + adapter."""
    if importlib.util.find_spec("peft") is None:
        raise Skip("needs peft (pip install 'graft-rl[lora]')")
    pol = Policy(PolicyConfig(**c.base(name="L", lr=1e-4, lora=LORA)))
    dtypes = {n: p.dtype for n, p in pol.model.named_parameters()}
    layout = all(dt == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, dt in dtypes.items())
    base_before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if ".lora_" not in n}
    peak_reset(c.device)
    frac = changed_fraction(pol, c.batch)
    peak = peak_gib(c.device)
    frozen = all(torch.equal(base_before[n], p) for n, p in pol.model.named_parameters() if n in base_before)
    del base_before
    small = c.batch.select(range(min(2, len(c.batch))))
    ref, mask = pol.reference_logprobs(small)
    now, _ = pol.token_logprobs(small)
    with pol.lora.disable_adapter():
        base_lp, _ = pol.token_logprobs(small)
    merged = copy.deepcopy(pol.model)  # its base weights replaced by the merged ones, its adapters zeroed
    state = pol.rollout_state()
    with torch.no_grad():
        for n, t in merged.state_dict().items():
            if ".lora_B." in n:
                t.zero_()
            elif ".lora_" not in n:
                t.copy_(state[n.replace(".base_layer.", ".")])
    merged_lp, _ = pol.token_logprobs(small, model=merged)
    m = mask.bool()
    return {
        "base bf16, adapters fp32": layout,
        "adapter share of parameters": sum(p.numel() for n, p in pol.model.named_parameters() if ".lora_" in n)
        / sum(p.numel() for p in pol.model.parameters()),
        "changed after 3 steps @ lr 1e-4": frac,
        "base unchanged": frozen,
        "peak GiB": peak,
        "max |Δ logp| reference vs base": float((ref - base_lp).abs()[m].max()),
        "mean |Δ logp| merged vs adapted": float((merged_lp - now).abs()[m].mean()),
        "mean |Δ logp| adapted vs base": float((now - base_lp).abs()[m].mean()),
    }


#: |Δ logp| per token, engine vs trainer, a correct push stays under (bf16 on a GPU, float32 on CPU)
TOL_MEAN = {"bfloat16": 2e-2, "float32": 1e-3}


def _engine(
    c: Check, name: str, lr: float = 1e-3, lora: dict | None = None, model: Path | None = None, **extra
) -> tuple[Policy, float]:
    kwargs, dtype = _vllm_kwargs(c, **extra)
    t0 = time.perf_counter()
    cfg = c.base(name=name, backend="vllm", dtype=dtype, lr=lr, vllm_kwargs=kwargs, lora=lora)
    if model is not None:
        cfg["model"] = str(model)
    pol = Policy(PolicyConfig(**cfg))
    return pol, time.perf_counter() - t0


def _logp_gap(pol: Policy, groups, model=None) -> torch.Tensor:
    """Per-token |generation log-prob - trainer log-prob| of the engine's samples (``model``: other weights)."""
    lp, mask = pol.token_logprobs(pol.encode_own(groups), model=model)
    gen = torch.zeros_like(lp)
    for i, row in enumerate(x for g in groups for x in g.gen_logprobs):
        gen[i, : len(row)] = torch.tensor(row)
    return (lp - gen).abs()[mask.bool()]


def _cycles(
    c: Check, eager: bool, lora: dict | None = None, model: Path | None = None, batch: TokenBatch | None = None, **extra
) -> dict:
    """Two update → push → generate cycles; on a GPU the engine sleeps at level 1 from its start (its
    weights as loaded, or a LoRA policy's merged start push, serve until the first update) and at level 2
    once a push was verified, so each generation after an update wakes from level 2 (the weights
    discarded) behind a push. ``lora``: a LoRA policy, whose engine loads the base and is pushed the merged
    weights at start and at every push. ``model``/``extra``: another model directory, engine arguments."""
    need_vllm()
    if lora is not None and importlib.util.find_spec("peft") is None:
        raise Skip("needs peft (pip install 'graft-rl[lora]')")
    from vllm import LLM

    levels, pushes = [], []
    real_sleep = LLM.sleep  # every sleep from the engine's start on, the one in its constructor included
    LLM.sleep = lambda self, level=1, **kw: (levels.append(level), real_sleep(self, level=level, **kw))[1]
    try:
        # not eager: vLLM's own default, named, since graft-rl runs a CPU engine eagerly unless told
        # otherwise; the compiled model's reload is then checked on vLLM's CPU build too
        eager_kw = {"enforce_eager": eager}
        pol, start = _engine(c, "V", lr=1e-2 if lora else 1e-3, lora=lora, model=model, **eager_kw, **extra)
    finally:
        LLM.sleep = real_sleep
    try:
        if not pol.backend.sleep:
            levels = []
        else:  # recorded from here on through the instance
            pol.backend.llm.sleep = lambda level: (levels.append(level), real_sleep(pol.backend.llm, level=level))[1]
        push = pol.backend.sync_weights
        pol.backend.sync_weights = lambda: (pushes.append(1), push())[1]
        batch = batch or c.batch.select(range(min(2, len(c.batch))))  # ``batch``: a model of another vocabulary
        prompts = [("p1", "What is 2+3?"), ("p2", "6*7?")]
        sp = SamplingParams(n=2, max_new_tokens=16)
        res = {"engine start s": start, "model runner": pol.backend.llm.collective_rpc(_runner)[0]}
        for cycle in (1, 2):
            before = copy.deepcopy(pol.model).eval().requires_grad_(False)
            old, mask = pol.token_logprobs(batch)
            stats = pol.update(batch, loss_fn(old, torch.tensor([1.0, -1.0])[: len(batch)], float(mask.sum())))
            if stats.get("skipped"):
                raise RuntimeError(f"the update was skipped (non-finite loss or gradient): {stats}")
            groups = pol.generate(prompts, sp, seed=cycle)
            now, stale = _logp_gap(pol, groups), _logp_gap(pol, groups, model=before)
            res[f"cycle {cycle} mean |Δ logp| vs trainer"] = float(now.mean())
            res[f"cycle {cycle} max |Δ logp| vs trainer"] = float(now.max())
            res[f"cycle {cycle} mean |Δ logp| vs pre-update weights"] = float(stale.mean())
            del before
        res.update({"weight pushes": len(pushes), "sleep levels": levels or "n/a (sleep off)"})
        res["tolerance"] = TOL_MEAN[pol.config.dtype]
        return res
    finally:
        pol.close()


def row_vllm(c: Check) -> dict:
    return _cycles(c, eager=True)


def row_vllm_graphs(c: Check) -> dict:
    return _cycles(c, eager=False)


def row_vllm_lora(c: Check) -> dict:
    return _cycles(c, eager=True, lora=LORA)


def row_vllm_seeds(c: Check) -> dict:
    """Only the per-request seeds can make two calls agree: graft-rl's reseed of the workers' global
    generators is off, and torch's and numpy's global generators are set to other values before each call."""
    need_vllm()
    import numpy as np

    from graft_rl.seeding import rank_seed

    pol, start = _engine(c, "S")
    pol.backend.reseed_globals = False
    try:
        sp = SamplingParams(n=4, max_new_tokens=16)
        prompts = [("p1", "What is 2+3?"), ("p2", "What is 2+3?"), ("p3", "6*7?")]

        def ids(seed, noise):
            torch.manual_seed(noise)
            np.random.seed(noise)
            pol.backend.llm.collective_rpc(_set_globals, args=(noise,))
            return [g.token_ids for g in pol.generate(prompts, sp, seed=seed)]

        a, b = ids(5, 1), ids(5, 2)
        r0, r1 = ids(rank_seed(5, 0, 2), 3), ids(rank_seed(5, 1, 2), 3)
        return {
            "engine start s": start,
            "model runner": pol.backend.llm.collective_rpc(_runner)[0],
            "same seed, other global state → identical": a == b,
            "rank seeds, same global state → different": r0 != r1,
            "identical prompts → different groups": a[0] != a[1],
        }
    finally:
        pol.close()


def _set_globals(worker, seed: int) -> None:
    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)


def row_vllm_missing(c: Check) -> dict:
    """A push with one tensor held back must be refused (before anything is sampled); a full push then works."""
    need_vllm()
    from graft_rl.policy.vllm_backend import VLLMEngineError

    pol, start = _engine(c, "M")
    try:
        stream = pol.backend.weights_fn
        held = next(n for n, _ in stream() if ".layers.1." in n and n.endswith("down_proj.weight"))
        with torch.no_grad():
            for p in pol.model.parameters():
                p.add_(1e-2 * torch.randn_like(p))
        pol.weights_version += 1
        pol.backend.weights_fn = lambda *a: ((n, t) for n, t in stream(*a) if n != held)
        try:
            pol.generate([("p", "1+1=?")], SamplingParams(n=2, max_new_tokens=8), seed=0)
            refused = "not refused"
        except VLLMEngineError as exc:
            refused = str(exc)
        pol.backend.weights_fn = stream
        groups = pol.generate([("p", "1+1=?")], SamplingParams(n=2, max_new_tokens=8), seed=0)
        gap = _logp_gap(pol, groups)
        return {
            "engine start s": start,
            "held back": held,
            "refused": refused[:120],
            "names the tensor": held in refused,
            "full push: mean |Δ logp| vs trainer": float(gap.mean()),
            "tolerance": TOL_MEAN[pol.config.dtype],
        }
    finally:
        pol.close()


def row_vllm_fsdp(c: Check) -> dict:
    """A world-size-1 FSDP2 policy with its vLLM engine under NCCL with ``device_id`` (gloo on CPU): a
    verified push from the shards, and ``close()`` keeps the process group."""
    need_vllm()
    import torch.distributed as dist

    from graft_rl.policy.fsdp import ShardedPolicy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    gpu = c.device.startswith("cuda")
    dist.init_process_group(
        "nccl" if gpu else "gloo", rank=0, world_size=1, device_id=torch.device(c.device) if gpu else None
    )
    try:
        kwargs, dtype = _vllm_kwargs(c, enforce_eager=True)
        cfg = c.base(name="F", backend="vllm", dtype=dtype, lr=1e-3, world_size=1, vllm_kwargs=kwargs)
        pol = ShardedPolicy(PolicyConfig(**cfg))
        batch = c.batch.select(range(min(2, len(c.batch))))
        old, mask = pol.token_logprobs(batch)
        pol.update(batch, loss_fn(old, torch.tensor([1.0, -1.0])[: len(batch)], float(mask.sum())))
        groups = pol.generate([("p1", "What is 2+3?"), ("p2", "6*7?")], SamplingParams(n=2, max_new_tokens=16), 0)
        gap = _logp_gap(pol, groups)
        pol.close()
        kept = dist.is_initialized()
        return {
            "backend": dist.get_backend() if kept else "destroyed",
            "mean |Δ logp| vs trainer": float(gap.mean()),
            "tolerance": TOL_MEAN[dtype],
            "process group kept after close()": kept,
        }
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def row_vllm_two(c: Check) -> dict:
    """The rule: on CUDA one open engine per process wherever one sleeps (a second is refused in one line);
    engines one after another are allowed once the first is closed, and the second samples from its own
    weights (log-probs match the trainer's: no rotary cache or memory of the first reused). On CPU (no
    sleep) two engines may be open at once."""
    need_vllm()
    from graft_rl.policy.vllm_backend import VLLMEngineError

    gpu = c.device.startswith("cuda")
    first, _ = _engine(c, "E1")
    try:
        try:
            second, _ = _engine(c, "E2", sleep=False)
            second.close()
            beside = "built"
        except VLLMEngineError as exc:
            beside = f"refused: {str(exc)[:80]}"
    finally:
        first.close()
    after, _ = _engine(c, "E3")
    try:
        gap = _logp_gap(after, after.generate([("p", "1+1=?")], SamplingParams(n=2, max_new_tokens=8), seed=0))
    finally:
        after.close()
    return {
        "second engine while the first is open": beside,
        "expected": "refused" if gpu else "built",
        "engine after close(): mean |Δ logp| vs trainer": float(gap.mean()),
        "tolerance": TOL_MEAN["bfloat16" if gpu else "float32"],
    }


def row_vllm_transformers(c: Check) -> dict:
    """SmolLM3 through vLLM's Transformers backend (``model_impl="transformers"``, the path vLLM takes for
    it): two update → push → generate cycles beside the trainer, whose classes the engine patches."""
    need_vllm()
    try:
        from transformers import SmolLM3Config, SmolLM3ForCausalLM
    except ImportError:
        raise Skip("this transformers has no SmolLM3") from None
    from graft_rl.policy.tiny import char_tokenizer

    shape = {k: v for k, v in model_shape(c.smoke).items() if k != "head_dim"}
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = SmolLM3ForCausalLM(
        SmolLM3Config(
            **shape,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.eos_token_id,
        )
    )
    mdir = c.tmp / "smollm3"
    model.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    del model
    return _cycles(c, eager=True, model=mdir, model_impl="transformers")


def row_lora_fsdp(c: Check) -> dict:
    """A LoRA policy on FSDP2 (world 1; NCCL on a GPU, gloo on CPU), bf16 compute, KL on, the plain LM
    head: its first forward is the KL reference (the adapter disabled), then an update with the KL term.
    FSDP2 settles its mixed-precision dtypes at the first forward (issue 53)."""
    if importlib.util.find_spec("peft") is None:
        raise Skip("needs peft (pip install 'graft-rl[lora]')")
    import torch.distributed as dist

    from graft_rl.algo import reference_kl
    from graft_rl.policy.fsdp import ShardedPolicy

    c.pol = None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    gpu = c.device.startswith("cuda")
    dist.init_process_group(
        "nccl" if gpu else "gloo", rank=0, world_size=1, device_id=torch.device(c.device) if gpu else None
    )
    try:
        cfg = {**c.base(name="LF", lr=1e-4, world_size=1, lora=LORA), "fused_logprobs": False}
        pol = ShardedPolicy(PolicyConfig(**cfg))
        batch = c.batch.select(range(min(4, len(c.batch))))
        ref, _ = pol.reference_logprobs(batch)  # the first forward of the step: adapter disabled
        old, mask = pol.token_logprobs(batch)
        adv, total = torch.linspace(-1, 1, len(batch)), float(mask.sum())

        def fn(lp, m, rows):
            loss, _ = policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], m)
            kl = reference_kl(lp, ref[rows, : lp.shape[1]].to(lp), m)
            return (loss + 0.01 * kl) * (float(m.sum()) / total), {}

        adapters = [p for n, p in pol.model.named_parameters() if ".lora_" in n]
        before = [p.detach().to_local().clone() for p in adapters]
        stats = pol.update(batch, fn)
        changed = sum(int(not torch.equal(b, p.detach().to_local())) for b, p in zip(before, adapters, strict=True))
        return {
            "backend": dist.get_backend(),
            "update skipped": bool(stats.get("skipped")),
            "adapter tensors changed": changed / max(len(adapters), 1),
            "grad norm": stats.get("grad_norm"),
        }
    finally:
        dist.destroy_process_group()


#: the shared-GPU row: each engine's share of the GPU, and how many sleeps the watched engine takes
SHARE, SHARE_SLEEPS = 0.2, 30


def share_child(model: str, role: str, ready: str) -> None:
    """``--share-child``: one vLLM engine (sleep on, ``SHARE`` of the GPU) in this process, up beside
    the other child's; ``role`` "watched" sleeps and wakes ``SHARE_SLEEPS`` times, "busy" loops wake/sleep
    until the watched one is done. Prints one JSON line: sleeps done, the error if any."""
    from graft_rl.policy.vllm_backend import VLLMBackend

    out = {"role": role, "sleeps": 0, "error": None}
    try:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        engine = VLLMBackend(
            m, model, dtype="bfloat16", gpu_memory_utilization=SHARE, sleep=True, enforce_eager=True, max_model_len=1024
        )
        Path(f"{ready}.{role}").touch()
        deadline = time.monotonic() + 300
        while not all(Path(f"{ready}.{r}").exists() for r in ("watched", "busy")) and time.monotonic() < deadline:
            time.sleep(0.05)
        done = Path(f"{ready}.done")
        while (out["sleeps"] < SHARE_SLEEPS) if role == "watched" else (not done.exists()):
            if time.monotonic() > deadline:
                break
            engine._wake()
            engine._fall_asleep()
            out["sleeps"] += 1
        engine.close()
    except BaseException as exc:  # noqa: BLE001 - the row reports it
        out["error"] = one_line(exc)
    finally:
        if role == "watched":
            Path(f"{ready}.done").touch()
    print(json.dumps(out), flush=True)


def row_vllm_share(c: Check) -> dict:
    """Two engines of two processes on one GPU (``SHARE`` of it each, as ``ray.num_gpus=0.5`` puts them):
    one loops sleep/wake while the other sleeps ``SHARE_SLEEPS`` times. vLLM's ``Worker.sleep`` asserts
    the device's free memory did not drop around it; graft-rl's per-GPU turns keep the other engine's
    start and wakes out of that window (issue 53)."""
    need_vllm()
    if not c.device.startswith("cuda"):
        raise Skip("sleep mode needs a GPU")
    c.pol = None
    ready = c.tmp / "share"
    script = str(Path(__file__).resolve())
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--share-child", str(c.mdir()), role, str(ready)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("watched", "busy")
    ]
    res: dict = {}
    for role, p in zip(("watched", "busy"), procs, strict=True):
        stdout, stderr = p.communicate(timeout=600)
        line = (stdout.strip().splitlines() or ["{}"])[-1]
        got = json.loads(line) if line.startswith("{") else {"error": (stderr.strip().splitlines() or ["?"])[-1]}
        res[f"{role} sleeps"] = got.get("sleeps", 0)
        res[f"{role} error"] = got.get("error") or "none"
    return res


def row_vllm_tied(c: Check) -> dict:
    """The check model ties its embeddings (as SmolLM3-3B and Qwen3-1.7B do): a push that leaves out the
    alias ``lm_head.weight``, and one that zeroes it on its way, must each be refused before anything is
    sampled; a full push then works (issue 62)."""
    need_vllm()
    from graft_rl.policy.vllm_backend import VLLMEngineError

    pol, start = _engine(c, "T")
    try:
        stream = pol.backend.weights_fn
        out: dict = {"engine start s": start, "alias found in the engine": str(pol.backend.layout.aliases)}
        for label, fault in (
            ("left out", lambda s: ((n, t) for n, t in s if n != "lm_head.weight")),
            ("zeroed", lambda s: ((n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in s)),
        ):
            with torch.no_grad():
                for p in pol.model.parameters():
                    p.add_(1e-2 * torch.randn_like(p))
            pol.weights_version += 1
            pol.backend.weights_fn = lambda *a, fault=fault: fault(stream(*a))
            try:
                pol.generate([("p", "1+1=?")], SamplingParams(n=2, max_new_tokens=8), seed=0)
                refused = "not refused"
            except VLLMEngineError as exc:
                refused = str(exc)
            pol.backend.weights_fn = stream
            out[f"alias {label}: refused"] = refused[:160]
            out[f"alias {label}: names lm_head.weight"] = "lm_head.weight" in refused
        groups = pol.generate([("p", "1+1=?")], SamplingParams(n=2, max_new_tokens=8), seed=0)
        out["full push: mean |Δ logp| vs trainer"] = float(_logp_gap(pol, groups).mean())
        out["tolerance"] = TOL_MEAN[pol.config.dtype]
        return out
    finally:
        pol.close()


def row_vllm_gpt2(c: Check) -> dict:
    """A GPT-2 model through vLLM: its ``Conv1D`` weights (``[in, out]``) are held transposed by the engine
    and digested by column; two update → push → generate cycles beside the trainer (issue 62)."""
    need_vllm()
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model

    sh = model_shape(c.smoke)
    heads = sh["num_attention_heads"]
    mdir = build_tiny_model(
        c.tmp / "gpt2",
        "gpt2",
        bpe_tokenizer(),
        hidden=sh["head_dim"] * heads,
        layers=sh["num_hidden_layers"],
        heads=heads,
        max_positions=2048,
        seed=0,
    )
    vocab = json.loads((mdir / "config.json").read_text())["vocab_size"]
    return _cycles(c, eager=True, model=mdir, batch=random_batch(vocab, 2, 16, 16))


def row_vllm_rank_fault(c: Check) -> dict:
    """Two FSDP2 ranks of one policy, each with its vLLM engine (NCCL on two GPUs; gloo on CPU); rank 1's
    engine loader fails at its fourth tensor of a push: both ranks must raise ``RankFault`` naming rank
    1's error within :data:`FAULT_LIMIT` seconds, far inside the group's timeout (issue 62)."""
    need_vllm()
    gpus = torch.cuda.device_count() if c.device.startswith("cuda") else 0
    if c.device.startswith("cuda") and gpus < 2:
        raise Skip(f"two NCCL ranks need two GPUs ({gpus} here)")
    c.pol = None
    out = c.tmp / "fault"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(Path(__file__).resolve()), "--fault-child", str(c.mdir()), str(out)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=FAULT_TIMEOUT + 120)
    row: dict = {"seconds, both ranks' processes": time.perf_counter() - t0}
    for r in (0, 1):
        path = Path(f"{out}.rank{r}.json")
        got = (
            json.loads(path.read_text())
            if path.is_file()
            else {"raised": "nothing written", "message": res.stderr[-300:]}
        )
        row[f"rank {r} raised"] = got["raised"]
        row[f"rank {r} message"] = (got.get("message") or "")[:160]
        row[f"rank {r} seconds"] = got.get("seconds", float("inf"))
    return row


def fault_child(model: str, out: str) -> None:
    """``--fault-child``: one rank of ``vllm_rank_fault`` (under torchrun)."""
    import torch.distributed as dist

    from graft_rl.policy.fsdp import ShardedPolicy

    rank = int(os.environ["RANK"])
    gpu = torch.cuda.is_available()
    device = f"cuda:{rank}" if gpu else "cpu"
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        timeout=timedelta(seconds=FAULT_TIMEOUT),
        device_id=torch.device(device) if gpu else None,
    )
    kwargs = (
        {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 2048} if gpu else {"max_model_len": 512}
    )
    cfg = PolicyConfig(
        "F",
        model,
        world_size=2,
        backend="vllm",
        device=device,
        dtype="bfloat16" if gpu else "float32",
        vllm_kwargs=kwargs,
    )
    pol = ShardedPolicy(cfg)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(1e-2)
    pol.weights_version += 1
    if rank == 1:
        real = pol.backend.llm.collective_rpc

        def rpc(method, args=(), kwargs=None):
            if method == "reload_weights":

                def failing(stream):
                    for i, item in enumerate(stream):
                        if i == 3:
                            raise RuntimeError(f"injected: rank 1's engine loader failed at {item[0]}")
                        yield item

                kwargs = {**kwargs, "weights_iterator": failing(kwargs["weights_iterator"])}
            return real(method, args=args, kwargs=kwargs)

        pol.backend.llm.collective_rpc = rpc
    t0 = time.perf_counter()
    try:
        pol.sync_rollout_weights()
        got = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the row
        got = {"raised": type(exc).__name__, "message": str(exc)}
    got["seconds"] = time.perf_counter() - t0
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(got))
    pol.close()
    dist.destroy_process_group()


ROW_FNS = {
    "generate": row_generate,
    "logprobs": row_logprobs,
    "naive": row_naive,
    "update": row_update,
    "pure": row_pure,
    "fsdp": row_fsdp,
    "trainer": row_trainer,
    "gap": row_gap,
    "lora": row_lora,
    "vllm": row_vllm,
    "vllm_graphs": row_vllm_graphs,
    "vllm_seeds": row_vllm_seeds,
    "vllm_lora": row_vllm_lora,
    "vllm_missing": row_vllm_missing,
    "vllm_fsdp": row_vllm_fsdp,
    "vllm_two": row_vllm_two,
    "vllm_transformers": row_vllm_transformers,
    "lora_fsdp": row_lora_fsdp,
    "vllm_share": row_vllm_share,
    "vllm_tied": row_vllm_tied,
    "vllm_gpt2": row_vllm_gpt2,
    "vllm_rank_fault": row_vllm_rank_fault,
}


def _cycle_rules(r: dict) -> list[tuple[str, bool]]:
    out = []
    for k in (1, 2):
        now, stale = r[f"cycle {k} mean |Δ logp| vs trainer"], r[f"cycle {k} mean |Δ logp| vs pre-update weights"]
        out.append((f"cycle {k}: mean |Δ logp| vs trainer ≤ tolerance", now <= r["tolerance"]))
        out.append((f"cycle {k}: vs pre-update weights ≥ 5 × vs trainer", stale >= 5 * now))
    out.append(("one push per cycle (none more)", r["weight pushes"] == 2))
    if isinstance(r["sleep levels"], list):
        out.append(
            ("slept at level 1 from the start, level 2 after each verified push", r["sleep levels"] == [1, 2, 2])
        )
    return out


#: Each row's pass/fail rules over its figures (docs/benchmarks.md "gpu_check" lists them beside the rows):
#: a row whose rule fails is a failed row, whatever its figures look like.
RULES = {
    "generate": lambda r: [("tokens generated > 0", r["tokens"] > 0)],
    "logprobs": lambda r: [("chunked LM head taken", r["fused head"] is True)],
    "naive": lambda r: [("max |Δ logp| vs chunked ≤ 5e-2 (bf16)", r["max |Δ logp| vs chunked"] <= 5e-2)],
    "update": lambda r: [
        ("≥ 99 % of weights with a gradient changed (fp32 master)", r["changed after 3 steps @ lr 1e-6"] >= 0.99)
    ],
    "pure": lambda r: [
        ("pure bf16 changes < 50 % (what the fp32 master avoids)", r["changed after 3 steps @ lr 1e-6"] < 0.5)
    ],
    "fsdp": lambda r: [("max |Δ logp| vs single process ≤ 5e-2", r["max |Δ logp| vs single process"] <= 5e-2)],
    "trainer": lambda r: [
        ("3 steps × 2 policies logged, losses finite", r["metric lines"] >= 6 and r["finite losses"])
    ],
    "gap": lambda r: [
        ("every step of both policies measured", r["steps measured"] == 6),
        # LARGE_GAP_KL: a bf16 sampler beside its own trainer on one device should stay well below it
        ("mismatch_kl finite and ≤ 1e-3 per token", r["max mismatch_kl"] is not None and r["max mismatch_kl"] <= 1e-3),
        (
            "tis weights within [0.5, 2]",
            r["tis weight range"] is not None and 0.5 <= r["tis weight range"][0] <= r["tis weight range"][1] <= 2.0,
        ),
    ],
    "lora": lambda r: [
        ("base bf16, adapters fp32", r["base bf16, adapters fp32"]),
        ("≥ 99 % of adapter weights with a gradient changed", r["changed after 3 steps @ lr 1e-4"] >= 0.99),
        ("base unchanged by the updates", r["base unchanged"]),
        ("KL reference = base (max |Δ logp| ≤ 1e-3)", r["max |Δ logp| reference vs base"] <= 1e-3),
        (
            "merged weights score as base + adapter (mean |Δ logp| ≤ 2e-2)",
            r["mean |Δ logp| merged vs adapted"] <= 2e-2,
        ),
    ],
    "vllm": _cycle_rules,
    "vllm_graphs": _cycle_rules,
    "vllm_lora": _cycle_rules,
    "vllm_seeds": lambda r: [
        ("same seed, other global state → identical", r["same seed, other global state → identical"]),
        ("rank seeds → different", r["rank seeds, same global state → different"]),
        ("identical prompts → different groups", r["identical prompts → different groups"]),
    ],
    "vllm_missing": lambda r: [
        ("refused, naming the tensor", r["names the tensor"]),
        ("full push: mean |Δ logp| ≤ tolerance", r["full push: mean |Δ logp| vs trainer"] <= r["tolerance"]),
    ],
    "vllm_fsdp": lambda r: [
        ("mean |Δ logp| vs trainer ≤ tolerance", r["mean |Δ logp| vs trainer"] <= r["tolerance"]),
        ("process group kept after close()", r["process group kept after close()"]),
    ],
    "vllm_two": lambda r: [
        ("second open engine: " + r["expected"], r["second engine while the first is open"].startswith(r["expected"])),
        (
            "engine after close(): mean |Δ logp| ≤ tolerance",
            r["engine after close(): mean |Δ logp| vs trainer"] <= r["tolerance"],
        ),
    ],
    "vllm_transformers": _cycle_rules,
    "lora_fsdp": lambda r: [
        ("the update ran (no non-finite skip)", not r["update skipped"]),
        ("every adapter tensor changed", r["adapter tensors changed"] == 1.0),
    ],
    "vllm_share": lambda r: [
        ("no error in either engine (no sleep assertion)", r["watched error"] == r["busy error"] == "none"),
        (f"the watched engine slept {SHARE_SLEEPS} times", r["watched sleeps"] == SHARE_SLEEPS),
        ("the busy engine looped beside it", r["busy sleeps"] > 0),
    ],
    "vllm_tied": lambda r: [
        ("alias left out: refused, naming it", r["alias left out: names lm_head.weight"]),
        ("alias zeroed: refused, naming it", r["alias zeroed: names lm_head.weight"]),
        ("full push: mean |Δ logp| ≤ tolerance", r["full push: mean |Δ logp| vs trainer"] <= r["tolerance"]),
    ],
    "vllm_gpt2": _cycle_rules,
    "vllm_rank_fault": lambda r: [
        (
            f"both ranks raised RankFault naming rank 1 within {FAULT_LIMIT} s",
            all(
                r[f"rank {k} raised"] == "RankFault"
                and "on rank 1: RuntimeError: injected" in r[f"rank {k} message"]
                and r[f"rank {k} seconds"] <= FAULT_LIMIT
                for k in (0, 1)
            ),
        ),
    ],
}


# ---------------------------------------------------------------------------------------- output
def status(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return "ok"


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_markdown(results: list[dict], env: dict) -> str:
    cols = ["row", "status", "checks", "tokens", "seconds", "tok/s", "peak GiB", "fused head"]
    extra = [k for r in results for k in r if k not in cols and k not in ("error", "skipped")]
    cols += list(dict.fromkeys(extra))

    def cell(v) -> str:
        return fmt(v).replace("|", "\\|").replace("\n", " ")

    head = f"gpu_check: {env['device']}, torch {env['torch']}, transformers {env['transformers']}"
    if env.get("vllm"):
        head += f", vllm {env['vllm']}"
    lines = [
        head + (f"; model: {env['model']}" if env.get("model") else ""),
        "",
        "| " + " | ".join(cell(c) for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(cell(status(r) if c == "status" else r.get(c)) for c in cols) + " |" for r in results]
    return "\n".join(lines)


class Report:
    """Rows so far: each printed as it finishes and written (atomically) to ``out`` after every row."""

    def __init__(self, env: dict, out: str | None, total: int):
        self.env, self.rows, self.total = env, [], total
        self.out = Path(out) if out else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            self.write()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        details = ", ".join(f"{k}={fmt(v)}" for k, v in row.items() if k not in ("row", "error", "skipped"))
        print(
            f"[{len(self.rows)}/{self.total}] {row['row']}: {status(row)}" + (f" ({details})" if details else ""),
            flush=True,
        )
        self.write()

    def write(self) -> None:
        if not self.out:
            return
        for name, text in (
            ("gpu_check.md", to_markdown(self.rows, self.env) + "\n"),
            ("gpu_check.json", json.dumps({"env": self.env, "rows": self.rows}, indent=1)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.out / name)


def run_row(key: str, c: Check) -> dict:
    row = {"row": ROWS[key]}
    try:
        row.update(ROW_FNS[key](c))
        rules = RULES[key](row)
        row["checks"] = f"{sum(ok for _, ok in rules)}/{len(rules)} pass"
        failed = [label for label, ok in rules if not ok]
        if failed:
            row["error"] = "fails: " + "; ".join(failed)
    except Skip as exc:
        row["skipped"] = str(exc)
    except Exception as exc:
        pkg = missing_package(exc)
        if pkg:
            row["skipped"] = f"needs {pkg} (pip install {PIP_NAMES.get(pkg, pkg)})"
        else:
            print(f"--- row {ROWS[key]!r} failed:", file=sys.stderr, flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            row["error"] = one_line(exc)
    finally:
        gc.collect()
        if c.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def run_row_isolated(key: str, args, timeout: float) -> dict:
    """A vLLM row in a process of its own (vLLM keeps allocator, rotary cache and process group per process),
    under ``timeout`` seconds: a row that hangs or crashes the process is a failed row, and the rest still run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--one", key, "--json", str(out), "--device", args.device]
        cmd += ["--smoke"] if args.smoke else []
        try:
            res = subprocess.run(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"row": ROWS[key], "error": f"timed out after {timeout:g} s (its process was killed)"}
        if out.is_file():
            return json.loads(out.read_text(encoding="utf-8"))
        return {"row": ROWS[key], "error": f"its process exited with status {res.returncode} and no result"}


def verdict(rows: list[dict]) -> str:
    failed = [r["row"] for r in rows if "error" in r]
    ok = sum(1 for r in rows if "error" not in r and "skipped" not in r)
    skipped = sum(1 for r in rows if "skipped" in r)
    if failed:
        return f"gpu_check verdict: FAIL — {len(failed)} of {len(rows)} rows failed: {'; '.join(failed)}"
    return f"gpu_check verdict: PASS — {ok} rows passed their rules, {skipped} skipped"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (seconds): checks the script itself")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.md / .json (default: $OUT)")
    ap.add_argument("--skip", default="", help=f"comma-separated rows to skip: {','.join(ROWS)}")
    ap.add_argument(
        "--row-timeout", type=float, default=None, help="seconds per vLLM row (default 240 on a GPU, 900 on CPU)"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one row here (a vLLM row's own process)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--share-child", nargs=3, default=None, help=argparse.SUPPRESS)  # MODEL ROLE READY: vllm_share
    ap.add_argument("--fault-child", nargs=2, default=None, help=argparse.SUPPRESS)  # MODEL OUT: vllm_rank_fault
    args = ap.parse_args()
    if args.share_child:
        share_child(*args.share_child)
        return 0
    if args.fault_child:
        fault_child(*args.fault_child)
        return 0
    for stream in (sys.stdout, sys.stderr):  # row names have → and Δ: never die printing them
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    skip = set(filter(None, (s.strip() for s in args.skip.split(","))))
    if skip - set(ROWS):
        ap.error(f"--skip: unknown row(s) {', '.join(sorted(skip - set(ROWS)))}; rows: {', '.join(ROWS)}")
    device = args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):  # GiB of KV cache per vLLM CPU engine (its default, 4, x several engines)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    try:
        from importlib.metadata import version

        env["vllm"] = version("vllm")
    except Exception:
        pass
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            row = run_row(args.one, Check(args.smoke, device, Path(tmp), env))
        Path(args.json).write_text(json.dumps(row), encoding="utf-8")
        return 0
    print(f"gpu_check on {env['device']} (torch {env['torch']}, transformers {env['transformers']})", flush=True)
    timeout = args.row_timeout or (240.0 if device.startswith("cuda") else 900.0)

    report = Report(env, args.out, len(ROWS))
    with tempfile.TemporaryDirectory() as tmp:
        check = Check(args.smoke, device, Path(tmp), env)
        for key in ROWS:
            if key in skip:
                report.add({"row": ROWS[key], "skipped": "--skip"})
            elif key.startswith("vllm"):
                report.add(run_row_isolated(key, args, timeout))
            else:
                report.add(run_row(key, check))
        check.pol = None

    print(to_markdown(report.rows, env), flush=True)
    line = verdict(report.rows)
    print(line, flush=True)
    return 1 if "FAIL" in line else 0


if __name__ == "__main__":
    sys.exit(main())
