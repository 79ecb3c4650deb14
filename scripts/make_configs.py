"""Write the method presets in configs/: one file per row of the paper's Tables 1-2, at paper
scale (GPU recipes) and at testbed scale (CPU). Each row file only states what differs from its
scale's base file (``base:``). Run:  python scripts/make_configs.py
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent / "configs"

# Table 1 (main comparison) and Table 2 / Appendix G (ablations and alternative designs)
ROWS: dict[str, dict] = {
    "grpo_n8": {"method": {"name": "grpo"}},
    "grpo_n16": {"method": {"name": "grpo"}, "n": 16},
    "grpo_n32": {"method": {"name": "grpo"}, "n": 32},
    "grpo_dynamic_sampling": {"method": {"name": "grpo", "dynamic_sampling": True}},
    # HACPO: the base minibatch (32 pooled groups of 8 own + 8 peer = 512 responses) gives its recipe's 4
    # updates per step (ppo_mini_batch_size 64 x n 8 of a 2,048-response batch), bounds 0.8 ... 0.875
    "hacpo": {"method": {"name": "hacpo", "kl_coef": 1e-3}},
    "sgt": {"method": {"name": "sgt"}},
    "graft": {"method": {"name": "graft"}},
    "graft_no_gate": {"method": {"name": "graft", "gate": False}},
    "graft_no_floor": {"method": {"name": "graft", "floor": False}},
    "graft_no_balance": {"method": {"name": "graft", "balance": False}},
    "graft_sequence_ratio": {"method": {"name": "graft", "ratio": "sequence"}},
    "graft_random_prompts": {"method": {"name": "graft", "selection": "random"}},
    "graft_random_admission": {"method": {"name": "graft", "admission": "random"}},
    "graft_peer_first": {"method": {"name": "graft", "position": "first"}},
    "graft_peer_uniform": {"method": {"name": "graft", "position": "uniform"}},
    "graft_pooled": {"method": {"name": "graft", "pooled": True}},
    "graft_success_only": {"method": {"name": "graft", "success_only": True}},
    "luffy": {"method": {"name": "luffy"}},
    "hacpo_graft_which": {"method": {"name": "hacpo", "selection": "graft", "kl_coef": 1e-3}},
    "sgt_graft_which": {"method": {"name": "sgt", "selection": "graft"}},
    # The paper (Appendix G): "The reported variant corresponds to GRAFT without balanced exchange": SGT's
    # eligibility differs from GRAFT's only by k_peer = n groups, whose source advantages are all zero.
    # `selection: sgt` with `balance: false` is the literal rule (those groups then also replace the
    # failed group and count in the token denominator); the preset is the reported variant.
    "sgt_graft_how": {"method": {"name": "graft", "balance": False}},
    # Appendix F: compatibility threshold sweep around the paper's delta = 0.8 (graft.yaml)
    "graft_delta_0.6": {"method": {"name": "graft", "delta": 0.6}},
    "graft_delta_0.7": {"method": {"name": "graft", "delta": 0.7}},
    "graft_delta_0.9": {"method": {"name": "graft", "delta": 0.9}},
}

PAIRS = {
    "pair1": ("HuggingFaceTB/SmolLM3-3B-Base", "Qwen/Qwen3-1.7B-Base"),
    "pair2": ("OctoThinker/OctoThinker-3B-Hybrid-Base", "Qwen/Qwen3-1.7B-Base"),
    "pair3": ("HuggingFaceTB/SmolLM3-3B-Base", "OctoThinker/OctoThinker-3B-Hybrid-Base"),
}

PAPER_BASE_HEADER = """\
# Paper scale (Table 3 hyperparameters), GPU recipe as the paper ran it: 4 H200s for a pair
# (verl + FSDP + vLLM). Here each policy is a Ray actor group of world_size=2 GPUs trained with
# FSDP2 (fp32 master weights and AdamW state, bf16 compute, gradient checkpointing), each rank
# with a vLLM engine that sleeps during updates. `graft plan` shows memory per GPU; on one
# 8-GPU node set policies.N.world_size=4. Model names are Hugging Face ids, fetched by
# transformers/vLLM where the machine has network access, or local paths.
# HACPO rows use its recipe's KL loss to the initial policy (method.kl_coef 1e-3, k3 estimator).
# Prompts: each model's chat template with the problem as a single user message, as the paper does
# (prompt_format: auto); a tokenizer without a chat template (possibly OctoThinker's base
# tokenizer) gets the plain template instead: the problem, a newline, the paper's suffix, a newline.
# Validation: 8 samples per problem. The standard error of the five-benchmark average is then about
# 1 point (AIME's 30 problems dominate; logged as val/score_se); ~0.3 would need ~64-100 samples on
# AIME/AMC, 8-12x the validation cost. Step 0 is validated but never chosen as best.
"""


#: What a LoRA preset changes in each policy: adapters of rank 16 on every linear layer over a frozen
#: bf16 base, 10x the full fine-tuning learning rate, half the micro-batch (activations), and a larger
#: vLLM share for the KV cache (graft plan --gpu-memory 24: fits, with the generation waves it states).
LORA_POLICY = {
    "lr": 1e-5,
    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
    "micro_batch_tokens": 16384,
    "vllm_kwargs": {"gpu_memory_utilization": 0.6, "max_model_len": 6144, "sleep": True},
}

LORA_HEADER = """\
# Low-rank adapters (peft) on both policies: only the adapters train (fp32 masters and AdamW state), the
# base stays frozen in bf16, the KL reference would be the base with the adapter disabled, checkpoints
# hold the adapters. Sized for 2 GPUs of 24 GiB per policy (RTX 4090, A6000, L40S):
#   graft plan configs/paper/PAIR/graft_lora.yaml --gpu-memory 24
# The learning rate is 10x full fine-tuning's (LoRA-for-RL ablations); not a row of the paper.
"""


def paper_base(a: str, b: str) -> dict:
    pol = {
        "dtype": "bfloat16",
        "device": "cuda",
        "backend": "vllm",
        "world_size": 2,
        "gradient_checkpointing": True,
        "lr": 1e-6,
        "max_prompt_tokens": 2048,
        "micro_batch_tokens": 32768,
        "vllm_kwargs": {"gpu_memory_utilization": 0.5, "max_model_len": 6144, "sleep": True},
    }
    return {
        "run_dir": "runs/paper",
        "execution": "ray",
        "ray": {"num_gpus": 1, "num_cpus": 8},
        "epochs": 3,
        "prompt_batch": 128,
        "minibatch": 32,
        "n": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": 4096,
        "checkpoint_every": 5,
        "data": {"train": "math_train", "reward": "math"},
        "validation": {
            "data": ["math500", "aime24", "aime25", "amc23", "minerva"],
            "every": 5,
            "samples": 8,
            "temperature": 0.6,
            "top_p": 0.95,
            "max_new_tokens": 4096,
        },
        "method": {"name": "graft"},
        "policies": [{"name": a.split("/")[-1], "model": a, **pol}, {"name": b.split("/")[-1], "model": b, **pol}],
    }


def main() -> None:
    for pair, (a, b) in PAIRS.items():
        d = ROOT / "paper" / pair
        d.mkdir(parents=True, exist_ok=True)
        (d / "base.yaml").write_text(PAPER_BASE_HEADER + yaml.safe_dump(paper_base(a, b), sort_keys=False))
        for row, over in ROWS.items():
            body = {"base": "base.yaml", "run_dir": f"runs/paper/{pair}/{row}", **over}
            (d / f"{row}.yaml").write_text(
                f"# {pair}: {a} <-> {b}; row: {row}\n" + yaml.safe_dump(body, sort_keys=False)
            )
        for row, method in (("graft_lora", "graft"), ("grpo_lora", "grpo")):  # LoRA on GPUs of 24 GiB
            body = {"base": "base.yaml", "run_dir": f"runs/paper/{pair}/{row}", "method": {"name": method}}
            body["policies"] = [{**pc, **copy.deepcopy(LORA_POLICY)} for pc in paper_base(a, b)["policies"]]
            (d / f"{row}.yaml").write_text(
                f"# {pair}: {a} <-> {b}; row: {method} with LoRA adapters (not a paper row)\n"
                + LORA_HEADER
                + yaml.safe_dump(body, sort_keys=False)
            )
        (d / "graft_stored.yaml").unlink(missing_ok=True)  # replaced by one preset per direction
        pols = paper_base(a, b)["policies"]
        for recv, src in ((0, 1), (1, 0)):  # Table 6: both receivers of every pair
            rname, sname = pols[recv]["name"], pols[src]["name"]
            stored = {
                "base": "base.yaml",
                "run_dir": f"runs/paper/{pair}/graft_stored_{rname}",
                "method": {"name": "graft"},
                "policies": [pols[recv]],
                "peers": [{"records": f"runs/paper/{pair}/grpo_n8", "policy": sname}],
            }
            (d / f"graft_stored_{rname}.yaml").write_text(
                f"# {pair}: GRAFT w/ stored trajectories (Section 6.2): {rname} learns from {sname}'s grpo_n8 records\n"
                + yaml.safe_dump(stored, sort_keys=False)
            )
    d = ROOT / "testbed"
    d.mkdir(parents=True, exist_ok=True)
    (d / "base.yaml").write_text(
        "# Testbed scale (CPU, minutes): the tiny pair of graft_rl.testbed that ships in the package\n"
        "# (zoo:testbed-a / zoo:testbed-b, data testbed_train / testbed_heldout): no build, no cache.\n"
        + yaml.safe_dump(_testbed_base(), sort_keys=False)
    )
    for row, over in ROWS.items():
        body = {"base": "base.yaml", "run_dir": f"runs/testbed/{row}", **over}
        (d / f"{row}.yaml").write_text(f"# testbed row: {row}\n" + yaml.safe_dump(body, sort_keys=False))


def _testbed_base() -> dict:
    from graft_rl.testbed import shipped_testbed

    cfg = shipped_testbed().train_config(run_dir="runs/testbed")
    cfg["method"] = cfg.get("method") or {"name": "graft"}
    return cfg


if __name__ == "__main__":
    main()
