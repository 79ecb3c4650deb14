"""Benchmarks are code: each one's toy-size run, so a change that breaks a script fails CI (its
figures, measured at full size, are in docs/benchmarks.md with the command)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: int = 900) -> str:
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_device_hours_runs_to_its_headline():
    """GRAFT's device time against the two GRPO runs (README, Table 5): every row and the headline."""
    out = _run("device_hours.py", "--toy")
    assert "| GRAFT, after (updates at once) | 2 |" in out and "| GRPO, policy A alone | 1 |" in out
    assert out.strip().splitlines()[-1].startswith("headline: GRAFT / two GRPO runs device-time = ")


@pytest.mark.slow
def test_step_stats_runs_at_toy_size():
    """Step metrics by micro_batch_tokens (docs/benchmarks.md, "Step metrics and the micro-batch cut")."""
    out = _run("step_stats.py", "--toy", "--cuts", "auto", "48", timeout=600)
    assert "| 1 | A | clip_frac_self |" in out
    assert float(out.strip().splitlines()[-1].rsplit(": ", 1)[1]) < 1e-3


@pytest.mark.slow
def test_data_scale_runs_at_toy_size():
    """Time to the first step and peak RSS by dataset size (docs/benchmarks.md, "Dataset size")."""
    out = _run("data_scale.py", "--rows", "1000", "--toy", timeout=300)
    assert "| 1,000 |" in out and "| local |" in out


@pytest.mark.slow
def test_push_digest_runs_at_toy_size():
    """The cost of verifying a vLLM weight push at 3B (docs/benchmarks.md, "Push verification cost")."""
    out = _run("push_digest.py", "--toy", timeout=120)
    assert "| engine (bf16) |" in out and "MB" in out


@pytest.mark.slow
def test_step_overhead_runs_at_toy_size():
    """GRAFT's post-rollout cost against GRPO's on the testbed pair (docs/benchmarks.md)."""
    out = _run("step_overhead.py", "--repeats", "1", "--prompt-batch", "4", "--n", "2", timeout=300)
    assert "| GRAFT post-rollout (A+B) |" in out and "post-rollout ratio GRAFT / GRPO:" in out


@pytest.mark.slow
def test_algo_bench_runs_at_toy_size():
    """The algorithm's own cost per step, models aside (docs/benchmarks.md)."""
    args = ["--prompts", "8", "--rollouts", "4", "--tokens", "64", "--minibatch", "4", "--repeats", "1"]
    out = _run("algo_bench.py", *args, timeout=120)
    assert "| loss fwd+bwd |" in out and "| total |" in out


@pytest.mark.slow
def test_rollout_bench_runs_at_toy_size():
    """Generation and scoring throughput of the tiny pair (docs/benchmarks.md)."""
    out = _run("rollout_bench.py", "--prompts", "2", "--n", "2", "--max-new", "8", timeout=300)
    assert "| tiny llama / byte tok | hf |" in out and "| tiny gpt2 / BPE | hf |" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_ray_overlap_runs_at_toy_size():
    """Seconds per step in-process against Ray actors (docs/benchmarks.md)."""
    out = _run("ray_overlap.py", "--steps", "2", "--prompt-batch", "4", timeout=600)
    assert "| local |" in out and "| ray |" in out


@pytest.mark.slow
def test_mechanism_runs_at_toy_size(tmp_path):
    """GRAFT against GRPO on the lookup pair (docs/benchmarks.md, "Mechanism"): both rows of a seed."""
    out = _run("mechanism.py", "--seeds", "0", "--toy", "--out", str(tmp_path), timeout=600)
    assert "model A: p(right digit)" in out and "| 0 | graft |" in out and "| 0 | grpo |" in out


@pytest.mark.slow
def test_padding_runs_at_toy_size():
    """Useful / computed tokens before and after length micro-batches (docs/benchmarks.md, "Padding")."""
    out = _run("padding.py", "--repeats", "1", timeout=600)
    assert "| paper mix, pair-1 preset (2 ranks, 32k budget) | after |" in out
    assert out.strip().splitlines()[-1].startswith("headline: useful / computed tokens after the change")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_preflight_presets_runs_on_the_testbed_preset(tmp_path):
    """The preflight table over presets (docs/benchmarks.md); here the testbed's GRAFT preset, the
    smallest, rather than a paper preset (those are rehearsed by tests/commands/test_preflight.py)."""
    out = _run("preflight_presets.py", "--presets", "../testbed/graft.yaml", "--out", str(tmp_path / "p.json"))
    assert "| ../testbed/graft.yaml | passed |" in out and "1/1 passed" in out


@pytest.mark.slow
def test_testbed_runs_at_toy_size(tmp_path):
    """Every method on the testbed pair (docs/testbed.md): one method, one seed, two steps."""
    args = ["--methods", "graft", "--seeds", "0", "--steps", "2", "--pool", "32", "--every", "2"]
    out = _run("testbed.py", *args, "--eval-prompts", "4", "--eval-samples", "1", "--out", str(tmp_path), timeout=900)
    assert "Complementarity at the start" in out and (tmp_path / "complementarity.md").is_file()


