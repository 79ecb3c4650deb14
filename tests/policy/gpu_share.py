"""One process of the shared-GPU test (tests/policy/test_gpu_share.py): a fake vLLM engine
(``fake_vllm.py``) on a GPU that another process's engine shares (``FakeDevice``), woken and put to
sleep ``loops`` times once both engines are up; with ``loops`` 0, until the other one is done. Exits 1
with vLLM's message if a sleep saw the device's free memory drop.

Arguments: DEVICE_FILE GPU_MEMORY_UTILIZATION LOOPS TURNS ("on": the backend's gpu_turn, "off": none).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm as fv  # noqa: E402


def run(device_file: str, share: float, loops: int, turns: str) -> None:
    fv.install()
    from graft_rl.policy import vllm_backend

    vllm_backend.gpu_key = lambda device="cuda": "fake-gpu"  # one physical GPU for every process
    if turns == "off":
        vllm_backend.gpu_turn = lambda key: contextlib.nullcontext()
    fv.FakeLLM.device = fv.FakeDevice(device_file)
    # the looping engine is awake 30 ms (generating), asleep 5 ms: a 20 ms sleep of the watched one
    # sees it wake, and not sleep again, more than half of the time
    fv.FakeLLM.sleep_seconds = 0.02 if loops else 0.005
    model = torch.nn.Linear(2, 2)
    fv.FakeLLM.source = model
    engine = vllm_backend.VLLMBackend(model, "model_dir", sleep=True, gpu_memory_utilization=share)
    Path(f"{device_file}.up.{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while len(list(Path(device_file).parent.glob(f"{Path(device_file).name}.up.*"))) < 2:  # both engines up
        if time.monotonic() > deadline:
            sys.exit("the other engine never came up")
        time.sleep(0.005)
    done = Path(f"{device_file}.done")
    try:
        i = 0
        while (i < loops) if loops else (not done.exists() and time.monotonic() < deadline):
            engine._wake()
            if not loops:
                time.sleep(0.03)  # generating
            engine._fall_asleep()
            i += 1
    except AssertionError as exc:
        print(f"AssertionError: {exc}")
        sys.exit(1)
    finally:
        if loops:
            done.touch()


if __name__ == "__main__":
    run(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
