"""GRAFT's step overhead: one GRAFT step vs two independent GRPO steps on the same rollouts.

Uses the CPU testbed pair and its training pool with real rewards. The rollouts of each
repeat are generated once; then the post-rollout part of the step (exchange, receiver-side
scoring of every row, minibatch updates) is timed for GRPO (each model on its own groups) and
for GRAFT (grafted peer groups re-tokenised and scored by the receiver), on identical copies of
the models. Generation is reported separately: it is the same for both methods.

Reproduce:  python benchmarks/step_overhead.py [--repeats 5 --prompt-batch 32 --n 8]
Prints a Markdown table and the GRAFT / GRPO ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()

    import torch

    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer
    from graft_rl.methods import build_exchange
    from graft_rl.testbed import shipped_testbed

    tb = shipped_testbed()  # the pair every machine shares
    base = tb.train_config(run_dir=tempfile.mkdtemp())
    base.update(prompt_batch=args.prompt_batch, n=args.n, validation={"data": []})
    tr = Trainer(load_config(base), show_progress=False)
    grpo_ex = build_exchange(load_config(dict(base, method={"name": "grpo"})).method)
    graft_ex = tr.method.exchange
    times = {"generate + verify": [], "GRPO post-rollout (A+B)": [], "GRAFT post-rollout (A+B)": []}
    exchanged = []
    pristine = {n: copy.deepcopy(p.model.state_dict()) for n, p in tr.policies.items()}
    opt_state = {n: copy.deepcopy(p.optimizer.state_dict()) for n, p in tr.policies.items()}
    for rep in range(1, args.repeats + 1):
        prompts = tr.rollouts.prompts_for_step(rep)
        t0 = time.perf_counter()
        groups = {}
        for name in tr.policies:
            groups[name] = (
                tr.workers[name].generate(prompts, tr.sampling, tr.rollouts.generation_seed(name, rep)).get()[0]
            )
            tr.rollouts.verify_groups(groups[name])
        times["generate + verify"].append(time.perf_counter() - t0)
        for label, ex in (("GRPO post-rollout (A+B)", grpo_ex), ("GRAFT post-rollout (A+B)", graft_ex)):
            for name, pol in tr.policies.items():  # identical starting weights for both methods
                pol.model.load_state_dict(pristine[name])
                pol.optimizer.load_state_dict(opt_state[name])
            t0 = time.perf_counter()
            n_ex = 0
            for name in tr.policies:
                gen = torch.Generator().manual_seed(rep)
                batch = ex.build(name, copy.deepcopy(groups), tr.live, args.n, gen)
                n_ex += int(batch.stats.get("exchanged_in", 0))
                tr._train_receiver(name, batch, rep).get()
            times[label].append(time.perf_counter() - t0)
            if ex is graft_ex:
                exchanged.append(n_ex)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"testbed pair, {args.prompt_batch} prompts x n={args.n}, {args.repeats} repeats, CPU threads={torch.get_num_threads()}; "
        f"groups grafted per step (both directions): median {statistics.median(exchanged):.0f}"
    )
    print()
    print("| phase | median s | min s |")
    print("|---|---:|---:|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} |")
    g, r, gen = med["GRAFT post-rollout (A+B)"], med["GRPO post-rollout (A+B)"], med["generate + verify"]
    print()
    print(f"post-rollout ratio GRAFT / GRPO: {g / r:.2f}; whole step (with generation): {(gen + g) / (gen + r):.2f}")


if __name__ == "__main__":
    main()