@pytest.mark.slow
def test_transfer_runs_at_toy_size(tmp_path):
    """The transfer pair's curves and table (docs/transfer.md): one method, one seed, two steps."""
    args = ["--methods", "graft", "--seeds", "0", "--steps", "2", "--every", "2", "--val-prompts", "8"]
    _run("transfer.py", *args, "--val-samples", "1", "--eval-samples", "1", "--out", str(tmp_path), timeout=900)
    assert (tmp_path / "start.json").is_file() and (tmp_path / "curves.png").is_file()


@pytest.mark.slow
def test_two_jobs_runs_at_toy_size():
    """Two runs at once on the same cores (docs/benchmarks.md, "Two jobs"): both spin settings."""
    out = _run("two_jobs.py", "--steps", "2", "--toy", timeout=900)
    assert "| 300000 |" in out and "| 5000 |" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed (the bench extra)")
def test_vs_trl_runs_at_toy_size():
    """One GRPO step of graft-rl against TRL's GRPOTrainer (docs/benchmarks.md)."""
    args = ["--prompts", "4", "--n", "2", "--max-new-tokens", "8", "--steps", "2", "--repeats", "1", "--threads", "1"]
    out = _run("vs_trl.py", *args, timeout=900)
    assert "graft-rl" in out and "TRL" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the lora extra (peft) is not installed")
def test_lora_runs_at_toy_size():
    """LoRA against full fine-tuning: time, memory, checkpoint and push (docs/benchmarks.md)."""
    out = _run("lora.py", "--model", "zoo:testbed-a", "--toy", timeout=300)
    assert "| trainable parameters |" in out and "| one minibatch update (s) |" in out and "| peak RSS |" in out


@pytest.mark.slow
def test_staleness_runs_at_toy_size(tmp_path):
    """rollout.lag x method.correction on the lookup pair (docs/benchmarks.md, "Staleness")."""
    out = _run("staleness.py", "--toy", "--out", str(tmp_path), timeout=600)
    assert "| lookup | 1 | tis |" in out and (tmp_path / "staleness.png").is_file()
    row = next(ln for ln in out.splitlines() if ln.startswith("| lookup | 1 | none |"))
    assert float(row.split("|")[6]) > 1e-6  # the gap a lag of one push opens


@pytest.mark.slow
@pytest.mark.vllm  # in both suites: the hf row here, the vLLM row too in CI's vLLM suite
def test_engine_gap_runs_at_toy_size():
    """The engine-trainer gap per engine and dtype (docs/benchmarks.md, "Engine and trainer"); the vLLM row
    where vLLM is installed (CI's vLLM suite)."""
    out = _run("engine_gap.py", "--toy", timeout=600)
    hf = next(ln for ln in out.splitlines() if ln.startswith("| testbed A | hf | float32 |"))
    assert float(hf.split("|")[5]) < 1e-6
    if importlib.util.find_spec("vllm") is not None:
        row = next(ln for ln in out.splitlines() if ln.startswith("| testbed A | vllm | float32 |"))
        assert float(row.split("|")[5]) < 1e-6


@pytest.mark.slow
def test_methods_comparison_runs_at_toy_size(tmp_path):
    """Every method under one protocol (docs/benchmarks.md, "Every way to share, one protocol"): each runs
    on each work, F-TIS is refused on a pair of two vocabularies and runs on the swarm of one."""
    out = _run("methods.py", "--toy", "--out", str(tmp_path), timeout=1200)
    for work in ("### transfer", "### lookup", "### swarm"):
        assert work in out
    assert "| ftis | refused: needs one vocabulary" in out
    swarm = out.split("### swarm")[1]
    assert "| ftis | refused" not in swarm and "| sapo |" in swarm and "| xgrpo |" in swarm
    assert (tmp_path / "methods.png").is_file()
    # an ablation: keys set on every run, named in the header
    out = _run(
        "methods.py",
        "--toy",
        "--work",
        "swarm",
        "--methods",
        "ftis",
        "--set",
        "method.composition=pool_all",
        "--out",
        str(tmp_path / "ablation"),
        timeout=600,
    )
    assert "set: method.composition=pool_all" in out and "| ftis |" in out
    cfg = yaml.safe_load((tmp_path / "ablation" / "runs" / "swarm" / "ftis_s0" / "config.yaml").read_text())
    assert cfg["method"]["composition"] == "pool_all"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_one_step_off_runs_at_toy_size():
    """One step off against colocated on 2 cores, and the pace model's predictions (docs/benchmarks.md, "One step off")."""
    out = _run("one_step_off.py", "--toy", timeout=300)
    assert "| one step off, 1 + 1 cores |" in out and "| colocated, 2 threads |" in out
    assert out.strip().splitlines()[-1].startswith("headline: one step off / faster colocated = ")
