"""One GRPO step of graft-rl vs TRL's GRPOTrainer on the same work, side by side in one process.

The same model (testbed model A, or ``--model zoo:smollm2-135m-instruct``), the same prompts (the
natural testbed pool, plain ``Q: …\\nA: `` prompts), n completions per prompt, the same maximum
completion length, T 1, top-p 1, one optimiser step per RL step (minibatch = the whole batch),
token-mean ("dapo") loss, no KL (beta 0), AdamW at the same lr, fp32 on CPU, the same torch threads.
Repeats alternate between the two (``--repeats`` blocks of ``--steps`` steps each, the first
``--warmup`` steps of every block not timed), and the table reports the median seconds per step,
completions per second and completion tokens per second, and the ratio ours / TRL.

TRL is an optional extra (``pip install -c requirements/cpu.txt -e ".[bench]"``, kept out of the
main venv so that its pins cannot move ours):

    python3 -m venv .venv-bench && .venv-bench/bin/pip install -c requirements/cpu.txt -e ".[bench]" transformers==5.24.0
    .venv-bench/bin/python benchmarks/vs_trl.py                       # testbed model A, 32 prompts x 8, 40 tokens
    .venv-bench/bin/python benchmarks/vs_trl.py --model zoo:smollm2-135m-instruct --prompts 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("time_generate", "time_logprobs", "time_update")
#: per-phase seconds of our timed steps (the trainer's own metrics), by runner name
PHASE_TIMES: dict[str, list[dict]] = {}


def graft_steps(model: str, problems, args, seed: int, gen_batch: int | None = None) -> list[tuple[float, float]]:
    """(seconds, mean completion tokens) of each step of one single-policy GRPO run; its per-phase
    seconds go to PHASE_TIMES."""
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer
    from graft_rl.testbed import PLAIN_TEMPLATE

    run_dir = Path(tempfile.mkdtemp(prefix="vs_trl_graft_"))
    cfg = {
        "run_dir": str(run_dir / "run"),
        "seed": seed,
        # the timed loop calls Trainer.step itself and never reaches the run's last step, so no
        # end-of-run checkpoint is written inside a timed step (TRL's loop writes none either)
        "steps": 10**6,
        "prompt_batch": args.prompts,
        "minibatch": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "checkpoint_every": 10**6,
        "torch_threads": args.threads,
        "data": {"train": args.data, "verifier": "gsm8k", "limit": None},
        "method": {"name": "grpo"},
        "policies": [
            {
                "name": "A",
                "model": model,
                "lr": 1e-6,
                "prompt_format": "plain",
                "plain_template": PLAIN_TEMPLATE,
                "prompt_suffix": None,
                **({"gen_batch_size": gen_batch} if gen_batch else {}),
            }
        ],
    }
    tr = Trainer(load_config(cfg), show_progress=False)
    out = []
    try:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            lines = tr.step(step)
            out.append((time.perf_counter() - t0, lines[0]["response_len_mean"]))
            if step > args.warmup:
                PHASE_TIMES.setdefault(f"graft-rl{f', gen_batch_size={gen_batch}' if gen_batch else ''}", []).append(
                    {k: lines[0][k] for k in PHASES}
                )
    finally:
        tr.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def trl_steps(model_dir: str, problems, args, seed: int) -> list[tuple[float, float]]:
    """The same with TRL's GRPOTrainer (a callback times each optimiser step)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from graft_rl.rewards import verify_gsm8k
    from graft_rl.testbed import PLAIN_TEMPLATE

    ds = Dataset.from_list(
        [{"prompt": PLAIN_TEMPLATE.replace("{prompt}", p.problem), "answer": p.answer} for p in problems]
    )

    def reward(completions, answer, **kw):
        return verify_gsm8k(list(completions), list(answer))

    times: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    out_dir = tempfile.mkdtemp(prefix="vs_trl_trl_")
    conf = GRPOConfig(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        seed=seed,
        learning_rate=1e-6,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        loss_type="dapo",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=m, reward_funcs=reward, args=conf, train_dataset=ds, processing_class=tok, callbacks=[Clock()]
    )
    trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
    trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    return list(zip(times, lengths + [float("nan")] * (len(times) - len(lengths)), strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zoo:testbed-a")
    ap.add_argument("--data", default="testbed_train")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--steps", type=int, default=6, help="steps per block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of every block")
    ap.add_argument("--repeats", type=int, default=3, help="blocks per framework, alternating")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--gen-batch",
        type=int,
        default=None,
        help="also time graft-rl with this policy gen_batch_size (default: automatic, every row of a step at once here)",
    )
    args = ap.parse_args()
    import torch
    import transformers
    import trl

    from graft_rl.data import load_dataset
    from graft_rl.policy.zoo import resolve

    torch.set_num_threads(args.threads)
    model_dir = resolve(args.model)  # one directory both frameworks load
    converted = None
    if str(model_dir).endswith(".gguf"):  # both frameworks get the same dequantised save_pretrained copy
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = Path(model_dir)
        dest = Path(tempfile.mkdtemp(prefix="vs_trl_model_"))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        if hasattr(loaded.config, "quantization_config"):
            del loaded.config.quantization_config  # dequantised on load; a GGUF-marked model refuses to save
        plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(dest)
        model_dir = converted = str(dest)
    problems = load_dataset(args.data)
    runners = {"graft-rl": lambda seed: graft_steps(model_dir, problems, args, seed)}
    if args.gen_batch:
        runners[f"graft-rl, gen_batch_size={args.gen_batch}"] = lambda seed: graft_steps(
            model_dir, problems, args, seed, args.gen_batch
        )
    runners["TRL"] = lambda seed: trl_steps(model_dir, problems, args, seed)
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    try:
        for r in range(args.repeats):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))  # alternate who goes first
            for name in order:
                steps = runners[name](r)
                res[name] += steps[args.warmup :]
                print(
                    f"block {r + 1}/{args.repeats} {name}: median "
                    f"{statistics.median(s for s, _ in steps[args.warmup :]):.3f} s/step",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if converted:
            shutil.rmtree(converted, ignore_errors=True)
    rows = args.prompts * args.n
    print(
        f"{args.model}, {args.prompts} prompts x {args.n}, max {args.max_new_tokens} new tokens, one optimiser step per "
        f"RL step; torch {torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}, "
        f"{args.threads} threads; {args.repeats} alternating blocks x {args.steps - args.warmup} timed steps\n"
    )
    print("| framework | median s/step | completions/s | mean completion tokens | completion tokens/s |")
    print("|---|---:|---:|---:|---:|")
    med = {}
    for name, steps in res.items():
        s = statistics.median(x for x, _ in steps)
        length = statistics.fmean(x for _, x in steps if x == x)
        med[name] = (s, rows * length / s)
        print(f"| {name} | {s:.3f} | {rows / s:.0f} | {length:.1f} | {rows * length / s:.0f} |")
    for name, phases in PHASE_TIMES.items():
        print(
            f"\n{name}, median seconds per phase: "
            + ", ".join(f"{k.removeprefix('time_')} {statistics.median(p[k] for p in phases):.3f}" for k in PHASES)
        )
    for name in med:
        if name != "TRL":
            print(
                f"\nthroughput ratio {name} / TRL: {med['TRL'][0] / med[name][0]:.2f}x (s/step), "
                f"{med[name][1] / med['TRL'][1]:.2f}x (completion tokens/s)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
