"""FSDP2 data parallelism inside one policy (issue 11): 2 CPU ranks (gloo) compute what one process
computes — old log-probs, the update (global token-mean loss, gradients summed over ranks), the
weights after it, generation of each rank's share — and the checkpoint loads as a plain transformers directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graft_rl.policy import Policy, PolicyConfig, PolicyError, SamplingParams
from graft_rl.seeding import rank_seed

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fsdp_ranks import GEN_PROMPTS, LORA, exercise, receiver_step  # noqa: E402

pytestmark = pytest.mark.slow  # Ray clusters, process groups, subprocesses: the full suite runs them


def _torchrun(model, out, dtype, ckpt, port, lora: bool | str = False):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(HERE / "fsdp_ranks.py"),
        str(model),
        str(out),
        dtype,
        str(ckpt),
        *([lora if isinstance(lora, str) else "lora"] if lora else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(Path(out).read_text())


@pytest.mark.parametrize("arch", [0, 1])
def test_two_fsdp_ranks_match_one_process(tiny_pair, tmp_path, arch):
    model = tiny_pair[arch]
    ckpt = tmp_path / "ckpt"
    sharded = _torchrun(model, tmp_path / "out.json", "float32", ckpt, 29611 + arch)
    assert sharded["fused"]

    single = Policy(
        PolicyConfig("A", str(model), lr=1e-3, micro_batch_tokens=60, gradient_checkpointing=True, fused_logprobs=True)
    )
    one = exercise(single)

    torch.testing.assert_close(torch.tensor(sharded["old"]), torch.tensor(one["old"]), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(sharded["new"]), torch.tensor(one["new"]), rtol=0, atol=1e-5)
    # the frozen reference (sharded too) still scores like the initial weights after the updates
    torch.testing.assert_close(torch.tensor(sharded["ref"]), torch.tensor(one["old"]), rtol=0, atol=1e-5)
    assert torch.tensor(sharded["new"]).ne(torch.tensor(sharded["ref"])).any()
    for s, t in zip(sharded["stats"], one["stats"], strict=True):
        assert s["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-7)
        assert s["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5)
        assert s["skipped"] == t["skipped"] == 0
    # generation after the updates: each rank samples its share (rows rank, rank + 2) with its own seed
    # from its synced float32 copy -- what one process with those weights samples for that share
    sp = SamplingParams(n=3, max_new_tokens=6)
    share0 = single.generate([GEN_PROMPTS[0], GEN_PROMPTS[2]], sp, seed=rank_seed(5, 0, 2))
    share1 = single.generate([GEN_PROMPTS[1]], sp, seed=rank_seed(5, 1, 2))
    assert sharded["texts"] == [share0[0].texts, share1[0].texts, share0[1].texts]
    assert sharded["texts"][0] != sharded["texts"][2]  # one prompt twice: independent groups
    # rank 0 wrote the full weights as an ordinary save_pretrained directory; each rank its optimiser shard
    assert (ckpt / "policy_state.rank0.pt").is_file() and (ckpt / "policy_state.rank1.pt").is_file()
    reloaded = Policy(PolicyConfig("A", str(ckpt)))
    assert sharded["digest"] == pytest.approx(reloaded.param_digest(), rel=1e-9, abs=1e-9)
    # the weights equal one process's to 1e-6, except where Adam divides float noise by a near-zero
    # gradient (a handful of elements, each still within Adam's lr-per-step bound)
    diffs = torch.cat(
        [
            (a - b).detach().abs().flatten()
            for a, b in zip(reloaded.model.parameters(), single.model.parameters(), strict=True)
        ]
    )
    assert (diffs > 1e-6).float().mean() < 1e-4
    assert diffs.max() <= 2 * 1e-3 * 2


def test_world_size_above_one_needs_ray(tiny_pair):
    with pytest.raises(PolicyError, match="world_size=2 needs execution: ray"):
        Policy(PolicyConfig("A", str(tiny_pair[0]), world_size=2))


@pytest.mark.parametrize("arch", [0, 1])
def test_two_fsdp_ranks_with_lora_match_one_process(tiny_pair, tmp_path, arch):
    """LoRA under FSDP2: the adapters train (their optimiser shards), the base stays frozen, the KL
    reference is the base with the adapter disabled, and everything equals one LoRA process."""
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    model = tiny_pair[arch]
    ckpt = tmp_path / "ckpt"
    sharded = _torchrun(model, tmp_path / "out.json", "float32", ckpt, 29621 + arch, lora=True)
    cfg = PolicyConfig(
        "A", str(model), lr=1e-3, micro_batch_tokens=60, gradient_checkpointing=True, fused_logprobs=True, lora=LORA
    )
    single = Policy(cfg)
    one = exercise(single)
    for key in ("old", "new", "ref"):
        torch.testing.assert_close(torch.tensor(sharded[key]), torch.tensor(one[key]), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(sharded["ref"]), torch.tensor(one["old"]), rtol=0, atol=1e-5)
    assert torch.tensor(sharded["new"]).ne(torch.tensor(sharded["old"])).any()
    for s, t in zip(sharded["stats"], one["stats"], strict=True):
        assert s["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-7)
        assert s["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5)
    # the checkpoint holds the adapter (and one optimiser shard per rank) and loads on its base
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    reloaded = Policy(PolicyConfig("A", str(ckpt)))
    assert reloaded.lora is not None
    assert sharded["digest"] == pytest.approx(reloaded.param_digest(), rel=1e-9, abs=1e-9)
    base = Policy(PolicyConfig("A", str(model))).param_digest()
    frozen = [i for i, (n, _) in enumerate(reloaded.model.named_parameters()) if ".lora_" not in n]
    assert [sharded["digest"][i] for i in frozen] == base  # the frozen base is the base, bit for bit


@pytest.mark.parametrize("arch", [0, 1])
def test_lora_ranks_in_bf16_train_when_the_kl_reference_runs_first(tiny_pair, tmp_path, arch):
    """Issue 53: FSDP2 settles its mixed-precision dtypes at the first forward from the parameters
    that require grad then; a LoRA receiver with KL and no peer rows runs its reference (adapter
    disabled, so requires_grad cleared) first, and its first bf16 backward used to fail with
    "attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float". The plain
    head and no gradient checkpointing: no earlier forward with the adapters on."""
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    out = _torchrun(
        tiny_pair[arch], tmp_path / "out.json", "bfloat16", tmp_path / "ckpt", 29631 + arch, lora="lora_reference_first"
    )
    assert out["stats"]["skipped"] == 0 and out["stats"]["grad_norm"] > 0
    assert out["adapters_before"] != out["adapters_after"]  # the adapters trained


@pytest.mark.parametrize("mode", ["lag", "lora_lag"])
def test_two_fsdp_ranks_sample_the_lagged_weights_and_keep_the_live_ones(tiny_pair, tmp_path, mode):
    """``rollout.lag: 1`` over two ranks (full weights and LoRA): after an update a lagged generation
    samples exactly what the weights before it sampled, the live shards are back bit for bit, a
    generation without lag samples the updated weights, and each rank's history is checkpointed."""
    ckpt = tmp_path / "ckpt"
    port = 29631 if mode == "lag" else 29632
    res = _torchrun(tiny_pair[0], tmp_path / "out.json", "float32", ckpt, port, mode)
    assert res["stale"] == res["before"]
    if mode == "lag":  # one LoRA step from B = 0 at lr 1e-3 moves no sample of these tiny models
        assert res["live"] != res["before"]
    assert res["live weights kept"]
    assert res["entries"] == 2 and res["entries reloaded"] == 2
    assert (ckpt / "rollout_lag.rank0.safetensors").is_file() and (ckpt / "rollout_lag.rank1.safetensors").is_file()


