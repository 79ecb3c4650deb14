"""GPU check of the paper-scale path, needing nothing but torch + transformers + this source tree.

    python scripts/gpu_check.py                  # on one GPU: ~0.5B Qwen3-shaped model, 152k vocabulary
    python scripts/gpu_check.py --smoke          # seconds, on CPU: the same code path at toy sizes

Builds a randomly initialised Qwen3-shaped model from a config (nothing fetched from a hub),
then measures, each in its own row of a Markdown table:

1. ``hf`` generation (KV-cached sampler, bf16 compute over fp32 master weights): tokens/s;
2. scoring (old log-probs) through the chunked LM head: tokens/s, peak memory;
3. the same scoring through full logits (the path the chunked head replaces): peak memory;
4. minibatch updates, bf16 compute / fp32 master / gradient checkpointing: tokens/s, peak memory,
   and the fraction of weights (with a gradient) that changed after 3 AdamW steps at lr 1e-6;
5. the same with pure bf16 weights (the opt-in the default avoids): fraction changed;
6. FSDP2 (``ShardedPolicy``, world size 1, NCCL): update tokens/s, peak memory, log-prob
   agreement with the single-process path;
7. a 3-step GRAFT run of the trainer on the tiny heterogeneous pair, on the device.

Writes the table to stdout and, with ``--out DIR`` (or ``$OUT``), ``gpu_check.md``/``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from graft_rl.algo import policy_loss  # noqa: E402
from graft_rl.policy import Policy, PolicyConfig, SamplingParams, TokenBatch  # noqa: E402


def build_model(out: Path, smoke: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from graft_rl.policy.tiny import char_tokenizer

    tok = char_tokenizer()
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=4096)
    else:  # Qwen3-0.6B's shape: 0.6 B parameters, 151,936-token vocabulary
        shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936)
    cfg = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=8192, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


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
    pol._accumulate(batch, loss_fn(old, adv, float(mask.sum())))
    touched = [(p.grad != 0) if p.grad is not None else torch.zeros_like(p, dtype=torch.bool) for p in pol.model.parameters()]
    pol.optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in pol.model.parameters()]
    for _ in range(steps):
        pol.update(batch, loss_fn(old, adv, float(mask.sum())))
    changed = sum(int(((p.detach() != b) & t).sum()) for p, b, t in zip(pol.model.parameters(), before, touched, strict=True))
    return changed / max(1, sum(int(t.sum()) for t in touched))


def timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (seconds): checks the script itself")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.md / .json")
    ap.add_argument("--skip", default="", help="comma-separated rows to skip: generate,naive,pure,fsdp,trainer")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    skip = set(filter(None, args.skip.split(",")))
    smoke = args.smoke
    # sizes: responses of 2k-4k tokens on the GPU (the paper's lengths), toys in the smoke test
    rows, prompt, response = (4, 16, 48) if smoke else (8, 256, 3840)
    gen_prompts, gen_tokens = (4, 16) if smoke else (64, 512)
    mbt = 128 if smoke else 16384
    results: list[dict] = []
    env = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    print(f"gpu_check on {env['device']} (torch {env['torch']}, transformers {env['transformers']})", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        mdir = build_model(Path(tmp) / "qwen3", smoke)
        base = dict(name="P", model=str(mdir), device=device, dtype="bfloat16", lr=1e-6, micro_batch_tokens=mbt,
                    gradient_checkpointing=True, max_prompt_tokens=8192, gen_batch_size=gen_prompts)
        pol = Policy(PolicyConfig(**base))
        n_params = sum(p.numel() for p in pol.model.parameters())
        vocab = pol.model.config.vocab_size
        print(f"model: {n_params / 1e9:.3f} B parameters, vocabulary {vocab}, fused head: {pol.fused_head}", flush=True)
        batch = random_batch(vocab, rows, prompt, response)
        tokens = rows * (prompt + response)

        if "generate" not in skip:
            prompts = [list(range(5, 5 + prompt // 4))] * gen_prompts
            peak_reset(device)
            samples, dt = timed(lambda: pol.backend.generate(prompts, SamplingParams(n=1, max_new_tokens=gen_tokens), 0), device)
            made = sum(len(s.token_ids) for g in samples for s in g)
            results.append({"row": "generate (hf, bf16 compute)", "tokens": made, "seconds": dt, "tok/s": made / dt,
                            "peak GiB": peak_gib(device)})

        peak_reset(device)
        (old, mask), dt = timed(lambda: pol.token_logprobs(batch), device)
        results.append({"row": "score, chunked LM head", "tokens": tokens, "seconds": dt, "tok/s": tokens / dt,
                        "peak GiB": peak_gib(device)})

        if "naive" not in skip:
            naive = Policy(PolicyConfig(**{**base, "fused_logprobs": False, "name": "N"}))
            peak_reset(device)
            (old_n, _), dt = timed(lambda: naive.token_logprobs(batch), device)
            results.append({"row": "score, full logits (replaced path)", "tokens": tokens, "seconds": dt, "tok/s": tokens / dt,
                            "peak GiB": peak_gib(device), "max |Δ logp| vs chunked": float((old_n - old).abs().max())})
            naive = None

        adv = torch.linspace(-1, 1, rows)
        peak_reset(device)
        _, dt = timed(lambda: pol.update(batch, loss_fn(old, adv, float(mask.sum()))), device)
        frac = changed_fraction(pol, batch)
        results.append({"row": "update, bf16 compute / fp32 master / ckpt", "tokens": tokens, "seconds": dt, "tok/s": tokens / dt,
                        "peak GiB": peak_gib(device), "changed after 3 steps @ lr 1e-6": frac})
        pol = None  # free its memory before the next rows

        if "pure" not in skip:
            pure = Policy(PolicyConfig(**{**base, "master_dtype": "bfloat16", "name": "B"}))
            results.append({"row": "update, pure bf16 (opt-in)", "changed after 3 steps @ lr 1e-6": changed_fraction(pure, batch)})
            pure = None

        if "fsdp" not in skip:
            results.append(fsdp_row(base, batch, old, tokens, device))

        if "trainer" not in skip:
            results.append(trainer_row(Path(tmp), device))

    table = to_markdown(results, env)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(table + "\n")
        (out / "gpu_check.json").write_text(json.dumps({"env": env, "rows": results}, indent=1))
    return 0


def fsdp_row(base: dict, batch: TokenBatch, old_single: torch.Tensor, tokens: int, device: str) -> dict:
    import torch.distributed as dist

    from graft_rl.policy.fsdp import ShardedPolicy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    try:
        pol = ShardedPolicy(PolicyConfig(**{**base, "name": "S", "world_size": 1}))
        peak_reset(device)
        (old, mask), _ = timed(lambda: pol.token_logprobs(batch), device)
        adv = torch.linspace(-1, 1, len(batch))
        _, dt = timed(lambda: pol.update(batch, loss_fn(old, adv, float(mask.sum()))), device)
        return {"row": "update, FSDP2 (world 1, ShardedPolicy)", "tokens": tokens, "seconds": dt, "tok/s": tokens / dt,
                "peak GiB": peak_gib(device), "max |Δ logp| vs single process": float((old - old_single).abs().max())}
    finally:
        dist.destroy_process_group()


def trainer_row(tmp: Path, device: str) -> dict:
    from graft_rl.config import load_config
    from graft_rl.policy.tiny import build_tiny_pair
    from graft_rl.trainer import Trainer

    a, b = build_tiny_pair(tmp / "pair")
    data = tmp / "arith.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in range(8)))
    pol = {"device": device, "dtype": "bfloat16", "lr": 1e-3, "gradient_checkpointing": True}
    cfg = load_config({"run_dir": str(tmp / "run"), "steps": 3, "prompt_batch": 8, "minibatch": 2, "n": 4, "max_new_tokens": 8,
                       "checkpoint_every": 3, "data": {"train": str(data), "verifier": "gsm8k"}, "method": {"name": "graft"},
                       "policies": [{"name": "A", "model": str(a), **pol}, {"name": "B", "model": str(b), **pol}]})
    t0 = time.perf_counter()
    lines = Trainer(cfg, show_progress=False).run()
    return {"row": "trainer: GRAFT, tiny pair, 3 steps", "seconds": time.perf_counter() - t0,
            "metric lines": len(lines), "finite losses": all(ln.get("loss") is None or ln["loss"] == ln["loss"] for ln in lines)}


def to_markdown(results: list[dict], env: dict) -> str:
    cols = ["row", "tokens", "seconds", "tok/s", "peak GiB"]
    extra = [k for r in results for k in r if k not in cols]
    cols += list(dict.fromkeys(extra))

    def fmt(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = [f"gpu_check: {env['device']}, torch {env['torch']}, transformers {env['transformers']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in results]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
