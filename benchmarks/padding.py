"""Padding waste in scoring and updates: useful tokens / computed tokens, before and after micro-batches
formed by length (issue 22), and the update throughput that follows.

    python benchmarks/padding.py [--repeats 3]           # ~2 min on 2 cores

1. **Paper scale, arithmetic**: one step of the pair-1 presets (128 prompts x n = 8, minibatch 32
   prompts = 256 rows per update, ``micro_batch_tokens`` 32768, 2 FSDP ranks per policy) on a
   stated math-RL length mix: prompts uniform in 80-300 tokens, responses log-normal with median
   600 tokens (sigma 0.9) capped at 4,096 (~3 % truncated). Computed tokens = rows x the longest row
   of each forward pass, summed over a rank's passes; the ranks run in lock step (FSDP), so a
   pass costs what the rank with the longest pass computes.
2. **The testbed**: the same count on one step of the shipped natural pair's own rollouts (hf,
   32 prompts x 8, its config's budget).
3. **Measured**: forward + backward of one minibatch (the paper mix scaled by 1/8: responses up to
   512 tokens, budget 4,096) on a toy Llama (hidden 128, 2 layers) on this CPU; useful tokens per
   second, before and after, median of ``--repeats``.

"Before" is the previous rule (rows in arrival order, a rank takes rows ``rank, rank + W, ...``);
"after" is :func:`graft_rl.policy.logprobs.length_micro_batches` (rows dealt to ranks by length,
passes cut from length-sorted rows). Prints Markdown tables and ends with the headline line.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from build_testbed import cpu_model  # noqa: E402

from graft_rl.policy import Policy, PolicyConfig, SamplingParams, TokenBatch  # noqa: E402
from graft_rl.policy.logprobs import length_micro_batches  # noqa: E402


def arrival_order_micro_batches(lengths, budget):
    """The rule before issue 22: arrival order, a new pass when the padded size would pass the budget."""
    out, cur, cur_max = [], [], 0
    for i, length in enumerate(lengths):
        new_max = max(cur_max, length)
        if cur and new_max * (len(cur) + 1) > budget:
            out.append(cur)
            cur, new_max = [], length
        cur.append(i)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


def rank_passes(lengths, budget, world, rule):
    """Each rank's passes (lists of row indices) under the old or the new rule."""
    if rule == "before":
        shares = [list(range(r, len(lengths), world)) for r in range(world)]
        return [
            [[share[i] for i in p] for p in arrival_order_micro_batches([lengths[i] for i in share], budget)]
            for share in shares
        ]
    passes = length_micro_batches(lengths, budget, world)  # what ShardedPolicy._passes deals to its ranks
    return [[p[r::world] for p in passes] for r in range(world)]


def count(lengths, budget, world, rule) -> tuple[int, int, int]:
    """(useful tokens, computed tokens in lock step, passes per rank)."""
    per_rank = rank_passes(lengths, budget, world, rule)
    steps = max(len(p) for p in per_rank)
    cost = 0
    for k in range(steps):  # pass k runs on every rank at once: the rank with the biggest pass sets the pace
        sizes = [max(lengths[i] for i in p[k]) * len(p[k]) if k < len(p) and p[k] else 0 for p in per_rank]
        cost += max(sizes) * world
    return sum(lengths), cost, steps


def paper_mix(rows: int, seed: int = 0, scale: float = 1.0, cap: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [
        int(rng.randint(80, 300) * scale) + min(cap, max(1, int(rng.lognormvariate(6.4, 0.9) * scale)))
        for _ in range(rows)
    ]


def testbed_lengths() -> tuple[list[int], int]:
    from graft_rl.data import load_dataset
    from graft_rl.engine.config import load_config
    from graft_rl.testbed import shipped_testbed

    cfg = load_config(shipped_testbed().train_config(run_dir=tempfile.mkdtemp()))
    pol = Policy(cfg.policies[0])
    problems = [(p.id, p.problem) for p in load_dataset(cfg.data.train)[: cfg.prompt_batch]]
    groups = pol.generate(problems, SamplingParams(n=cfg.n, max_new_tokens=cfg.max_new_tokens), seed=0)
    return pol.encode_own(groups).lengths(), pol.micro_batch_tokens


def measured(rule: str, repeats: int = 3) -> tuple[float, int]:
    from graft_rl.commands.preflight import build_toy_model

    d = build_toy_model(Path(tempfile.mkdtemp()) / "toy", "llama", 0, seed=0)
    pol = Policy(PolicyConfig("A", str(d), lr=1e-5, micro_batch_tokens=4096, max_prompt_tokens=4096))
    lengths = paper_mix(128, seed=1, scale=1 / 8, cap=512)  # one rank's share of a 256-row minibatch
    vocab = pol.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (38,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(3, vocab, (max(1, n - 38),), generator=g).tolist() for n in lengths]
    batch = TokenBatch(prompts, responses)
    if rule == "before":
        pol._micro_batches = lambda b: arrival_order_micro_batches(b.lengths(), pol.micro_batch_tokens)
    mask_total = float(batch.response_mask().sum())

    def loss(lp, m, rows):
        return -(lp * m).sum() / mask_total, {}

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pol.update(batch, loss)
        times.append(time.perf_counter() - t0)
    return sum(batch.lengths()) / statistics.median(times), len(pol._micro_batches(batch))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per rule (the median is printed)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    paper = paper_mix(1024)
    minibatches = [paper[i : i + 256] for i in range(0, 1024, 256)]
    for rule in ("before", "after"):
        u = c = 0
        for mb in minibatches:
            a, b, passes = count(mb, 32768, 2, rule)
            u, c = u + a, c + b
        rows.append(("paper mix, pair-1 preset (2 ranks, 32k budget)", rule, u / c, passes))
    tb, budget = testbed_lengths()
    for rule in ("before", "after"):
        a, b, passes = count(tb, budget, 1, rule)
        rows.append((f"testbed natural pair, one step ({len(tb)} rows, budget {budget})", rule, a / b, passes))
    trunc = sum(1 for n in paper if n >= 4096 + 80) / len(paper)
    print(
        f"CPU: {cpu_model()}, torch {torch.__version__}; paper mix: median response "
        f"{statistics.median(paper):.0f} tokens (with prompt), {trunc:.1%} at the 4,096 cap"
    )
    print()
    print("| length mix | micro-batches | useful / computed tokens | passes per rank (last minibatch) |")
    print("|---|---|---:|---:|")
    for name, rule, frac, passes in rows:
        print(f"| {name} | {rule} | {frac:.3f} | {passes} |")
    print()
    print("| measured: one minibatch, toy Llama, paper mix / 8 (128 rows, budget 4,096) | useful tokens / s | passes |")
    print("|---|---:|---:|")
    speed = {}
    for rule in ("before", "after"):
        speed[rule], passes = measured(rule, args.repeats)
        print(f"| {rule} | {speed[rule]:,.0f} | {passes} |")
    print()
    after = rows[1][2]
    print(
        f"headline: useful / computed tokens after the change {after:.2f} (before {rows[0][2]:.2f}) on the paper mix; "
        f"update throughput x{speed['after'] / speed['before']:.2f} on this CPU"
    )


if __name__ == "__main__":
    main()