#: the step statistics that are counts: equal exactly however the rows are cut and dealt
COUNTS = (
    "clipped_tokens_self",
    "tokens_self",
    "clipped_tokens_peer",
    "tokens_peer",
    "mismatch_tokens",
    "mismatch_out",
    "correction_masked",
    "kl_ref_count",
    "updates",
    "minibatches",
)


def test_step_statistics_are_the_same_on_one_process_any_micro_batch_and_two_ranks(tiny_pair, tmp_path):
    """A receiver's step (SPEC §1.14): its counts equal exactly and its float sums to rounding, whether
    its rows are cut into many small passes, one unlimited pass, or dealt over two FSDP2 ranks."""
    model = tiny_pair[0]
    runs = {
        f"one process, micro_batch_tokens={mbt}": receiver_step(
            Policy(PolicyConfig("A", str(model), lr=1e-3, micro_batch_tokens=mbt, gradient_checkpointing=True))
        )
        for mbt in (20, 60, None)
    }
    runs["two ranks"] = _torchrun(model, tmp_path / "out.json", "float32", tmp_path / "ckpt", 29533, "receiver")
    first = next(iter(runs.values()))
    assert first["sums"]["clipped_tokens_self"] > 0 and first["sums"]["mismatch_out"] > 0  # a case that clips and masks
    for name, got in runs.items():
        for k in COUNTS:
            assert got["sums"].get(k) == first["sums"].get(k), (name, k)
        assert got["sums"].keys() == first["sums"].keys(), name
        for k, v in first["sums"].items():
            assert got["sums"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), (name, k)
        assert got["peaks"] == pytest.approx(first["peaks"], rel=1e-4), name
