"""Issue 39 on two FSDP2 ranks (gloo, CPU; the fake vLLM of ``fake_vllm.py`` in each rank): under
``rollout_on_rank0`` every push is verified collectively (rank 0's engine sets the digest dtypes, each
rank digests its shard, one all-reduce), rank 0 samples for both; the KL reference is resharded after
its forward; ``close()`` keeps the group. (Every rank still builds an engine: vLLM's start-up joins
the default group's collectives, so a rank without one would leave rank 0 waiting.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # two rank processes


def _ranks(model, tmp_path, port: int, mode: str = "", script: str = "push_ranks.py") -> tuple[dict, dict]:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    cmd += [str(HERE / script), str(model), str(out), mode]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    r0, r1 = (json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1))
    return r0, r1


def test_rollout_on_rank0_pushes_collectively_with_one_engine(tiny_pair, tmp_path):
    r0, r1 = _ranks(tiny_pair[0], tmp_path, 29641)
    assert (r0["backend"], r0["engines"]) == (r1["backend"], r1["engines"]) == ("VLLMBackend", 1)
    assert len(r0["reloads"]) == len(r1["reloads"]) == 2  # one verified push per step, on every rank
    assert r0["texts"] == r1["texts"] and r0["texts"][0] != r0["texts"][1]  # rank 0's samples, broadcast
    assert r0["reference resharded"] and r1["reference resharded"]
    assert r0["group kept"] and r1["group kept"]
    assert r0["scores after close"] == r1["scores after close"]


def test_a_bf16_engine_is_pushed_bf16_gathered_from_the_shards(tiny_pair, tmp_path):
    """Issue 53: each shard is cast to the engine's dtype before its all-gather, so a push moves bf16,
    not the float32 masters (half the bytes), and is verified as before."""
    r0, r1 = _ranks(tiny_pair[0], tmp_path, 29643, "bf16")
    assert len(r0["reloads"]) == 2  # both pushes verified
    push = r0["gathers"][-1]
    assert push and {d for d, _ in push} == {"torch.bfloat16"}
    assert len(push) == len(r0["tensors"])  # every tensor once (a tied alias too: vLLM's reload needs it)


def test_a_sharded_lora_push_gathers_each_tensor_once(tiny_pair, tmp_path):
    """Issue 53: the merged tensors are digested as they are pushed, not gathered a second time for
    the digest: one all-gather per base tensor and per adapter matrix, per push."""
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    r0, r1 = _ranks(tiny_pair[0], tmp_path, 29645, "lora")
    assert len(r0["reloads"]) == 3  # the start push, then one after each update
    tensors = {n: k for n, (_, k) in r0["tensors"].items()}
    for push in r0["gathers"]:
        assert sum(n for _, n in push) == sum(tensors.values())


@pytest.mark.parametrize("mode", ["", "lora"], ids=["full", "lora"])
def test_a_fault_on_one_rank_mid_push_ends_both_ranks_with_its_error(tiny_pair, tmp_path, mode):
    """Issue 62: rank 1's engine loader fails mid-stream, its stream fails after a gather, or its check
    fails while rank 0's passes: both ranks raise ``RankFault`` naming rank 1's error at once (far
    inside the group's timeout), and the next full push verifies on both. A fault inside a step's
    other collectives (the KL reference's forward; an update, its statistics' reduction after it) leaves
    rank 0 in FSDP's next collective: the group's timeout bounds it, and rank 0 ends with an error."""
    if mode == "lora":
        pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    sys.path.insert(0, str(HERE))
    from rank_faults import TIMEOUT  # importing it installs nothing (its run() does)

    r0, r1 = _ranks(tiny_pair[0], tmp_path, 29647 if mode else 29649, mode, "rank_faults.py")
    for fault, cause in (
        ("engine", "Injected: the engine's loader failed at "),
        ("stream", "Injected: the stream failed after gathering "),
        ("check", "VLLMEngineError: the vLLM engine's weights after the push are not the trainer's: "),
    ):
        for r in (r0, r1):
            got = r[fault]
            assert got["raised"] == "RankFault" and got["seconds"] < TIMEOUT / 2, (fault, got)
            assert got["message"].startswith(f"policy 'A': the weight push failed on rank 1: {cause}")
            assert r[f"{fault}, then a full push"]["raised"] is None
    assert r1["inside a collective"]["raised"] == "Injected"
    assert r0["inside a collective"]["raised"] is not None and r0["inside a collective"]["seconds"] < 3 * TIMEOUT
