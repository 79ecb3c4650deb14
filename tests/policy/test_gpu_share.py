"""Two vLLM engines of two processes on one GPU (issue 53): vLLM's ``Worker.sleep`` measures the whole
device's free memory around its sleep and asserts it did not drop, so another engine waking in between
crashes it. Every sleep and wake takes its GPU's turn (``vllm_backend.gpu_turn``); checked against the
fake vLLM's device-wide measurement (``fake_vllm.FakeDevice``), with the turns switched off as the
control that shows the fake trips as vLLM does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _two_engines(tmp_path: Path, turns: str) -> list[subprocess.CompletedProcess]:
    """A small engine (0.1 of the GPU) sleeping 30 times while a large one (0.4) loops wake/sleep until
    the small one is done."""
    device = tmp_path / "gpu0"
    env = {**os.environ, "GRAFT_GPU_LOCK_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "gpu_share.py"), str(device), share, loops, turns],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for share, loops in (("0.1", "30"), ("0.4", "0"))
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


def test_engines_sharing_a_gpu_take_turns_to_sleep_and_wake(tmp_path):
    for res in _two_engines(tmp_path, "on"):
        assert res.returncode == 0, res.stdout[-2000:]
        assert "Memory usage increased after sleeping" not in res.stdout


def test_without_turns_the_fake_trips_as_vllm_does(tmp_path):
    """The control: the same two engines without turns; the small one's sleep sees the large one wake."""
    small, _ = _two_engines(tmp_path, "off")
    assert small.returncode == 1 and "Memory usage increased after sleeping" in small.stdout


def test_gpu_turn_is_exclusive_across_open_files(tmp_path, monkeypatch):
    """The turn is an flock on one file per GPU: a second holder (another open file, as another
    process has) waits; no GPU, no turn."""
    import fcntl

    from graft_rl.policy.vllm_backend import gpu_key, gpu_turn

    monkeypatch.setenv("GRAFT_GPU_LOCK_DIR", str(tmp_path))
    with gpu_turn("uuid-1"):
        fd = os.open(tmp_path / "graft-rl-gpu-uuid-1.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again once the block ends
    os.close(fd)
    assert gpu_key("cpu") is None
    with gpu_turn(None):
        pass


def test_the_gpu_turn_file_is_every_users(tmp_path, monkeypatch):
    """Issue 62: created 0o666 whatever the umask (``fchmod``), opened read-only (``flock`` needs no write
    access to another user's file), and an existing file opened without ``O_CREAT``, which
    ``fs.protected_regular`` refuses for another user's file in ``/tmp``. Root passes every permission
    check, so another user's file is played by an ``os.open`` that refuses what the kernel would."""
    import stat

    from graft_rl.policy.vllm_backend import gpu_turn

    monkeypatch.setenv("GRAFT_GPU_LOCK_DIR", str(tmp_path))
    old = os.umask(0o077)
    try:
        with gpu_turn("uuid-2"):
            pass
    finally:
        os.umask(old)
    path = tmp_path / "graft-rl-gpu-uuid-2.lock"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666
    real, seen = os.open, []

    def another_users(p, flags, *args):
        if str(p) == str(path):
            seen.append(flags)
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise PermissionError(13, "Permission denied (another user's file)", str(p))
            if flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied (fs.protected_regular)", str(p))
        return real(p, flags, *args)

    monkeypatch.setattr(os, "open", another_users)
    with gpu_turn("uuid-2"):
        pass
    assert seen == [os.O_RDONLY]
