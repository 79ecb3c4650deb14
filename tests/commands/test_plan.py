"""`graft plan` (issue 11): memory formulas, the paper presets' plans, and one-line resource errors."""

from __future__ import annotations

import pytest
import torch

from graft_rl.commands.cli import main
from graft_rl.commands.plan import (
    ALLOCATOR_MARGIN,
    KNOWN_SHAPES,
    RUNTIME_BYTES,
    GiB,
    format_plan,
    model_shape,
    plan,
    plan_policy,
)
from graft_rl.engine.config import ConfigError, load_config
from graft_rl.engine.resources import check_resources
from graft_rl.policy import PolicyConfig, PolicyError


@pytest.mark.parametrize(
    "name, billions",
    [
        ("HuggingFaceTB/SmolLM3-3B-Base", 3.08),
        ("Qwen/Qwen3-1.7B-Base", 1.72),
        ("OctoThinker/OctoThinker-3B-Hybrid-Base", 3.21),
        ("zoo:smollm2-135m-instruct", 0.1345),
        ("zoo:gemma3-270m", 0.268),
    ],
)
def test_parameter_counts_of_the_papers_models_match_their_model_cards(name, billions):
    assert KNOWN_SHAPES[name].params / 1e9 == pytest.approx(billions, rel=0.005)


def test_parameter_count_from_a_local_config_equals_the_models(tiny_pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0])  # Llama: the formula's shape family
    real = sum(p.numel() for p in model.parameters())
    assert model_shape(PolicyConfig("A", str(tiny_pair[0]))).params == real


def _cfg(execution="local", **pol):
    return load_config(
        {
            "policies": [{"name": "A", "model": "Qwen/Qwen3-1.7B-Base", "dtype": "bfloat16", **pol}],
            "method": {"name": "grpo"},
            "max_new_tokens": 4096,
            "execution": execution,
        }
    )


def test_sharded_state_is_16_bytes_per_parameter_over_world_size():
    one, four = (
        plan_policy(_cfg().policies[0], _cfg()),
        plan_policy(_cfg(world_size=4, execution="ray").policies[0], _cfg()),
    )
    assert one.sharded_state == 16 * KNOWN_SHAPES["Qwen/Qwen3-1.7B-Base"].params
    assert four.sharded_state == pytest.approx(one.sharded_state / 4)


def test_checkpointing_and_the_chunked_head_bound_memory():
    cfg = _cfg(micro_batch_tokens=32768, gradient_checkpointing=True)
    p = plan_policy(cfg.policies[0], cfg)
    assert p.activations < p.activations_no_ckpt / 10
    assert p.logits_chunk < p.naive_logits / 50
    # naive logits of one 32k-token micro-batch: 32768 x 151936 x (2 + 4 + 4) bytes = 46.4 GiB
    assert p.naive_logits / GiB == pytest.approx(46.4, abs=0.1)
    assert p.train_peak == p.sharded_state + p.compute_copy + p.activations + p.logits_chunk


