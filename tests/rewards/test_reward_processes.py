"""Nothing a reward starts outlives it (issue 40, item 2): each verifier worker leads its own process
group, killed whole on a timeout, when the pool closes, and when the process that owns the pool dies."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from graft_rl.rewards import RewardError, VerifierPool, resolve_reward

REWARDS = textwrap.dedent(
    """
    import subprocess, time

    def _start(problem):
        proc = subprocess.Popen(["sleep", "300"])
        with open(problem["pidfile"], "a") as f:
            f.write(f"{proc.pid}\\n")

    def hangs(responses, problems):  # starts a child, then never returns
        _start(problems[0])
        time.sleep(600)
        return [1.0]

    def leaves_one(responses, problems):  # starts a background job and returns
        _start(problems[0])
        return [1.0]
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not yet reaped by its (new) parent


def _gone(pids, within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _pids(pidfile: Path) -> list[int]:
    return [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []


@pytest.fixture
def rewards(tmp_path):
    (tmp_path / "proc_rewards.py").write_text(REWARDS)
    return tmp_path / "proc_rewards.py"


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def test_a_timed_out_reward_takes_the_processes_it_started_with_it(rewards, tmp_path):
    pidfile = tmp_path / "pids"
    pool = VerifierPool(num_workers=1, preload=())
    try:
        r = resolve_reward(f"{rewards}:hangs")
        problem = {"id": "a", "problem": "p", "answer": "1", "pidfile": str(pidfile)}
        with pytest.raises(RewardError, match=r"did not return within 1s \(data.verify_timeout\)"):
            r.score(["x", "y"], [problem, problem], timeout=1.0, pool=pool)
        assert len(_pids(pidfile)) == 2 and _gone(_pids(pidfile))
    finally:
        pool.close()


def test_background_jobs_of_a_reward_end_when_the_pool_closes(rewards, tmp_path):
    pidfile = tmp_path / "pids"
    pool = VerifierPool(num_workers=2, preload=())
    r = resolve_reward(f"{rewards}:leaves_one")
    problem = {"id": "a", "problem": "p", "answer": "1", "pidfile": str(pidfile)}
    scores, _ = r.score(["w", "x", "y", "z"], [problem] * 4, timeout=5.0, pool=pool)
    assert scores == [1.0] * 4 and len(_pids(pidfile)) == 4
    assert all(_alive(p) for p in _pids(pidfile))  # a worker lives on between calls, and so do they
    pool.close()
    assert _gone(_pids(pidfile))


@pytest.mark.parametrize("how", ["exits", "is killed"])
def test_a_reward_s_processes_end_when_the_process_that_owns_the_pool_dies(rewards, tmp_path, how):
    """Even by SIGKILL (no atexit runs) and while a call hangs: the worker watches its parent."""
    pidfile = tmp_path / "pids"
    fn = "leaves_one" if how == "exits" else "hangs"
    script = textwrap.dedent(
        f"""
        import os, signal, threading
        from graft_rl.rewards import VerifierPool, resolve_reward
        pool = VerifierPool(num_workers=1, preload=())
        r = resolve_reward({f"{rewards}:{fn}"!r})
        p = {{"id": "a", "problem": "p", "answer": "1", "pidfile": {str(pidfile)!r}}}
        if {how == "exits"}:
            r.score(["x"], [p], timeout=5.0, pool=pool)
            os._exit(0)  # no atexit, no pool.close()
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        r.score(["x"], [p], timeout=60.0, pool=pool)
        """
    )
    subprocess.run([sys.executable, "-c", script], timeout=120, check=False)
    assert len(_pids(pidfile)) == 1
    assert _gone(_pids(pidfile))
