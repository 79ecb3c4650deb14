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


def test_rollout_on_rank0_pushes_collectively_with_one_engine(tiny_pair, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29641"]
    cmd += [str(HERE / "push_ranks.py"), str(tiny_pair[0]), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    r0, r1 = (json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["backend"], r0["engines"]) == (r1["backend"], r1["engines"]) == ("VLLMBackend", 1)
    assert len(r0["reloads"]) == len(r1["reloads"]) == 2  # one verified push per step, on every rank
    assert r0["texts"] == r1["texts"] and r0["texts"][0] != r0["texts"][1]  # rank 0's samples, broadcast
    assert r0["reference resharded"] and r1["reference resharded"]
    assert r0["group kept"] and r1["group kept"]
    assert r0["scores after close"] == r1["scores after close"]
