"""One step off against colocated on this machine's two cores: one policy, GRPO, the testbed.

- colocated (``rollout.mode: colocated``, in-process): generation and update take turns on both cores, at
  1 and at 2 torch threads;
- one step off (``rollout.mode: one_step_off``, Ray): the trainer on one core (1 thread), its generator on
  the other (1 thread), step t+1 sampled while step t updates.

Runs are interleaved (every configuration once per round, ``--rounds`` rounds), so drift on the machine
falls on all alike. Per run: the median wall time of steps 2..N (step 1 has no batch in flight yet) and
the median phase times. Then the pace model (:mod:`graft_rl.commands.pace`) predicts each
configuration's step from the phase times measured in it, and one step off's from colocated's phases at
1 thread (the prediction made before a one-step-off run exists).

Reproduce:  python benchmarks/one_step_off.py [--rounds 5 --steps 10 --prompt-batch 32]
            python benchmarks/one_step_off.py --toy   (seconds; what CI runs)
Prints Markdown tables: measured (median and spread over rounds), per-phase times, and the model's predictions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from build_testbed import cpu_model  # noqa: E402

CONFIGS = {
    "colocated, 1 thread": {"execution": "local", "torch_threads": 1},
    "colocated, 2 threads": {"execution": "local", "torch_threads": 2},
    "one step off, 1 + 1 cores": {
        "execution": "ray",
        "ray": {"num_cpus": 1, "torch_threads": 1},
        "rollout": {"mode": "one_step_off", "generators": {"num_cpus": 1, "torch_threads": 1}},
    },
}
PHASES = ("generate", "reward", "logprobs", "update", "push", "wait_generation")


def run(keys: dict, steps: int, prompt_batch: int, max_new_tokens: int) -> dict:
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer
    from graft_rl.testbed import shipped_testbed

    base = shipped_testbed().train_config(run_dir=tempfile.mkdtemp())
    base.update(
        steps=10**6,  # never the run's last step: no end-of-run checkpoint is timed
        prompt_batch=prompt_batch,
        max_new_tokens=max_new_tokens,
        checkpoint_every=10**6,
        validation={"data": []},
        method={"name": "grpo"},
        policies=base["policies"][:1],
        **keys,
    )
    tr = Trainer(load_config(base), show_progress=False)
    walls: list[float] = []
    inner = tr.step

    def timed(step, stop=None):
        t0 = time.perf_counter()
        out = inner(step, stop)
        walls.append(time.perf_counter() - t0)
        return out

    tr.step = timed  # type: ignore[method-assign]
    try:
        lines = tr.run(max_steps=steps)
    finally:
        tr.close()
    later = lines[1:]
    phases = {p: statistics.median(ln.get(f"time_{p}", 0.0) for ln in later) for p in PHASES}
    # the driver's own share of a step (exchange, records, metrics, Ray calls): what no phase times. The
    # step's timed phases: colocated, generation and update one after the other; one step off, the wait
    # for the batch (its generation overlapped the previous update) and the push instead of generation
    off = "rollout" in keys
    timed_phases = ("wait_generation", "push") if off else ("generate",)
    busy = [sum(ln.get(f"time_{p}", 0.0) for p in (*timed_phases, "reward", "logprobs", "update")) for ln in later]
    phases["other"] = max(0.0, statistics.median(w - b for w, b in zip(walls[1:], busy, strict=True)))
    return {"step_s": statistics.median(walls[1:]), "phases": phases}


def predict(name: str, phases: dict, push: float = 0.0) -> float:
    from graft_rl.commands.pace import PhaseTimes, colocated_step, one_step_off_step

    pt = PhaseTimes(
        generate=phases["generate"],
        verify=phases["reward"],
        push=push or phases["push"],
        exchange=phases["other"],
        update=phases["logprobs"] + phases["update"],
    )
    if name.startswith("one step off"):
        return one_step_off_step([pt])
    return colocated_step([pt])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--toy", action="store_true", help="1 round, 3 steps, 4 prompts, 8 tokens")
    args = ap.parse_args()
    if args.toy:
        args.rounds, args.steps, args.prompt_batch, args.max_new_tokens = 1, 3, 4, 8
    import ray
    from tqdm.auto import tqdm

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tqdm(total=args.rounds * len(CONFIGS), desc="runs") as bar:
        for _ in range(args.rounds):
            for name, keys in CONFIGS.items():
                results[name].append(run(keys, args.steps, args.prompt_batch, args.max_new_tokens))
                bar.update()
    ray.shutdown()

    def med(name, key):
        return statistics.median(r["phases"][key] if key in PHASES + ("other",) else r[key] for r in results[name])

    print(
        f"testbed policy A alone, GRPO, {args.prompt_batch} prompts x n=8, max_new_tokens {args.max_new_tokens}; "
        f"{args.rounds} interleaved rounds of {args.steps} steps (median of steps 2..{args.steps} per run); "
        f"{cpu_model()}, 2 cores"
    )
    print()
    print("| configuration | s / step (median of rounds) | spread (min-max) |")
    print("|---|---:|---:|")
    for name, rs in results.items():
        steps = [r["step_s"] for r in rs]
        print(f"| {name} | {statistics.median(steps):.2f} | {min(steps):.2f}-{max(steps):.2f} |")
    print()
    print("| configuration | generate | verify | logprobs | update | push | wait for batch | other (driver) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in results:
        cells = " | ".join(f"{med(name, p):.2f}" for p in (*PHASES[:4], "push", "wait_generation", "other"))
        print(f"| {name} | {cells} |")
    print()
    print("| configuration | measured s / step | model, from its own phases | error |")
    print("|---|---:|---:|---:|")
    errors = []
    for name in results:
        phases = {p: med(name, p) for p in (*PHASES, "other")}
        got, want = med(name, "step_s"), predict(name, phases)
        errors.append(abs(want / got - 1))
        print(f"| {name} | {got:.2f} | {want:.2f} | {want / got - 1:+.1%} |")
    one = "one step off, 1 + 1 cores"
    before = predict(one, {p: med("colocated, 1 thread", p) for p in (*PHASES, "other")}, push=med(one, "push"))
    print()
    print(
        f"one step off predicted from colocated's phases at 1 thread (and the push it measured): {before:.2f} s "
        f"against {med(one, 'step_s'):.2f} s measured ({before / med(one, 'step_s') - 1:+.1%})"
    )
    best = min(med(n, "step_s") for n in results if n.startswith("colocated"))
    print(
        f"headline: one step off / faster colocated = {med(one, 'step_s') / best:.2f}; model max error {max(errors):.1%}"
    )


if __name__ == "__main__":
    main()
