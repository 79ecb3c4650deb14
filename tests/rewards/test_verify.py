"""Rewards: math-verify on the last box, hard timeouts, crash recovery, GSM8K, reasoning-gym."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from graft_rl.rewards import (
    VerifierPool,
    gym_scores,
    last_boxed,
    verify_gsm8k,
    verify_math,
    verify_math_detailed,
)

FAULTY = textwrap.dedent(
    """
    import os, time
    def hang(x):
        while True:
            time.sleep(1)
    def boom(x):
        raise ZeroDivisionError("boom")
    def die(x):
        os._exit(3)
    def ok(x):
        return x * 2
    """
)


@pytest.fixture
def faulty_pool(tmp_path, monkeypatch):
    (tmp_path / "graft_faulty_checks.py").write_text(FAULTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = VerifierPool(num_workers=2, preload=())
    yield pool
    pool.close()


def _is_zombie_or_alive(pid: int) -> bool:
    """Whether the pid still has a process-table entry (alive, or a zombie nobody reaped)."""
    import os

    return os.path.exists(f"/proc/{pid}/status")


def test_last_boxed_takes_the_last_box_with_nested_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"cut off \boxed{12") is None


def test_verify_math_equivalent_forms_and_last_box_rule():
    responses = [
        r"First \boxed{3}, no wait: \boxed{\frac{1}{2}}",
        r"\boxed{0.5}",
        r"\boxed{\left( 3, \frac{\pi}{2} \right)}",
        r"\boxed{(3,\pi/2)}",
        r"The answer is 1/2.",
        r"\boxed{\frac{1}{2}} then \boxed{3}",
    ]
    answers = [
        "1/2",
        r"\frac{1}{2}",
        r"\left( 3, \frac{\pi}{2} \right)",
        r"\left( 3, \frac{\pi}{2} \right)",
        "1/2",
        "1/2",
    ]
    assert verify_math(responses, answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_verify_math_length_mismatch_is_one_clear_error():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        verify_math(["a", "b"], ["1"])


def test_pathological_answers_time_out_and_score_zero():
    bad = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{100000000!}", r"\boxed{\frac{1}{2}}"]
    t0 = time.monotonic()
    scores, stats = verify_math_detailed(bad, ["1", "2", "1/2"], timeout=1.5)
    elapsed = time.monotonic() - t0
    assert scores == [0.0, 0.0, 1.0]
    assert stats.timeout + stats.error >= 1 and stats.total == 3
    assert elapsed < 30  # bounded (includes worker start-up on a loaded 2-core machine)


def test_preloaded_warm_up_runs_before_the_first_item_is_timed(tmp_path, monkeypatch):
    """A preloaded module's warm_up() (math-verify's first parse, in graft_rl.rewards.checks) runs
    before the worker reports READY, so it never counts against an item's timeout."""
    (tmp_path / "graft_slow_start.py").write_text(
        textwrap.dedent(
            """
        import time
        WARM = []
        def warm_up():
            time.sleep(1.0)
            WARM.append(1)
        def warmed(x):
            return float(len(WARM))
        """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = VerifierPool(num_workers=1, preload=("graft_slow_start",))
    try:  # a 0.5 s timeout would expire inside a 1 s warm-up if it were on the item's clock
        out = pool.map("graft_slow_start:warmed", [(0,)], timeout=0.5)
    finally:
        pool.close()
    assert [(o.status, o.score) for o in out] == [("ok", 1.0)]


def test_pool_survives_hang_raise_and_death_without_zombies(faulty_pool):
    assert [o.score for o in faulty_pool.map("graft_faulty_checks:ok", [(1,), (2,)], timeout=30)] == [2.0, 4.0]
    before = faulty_pool.worker_pids()
    out = (
        faulty_pool.map("graft_faulty_checks:hang", [(0,)], timeout=0.5)
        + faulty_pool.map("graft_faulty_checks:boom", [(0,)], timeout=30)
        + faulty_pool.map("graft_faulty_checks:die", [(0,)], timeout=30)
    )
    assert [o.status for o in out] == ["timeout", "error", "crash"]
    assert all(o.score == 0.0 for o in out)
    assert "ZeroDivisionError" in out[1].detail
    # the pool recovers: the next call works on fresh workers
    assert [o.score for o in faulty_pool.map("graft_faulty_checks:ok", [(5,)] * 4, timeout=30)] == [10.0] * 4
    assert faulty_pool.restarts >= 2
    replaced = [p for p in before if p not in faulty_pool.worker_pids()]
    assert replaced and not any(_is_zombie_or_alive(p) for p in replaced)
    faulty_pool.close()
    assert faulty_pool.worker_pids() == []


def test_timeouts_hit_only_the_slow_item(faulty_pool):
    out = faulty_pool.map("graft_faulty_checks:ok", [(1,)], timeout=30)  # warm up both workers
    args = [(1,), (2,), (3,)]
    mixed = faulty_pool.map("graft_faulty_checks:ok", args, timeout=30)
    assert [o.score for o in mixed] == [2.0, 4.0, 6.0] and out[0].status == "ok"


def test_verify_math_from_a_thread_is_bounded():
    result = {}

    def run():
        result["scores"] = verify_math([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2}"], ["1", "2"], timeout=1.0)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and result["scores"] == [0.0, 1.0]


def test_verify_math_in_a_script_without_main_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from graft_rl.rewards import verify_math\n"
        "print(verify_math([r'\\boxed{\\frac{2}{4}}', r'\\boxed{3}'], ['1/2', '4']))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[1.0, 0.0]"


def test_verify_gsm8k_numbers():
    assert verify_gsm8k(
        [r"so \boxed{1,200}", "...\n#### 18", "she has 7 apples left", r"\boxed{x}", r"\boxed{3.0}"],
        ["1200", "18", "7", "3", "3"],
    ) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert verify_gsm8k(["9" * 5000], ["9"]) == [0.0]  # a runaway digit string is not an answer


def test_reasoning_gym_adapter_uses_the_task_scoring():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=3)
    source = "reasoning_gym:basic_arithmetic:4:3:{}"
    right = [f"\\boxed{{{ds[i]['answer']}}}" for i in range(4)]
    scores, stats = gym_scores(right + ["\\boxed{nonsense}", "no box"], source, [0, 1, 2, 3, 0, 1])
    assert scores == [1.0] * 4 + [0.0, 0.0]
    assert stats.total == 6
    with pytest.raises(ValueError, match="reasoning_gym"):
        gym_scores(["x"], "math:x:1:1:{}", [0])