def test_paper_pair1_plan_fits_four_h200s(capsys):
    """The paper trains a pair on 4 H200s; the preset's layout (2 GPUs per policy) fits with headroom."""
    assert main(["plan", "configs/paper/pair1/graft.yaml"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: 4 in all" in out and "| NO |" not in out
    plans = plan(load_config("configs/paper/pair1/graft.yaml"))
    assert [p.world_size for p in plans] == [2, 2]
    assert all(p.peak(141 * GiB) < 141 * GiB for p in plans)


def test_plan_counts_the_lag_history_in_host_memory(capsys):
    """rollout.lag k keeps k + 1 float32 copies of the trainable parameters per rank on the host."""
    plans = plan(load_config("configs/paper/pair1/graft.yaml", ["rollout.lag=2"]))
    for p in plans:
        assert p.lag_host == pytest.approx(3 * 4 * p.params / p.world_size)
    lora = plan(load_config("configs/paper/pair1/graft.yaml", ["rollout.lag=1", "policies.0.lora={r: 16}"]))[0]
    assert lora.lag_host == pytest.approx(2 * 4 * lora.lora_params / lora.world_size)
    assert main(["plan", "configs/paper/pair1/graft.yaml", "rollout.lag=1"]) == 0
    assert "host RAM per rank for rollout.lag 1: 2 float32 copies" in capsys.readouterr().out


def test_without_checkpointing_on_one_gpu_the_3b_policy_does_not_fit(capsys):
    assert (
        main(
            [
                "plan",
                "configs/paper/pair1/graft.yaml",
                "policies.0.world_size=1",
                "policies.0.gradient_checkpointing=false",
            ]
        )
        == 0
    )
    assert "| SmolLM3-3B-Base | 3.08 B | 1 |" in capsys.readouterr().out.split("NO")[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_paper_preset_without_a_gpu_fails_in_one_line(capsys):
    pytest.importorskip("ray", reason="the preset runs under Ray: without the ray extra that is the one line")
    assert main(["train", "configs/paper/pair1/graft.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "need device cuda" in err and "no CUDA GPU" in err


def test_world_size_above_one_needs_ray_execution():
    with pytest.raises(ConfigError, match=r"policies.0.world_size=2 .* needs execution: ray"):
        _cfg(world_size=2)


def test_cpu_configs_pass_the_resource_check():
    check_resources(load_config({"policies": [{"name": "A", "model": "x"}], "method": {"name": "grpo"}}))


def test_eval_estimate_of_the_paper_protocol():
    """Issue 21: `graft plan` says how long the paper's eval protocol takes on the run's GPUs."""
    from pathlib import Path

    from graft_rl.commands.plan import eval_estimate

    ROOT = Path(__file__).resolve().parents[2]
    cfg = load_config(ROOT / "configs" / "paper" / "pair1" / "graft.yaml")
    line = eval_estimate(cfg)
    # 872 problems x 8 x 5 = 34,880 responses; at 10k tokens/s/GPU on 4 GPUs: 1,000 tokens -> 15 min, 4,096 -> 60 min
    assert "872 problems" in line and "34,880 responses" in line and "4 GPU(s)" in line
    assert "~15 min at 1,000" in line and "~60 min if every response runs to 4,096" in line
    assert eval_estimate(load_config(ROOT / "configs" / "testbed" / "graft.yaml")) is None  # a CPU run


def test_plan_counts_the_kl_reference_the_hf_rollout_copy_and_the_runtime():
    """Issue 22: the KL reference (kl_coef > 0: 4N/W), a sharded hf policy's float32 rollout copy on
    every rank (4N), the runtime and the allocator margin are in the peak."""
    N = KNOWN_SHAPES["Qwen/Qwen3-1.7B-Base"].params
    base = _cfg(world_size=2, execution="ray")
    kl = load_config(
        {
            **{"policies": [{"name": "A", "model": "Qwen/Qwen3-1.7B-Base", "dtype": "bfloat16", "world_size": 2}]},
            "method": {"name": "grpo", "kl_coef": 0.01},
            "max_new_tokens": 4096,
            "execution": "ray",
        }
    )
    p0, pk = plan_policy(base.policies[0], base), plan_policy(kl.policies[0], kl)
    assert pk.reference == pytest.approx(4 * N / 2) and p0.reference == 0
    assert pk.train_peak - p0.train_peak == pytest.approx(4 * N / 2)
    assert p0.hf_copy == 4 * N  # hf backend, 2 ranks: each samples from a float32 copy
    assert plan_policy(_cfg().policies[0], _cfg()).hf_copy == 0  # one process samples from its own model
    G = 141 * GiB
    assert p0.peak(G) == pytest.approx(
        max(p0.training_peak(G), p0.generate_peak(G)) * (1 + ALLOCATOR_MARGIN) + RUNTIME_BYTES
    )


def test_plan_compares_the_kv_cache_with_a_steps_rollout_tokens(capsys):
    plans = plan(load_config("configs/paper/pair1/graft.yaml"))
    smol = plans[0]
    # SmolLM3: 36 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes = 73,728 bytes per token
    assert smol.kv_bytes_per_token == 73728
    # 128 prompts over 2 ranks x (512 prompt tokens + 8 x 4096 response tokens)
    assert smol.rollout_tokens == 64 * (512 + 8 * 4096)
    assert 0.8e6 < smol.kv_tokens(141 * GiB) < 1.0e6
    assert main(["plan", "configs/paper/pair1/graft.yaml"]) == 0
    assert "waves of generation" in capsys.readouterr().out


def test_tensor_parallel_vllm_is_refused_in_one_line():
    with pytest.raises(PolicyError, match=r"tensor_parallel_size=2 is not supported.*world_size"):
        PolicyConfig("A", "m", backend="vllm", vllm_kwargs={"tensor_parallel_size": 2})


def test_collective_timeout_is_a_config_key_with_a_long_default():
    assert _cfg().ray.collective_timeout == 3600.0
    with pytest.raises(ConfigError, match="ray.collective_timeout must be > 0"):
        load_config(
            {"policies": [{"name": "A", "model": "x"}], "method": {"name": "grpo"}, "ray": {"collective_timeout": 0}}
        )


def test_step_work_counts_the_flops_of_generation_scoring_and_the_update():
    """Issue 32 item 7: 2 N per generated and prefilled token; 2 N scoring (+2 N with a KL reference)
    and 6 N + 2 N recompute per trained token."""
    from graft_rl.commands.plan import step_work

    cfg = load_config("configs/paper/pair1/graft.yaml")
    pc = cfg.policies[1]
    N = KNOWN_SHAPES[pc.model].params
    w = step_work(pc, cfg)
    P, R, B, n = 512, cfg.max_new_tokens, cfg.prompt_batch, cfg.n
    assert w.gen_flops == pytest.approx(2 * N * (B * n * R + B * P))
    assert w.update_flops == pytest.approx((2 + 8) * N * B * n * (P + R))  # no KL reference in GRAFT
    assert w.step_seconds(2) == pytest.approx(w.step_seconds(1) / 2)


def test_the_suggested_split_equalises_the_policies_pace():
    from graft_rl.commands.plan import StepWork, suggest_split

    big, small = StepWork("A", 0.0, 1.8), StepWork("B", 0.0, 1.0)
    split, t = suggest_split([big, small], 8)
    assert split == [5, 3] and t == pytest.approx(big.step_seconds(5))  # max(1.8 / 5, 1 / 3): A sets the step
    assert suggest_split([small, small], 8)[0] == [4, 4]  # equal work: the even split
    assert suggest_split([big, small, small], 4)[0] == [2, 1, 1]


def test_graft_plan_prints_the_split_with_its_reasoning(capsys):
    assert main(["plan", "configs/paper/pair1/graft.yaml", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM3-3B-Base 5 / Qwen3-1.7B-Base 3" in out and "policies.0.world_size=5 policies.1.world_size=3" in out
    assert "work per step is 1.79 : 1.00" in out and "the slower one sets the step" in out
    assert main(["plan", "configs/paper/pair1/graft.yaml"]) == 0
    assert "2 / 2 of 4 (as configured) is already the split with the shortest step" in capsys.readouterr().out
    assert main(["plan", "configs/paper/pair1/graft.yaml", "--gpus", "1"]) == 2
    assert "--gpus must be at least the number of policies (2)" in capsys.readouterr().err


def test_lora_counts_a_frozen_base_its_adapters_and_no_kl_reference(capsys):
    """LoRA memory: the base in the compute dtype, 16 bytes per adapter parameter, no KL reference copy
    (the base with the adapter disabled); the pair-1 LoRA preset fits 24 GiB GPUs, full fine-tuning does
    not and the plan says that LoRA would, at how many generation waves."""
    from graft_rl.commands.plan import lora_params, model_shape
    from graft_rl.policy.lora import LoraSettings

    G = 24 * GiB
    full = plan(load_config("configs/paper/pair1/graft.yaml"))
    lora = plan(load_config("configs/paper/pair1/graft_lora.yaml"))
    s = model_shape(load_config("configs/paper/pair1/graft.yaml").policies[0])
    # SmolLM3 per layer: q 2048x2048, k/v 2048x512, o 2048x2048, gate/up 2048x11008, down 11008x2048
    per_layer = 16 * ((2048 + 2048) * 2 + (2048 + 512) * 2 + (2048 + 11008) * 3)
    assert lora_params(s, LoraSettings()) == 36 * per_layer == lora[0].lora_params
    assert lora_params(s, LoraSettings(8, 16, ["q_proj", "v_proj"])) == 36 * 8 * (4096 + 2560)
    N, A = lora[0].params, lora[0].lora_params
    assert lora[0].sharded_state == pytest.approx(2 * N / 2 + 16 * A / 2)
    assert all(p.peak(G) <= G for p in lora) and all(p.peak(G) > G for p in full)
    hacpo = plan(load_config("configs/paper/pair1/graft_lora.yaml", ["method.name=hacpo", "method.kl_coef=0.001"]))
    assert hacpo[0].reference == 0 and hacpo[0].reference_saved == pytest.approx(4 * N / 2)
    assert main(["plan", "configs/paper/pair1/graft.yaml", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning does not fit a GPU of 24 GiB" in out and "it fits" in out and "generation waves" in out
    assert main(["plan", "configs/paper/pair1/graft_lora.yaml", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert (
        "| yes |" in out and "| NO |" not in out and "adapter parameters" in out and "waves of generation, each" in out
    )


def test_plan_counts_the_host_memory_a_sleeping_engine_keeps():
    """Issue 53: a level-1 sleep's pinned copy of the weights is released at the first level-2 sleep; a
    quantised engine sleeps at level 1 throughout and keeps it; an engine that never sleeps has no line."""
    cfg = load_config("configs/paper/pair1/graft.yaml")
    text = format_plan(plan(cfg))
    smol = plan(cfg)[0]
    assert f"~{smol.vllm_weights / GiB:.1f} GiB) only until the first level-2 sleep" in text
    q = load_config("configs/paper/pair1/graft.yaml", ["policies.0.vllm_kwargs.quantization=fp8"])
    assert "stays for the run (a quantised engine sleeps at level 1)" in format_plan(plan(q))
    awake = load_config("configs/paper/pair1/graft.yaml", ["policies.0.vllm_kwargs.sleep=false"])
    assert format_plan(plan(awake)).count("host RAM per rank") == 1


# --------------------------------------------------------------------------- the pace model (one step off)
def test_the_pace_model_of_one_policy_is_the_sum_colocated_and_the_longer_side_one_step_off():
    from graft_rl.commands.pace import PhaseTimes, colocated_step, one_step_off_step

    p = PhaseTimes(generate=3.0, verify=0.25, push=0.5, exchange=0.25, update=2.0)
    assert colocated_step([p]) == pytest.approx(5.5)
    # the generator is the longer side; a batch starts after the last one is verified and the weights pushed
    assert one_step_off_step([p]) == pytest.approx(0.25 + 0.5 + 3.0)
    slow_update = PhaseTimes(generate=1.0, verify=0.25, push=0.5, exchange=0.25, update=4.0)
    assert one_step_off_step([slow_update]) == pytest.approx(5.0)  # verify + push + exchange + update


def test_under_perfect_scaling_colocated_on_2_devices_equals_one_step_off_on_1_plus_1():
    from graft_rl.commands.pace import PhaseTimes, colocated_step, one_step_off_step

    gen, upd = 8.0, 8.0  # one device's seconds
    assert colocated_step([PhaseTimes(generate=gen / 2, update=upd / 2)]) == pytest.approx(
        one_step_off_step([PhaseTimes(generate=gen, update=upd)])
    )


def test_the_lockstep_waits_for_the_slowest_generator_and_validation_is_amortised():
    from graft_rl.commands.pace import PhaseTimes, one_step_off_step

    fast, slow = PhaseTimes(generate=1.0, update=2.0), PhaseTimes(generate=5.0, update=1.0)
    assert one_step_off_step([fast, slow]) == pytest.approx(5.0)
    every = PhaseTimes(generate=1.0, update=2.0, validation=6.0, every=3)
    assert one_step_off_step([every], steps=62) == pytest.approx(4.0)


def test_plan_with_gpus_prints_both_schedules(capsys):
    assert main(["plan", "configs/paper/pair1/graft.yaml", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "- colocated (rollout.mode: colocated): SmolLM3-3B-Base 2 / Qwen3-1.7B-Base 2 GPUs" in out
    assert "- one step off (rollout.mode: one_step_off): SmolLM3-3B-Base 1 generator + 1 trainer" in out
    assert "Phase times the model played" in out and "push" in out
    assert main(["plan", "configs/paper/pair1/graft.yaml", "--gpus", "3"]) == 0
    assert "at least 4 GPUs" in capsys.readouterr().out
