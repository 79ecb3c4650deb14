"""Time graft_rl.algo on a paper-sized step (Table 3): 128 prompts x 8 rollouts x 4,096 tokens.

Both directions (A->B and B->A) are timed: advantages, selection, compatibility of every
peer response, peer-last ordering, and the loss forward+backward over all 4 minibatches
of 32 prompts of each receiver. The model forward/backward is not part of this: the loss
acts on log-prob tensors, as it does inside the trainer.

Reproduce:  python benchmarks/algo_bench.py [--prompts 128 --rollouts 8 --tokens 4096 --repeats 5]
Prints a Markdown table (median and min over repeats, in milliseconds).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from graft_rl.algo import (
    balanced_exchange,
    compatibility_score,
    compatibility_weight,
    grpo_advantages,
    mean_token_logprob,
    minibatch_order,
    policy_loss,
)


def make_inputs(G: int, n: int, T: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    M = G * n
    # success rates so that ~10% of groups are complementary in each direction
    p_a = torch.rand(G, 1, generator=g)
    p_b = torch.rand(G, 1, generator=g)
    rew_a = (torch.rand(G, n, generator=g) < p_a * p_a).float()
    rew_b = (torch.rand(G, n, generator=g) < p_b * p_b).float()
    lengths = torch.randint(T // 8, T + 1, (M,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()

    def mk():
        return (-torch.rand(M, T, generator=g) * 2).to(device)

    return {
        "rew": (rew_a.to(device), rew_b.to(device)),
        "gen_lp": (mk(), mk()),  # source generation log-probs on the source's tokens
        "recv_lp": (mk(), mk()),  # receiver log-probs of its own re-tokenisation of peer text
        "old_lp": (mk(), mk()),  # receiver old log-probs of its own batch
        "mask": mask.to(device),
    }


def graft_step(x: dict, G: int, n: int, minibatch: int, gen: torch.Generator) -> dict[str, float]:
    """One GRAFT step of the algorithm layer, both directions; returns phase timings in seconds."""
    t: dict[str, float] = {}
    sync = torch.cuda.synchronize if x["mask"].is_cuda else (lambda: None)

    def clock(name, fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        t[name] = t.get(name, 0.0) + time.perf_counter() - t0
        return out

    rew_a, rew_b = x["rew"]
    adv_a, adv_b = clock("advantages", lambda: (grpo_advantages(rew_a), grpo_advantages(rew_b)))
    a_to_b, b_to_a = clock("selection", lambda: balanced_exchange(rew_a.sum(1).long(), rew_b.sum(1).long(), n))
    mask = x["mask"]
    for _d, (sel, src, recv, adv_src, adv_recv) in enumerate(
        ((a_to_b, 0, 1, adv_a, adv_b), (b_to_a, 1, 0, adv_b, adv_a))
    ):

        def compat():
            src_mean = mean_token_logprob(x["gen_lp"][src], mask)
            recv_mean = mean_token_logprob(x["recv_lp"][recv], mask)
            return compatibility_weight(compatibility_score(recv_mean, src_mean))

        w_peer = clock("compatibility", compat).view(G, n)

        def build():
            # receiver batch: own groups where not replaced, source groups (and weights) where replaced
            keep = sel[:, None].expand(G, n)
            adv = torch.where(keep, adv_src, adv_recv).flatten()
            w = torch.where(keep, w_peer, torch.ones_like(w_peer)).flatten()
            order = minibatch_order(sel, minibatch, "last", gen)
            return adv, w, order

        adv, w, order = clock("batch+order", build)
        lp_all = x["recv_lp"][recv].view(G, n, -1)
        old_all = x["old_lp"][recv].view(G, n, -1)
        mask3 = mask.view(G, n, -1)
        for idx in order:

            def update():
                lp = lp_all[idx].flatten(0, 1).clone().requires_grad_(True)
                rows = (idx[:, None] * n + torch.arange(n, device=idx.device)).flatten()
                loss, stats = policy_loss(lp, old_all[idx].flatten(0, 1), adv[rows], mask3[idx].flatten(0, 1), w[rows])
                loss.backward()
                return stats

            clock("loss fwd+bwd", update)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--minibatch", type=int, default=32, help="prompts per minibatch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    G, n, T = args.prompts, args.rollouts, args.tokens
    x = make_inputs(G, n, T, seed=0, device=args.device)
    gen = torch.Generator().manual_seed(0)
    graft_step(x, G, n, args.minibatch, gen)  # warm-up
    runs = [graft_step(x, G, n, args.minibatch, gen) for _ in range(args.repeats)]
    phases = list(runs[0])
    print(
        f"graft_rl.algo, one GRAFT step, both directions: {G} prompts x {n} rollouts x {T} tokens "
        f"({2 * G * n * T / 1e6:.1f}M receiver tokens), minibatch {args.minibatch} prompts; "
        f"device={args.device}, torch {torch.__version__}, threads={torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()}"
    )
    print()
    print("| phase | median ms | min ms |")
    print("|---|---:|---:|")
    for p in phases + ["total"]:
        vals = [sum(r.values()) if p == "total" else r[p] for r in runs]
        print(f"| {p} | {1e3 * statistics.median(vals):.1f} | {1e3 * min(vals):.1f} |")


if __name__ == "__main__":
    main()
