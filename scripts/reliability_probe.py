"""The issue-14 probe, as a user would run it: real ``graft train`` processes on the CPU testbed,
signals, a concurrent run, a partial directory, an edited config, a torn log, bad input, (issue
31) a user's reward function that hangs, raises, breaks its contract, or starts failing mid-run, and
(issue 33) where one command's output meets another's: resume across execution, eval results that
merge, damaged or swapped checkpoints, a linked best/, SIGTERM in probe; (issue 40) what a reward's
processes leave, a reward or data file changed under a resume, a crafted checkpoint, a user's task
through graft eval, a start killed at its first write, a YAML tab, SIGTERM in eval, a large table;
(issue 50) kill -9 at the rename that commits best/, and graft eval --out on a full disk.

    python scripts/reliability_probe.py            # ~12 minutes on 2 cores
    python scripts/reliability_probe.py --only 40  # issue 40's rows only (~3 minutes)
    python scripts/reliability_probe.py --only 50  # issue 50's rows only (~1 minute)

Settings as in the issue: testbed default, ``steps=8 checkpoint_every=2 validation.every=4
validation.limit=32``. Prints one Markdown row per check; exits 1 if any fails. The deterministic
versions of these checks are the tests in ``tests/engine/test_reliability.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRAFT = [sys.executable, "-m", "graft_rl.commands.cli", "train"]
SETTINGS = ["steps=8", "checkpoint_every=2", "validation.every=4", "validation.limit=32"]
ROWS: list[tuple[str, bool, str]] = []


def graft(run_dir: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    args = (
        [*GRAFT, "--no-progress", "--resume", str(run_dir), *extra]
        if resume
        else [*GRAFT, "--no-progress", f"run_dir={run_dir}", *SETTINGS, *extra]
    )
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def wait_for(pred, timeout: float = 600) -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError("probe: condition not reached")
        time.sleep(0.05)


def strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def row(name: str, ok: bool, detail: str) -> None:
    ROWS.append((name, ok, detail))
    print(f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |", flush=True)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="graft_probe_"))
    print("| check | result | detail |\n|---|---|---|", flush=True)
    ref = root / "reference"
    rc, _, err = finish(graft(ref))
    if rc != 0:
        print(err)
        return 1
    ref_metrics, ref_val = strip(lines(ref / "metrics.jsonl")), strip(lines(ref / "validation.jsonl"))

    # 1. SIGTERM during validation, then --resume: nothing lost, same run
    d = root / "term_validate"
    p = graft(d)
    wait_for(lambda: any(r["step"] == 4 for r in lines(d / "validation.jsonl")) or p.poll() is not None)
    wait_for(lambda: len([r for r in lines(d / "metrics.jsonl") if r["step"] == 4]) == 2)  # step 4 done: validating
    p.send_signal(signal.SIGTERM)
    rc1, _, _ = finish(p)
    rc2, _, _ = finish(graft(d, resume=True))
    same = strip(lines(d / "metrics.jsonl")) == ref_metrics and strip(lines(d / "validation.jsonl")) == ref_val
    best_ok = (d / "best" / "B" / "config.json").stat().st_size > 0
    row(
        "SIGTERM during validation, --resume",
        rc1 == 143 and rc2 == 0 and same and best_ok,
        f"exit {rc1} then {rc2}; {len(lines(d / 'validation.jsonl'))} validation lines; identical to uninterrupted: {same}",
    )

    # 2. SIGINT (Ctrl-C) mid-step, then --resume
    d = root / "int_midstep"
    p = graft(d)
    wait_for(lambda: len(lines(d / "metrics.jsonl")) >= 5)  # inside step 3
    p.send_signal(signal.SIGINT)
    rc1, _, _ = finish(p)
    rc2, _, _ = finish(graft(d, resume=True))
    same = strip(lines(d / "metrics.jsonl")) == ref_metrics and strip(lines(d / "validation.jsonl")) == ref_val
    row("Ctrl-C mid-step, --resume", rc1 == 130 and rc2 == 0 and same, f"exit {rc1} then {rc2}; identical: {same}")

    # 3. two runs on one directory
    d = root / "concurrent"
    p1 = graft(d)
    wait_for(lambda: (d / ".lock").exists())
    rc2, _, err2 = finish(graft(d, resume=True))
    rc1, _, _ = finish(p1)
    dup = len(lines(d / "metrics.jsonl")) != len(ref_metrics)
    row(
        "second graft train on the same run_dir",
        rc2 == 2 and "in use by another graft train (pid" in err2 and rc1 == 0 and not dup,
        err2.strip().splitlines()[-1] if err2.strip() else "(no message)",
    )

    # 4. fresh run into a partial directory; resume of a run killed before its first checkpoint
    d = root / "partial"
    p = graft(d)
    wait_for(lambda: (d / "validation.jsonl").exists() and len(lines(d / "validation.jsonl")) >= 2)
    p.kill()
    p.wait()
    rc, _, err = finish(graft(d))
    rc_r, out_r, _ = finish(graft(d, resume=True))
    steps0 = len([r for r in lines(d / "validation.jsonl") if r["step"] == 0])
    row(
        "fresh run into a partial run_dir / its --resume",
        rc == 2 and "already holds a run" in err and rc_r == 0 and steps0 == 2,
        f"fresh: exit {rc}; resume: exit {rc_r}, step-0 validation lines {steps0}",
    )

    # 5. resume after an edit that changes results
    d = root / "edited"
    shutil.copytree(ref, d)
    cfg = (d / "config.yaml").read_text().replace("name: graft", "name: grpo", 1)
    (d / "config.yaml").write_text(cfg)
    rc, _, err = finish(graft(d, "steps=9", resume=True))
    row("--resume after method graft -> grpo", rc == 2 and "method.name changed" in err, err.strip().splitlines()[-1])

    # 6. torn last metrics line
    d = root / "torn"
    shutil.copytree(ref, d)
    with (d / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "policy": "A", "rew')
    rc, _, err = finish(graft(d, "steps=9", resume=True))
    rc_a = subprocess.run(
        [sys.executable, "-m", "graft_rl.commands.cli", "analyze", str(d)], capture_output=True
    ).returncode
    row("torn last line of metrics.jsonl", rc == 0 and rc_a == 0, f"resume exit {rc}, analyze exit {rc_a}")

    # 7. damaged newest checkpoint
    d = root / "damaged"
    shutil.copytree(ref, d)
    newest = sorted((d / "checkpoints").glob("step_*"))[-1]
    (newest / "A" / "policy_state.pt").write_bytes(b"")
    rc, out, _ = finish(graft(d, "steps=9", resume=True))
    row(
        "0-byte policy_state.pt in the newest checkpoint",
        rc == 0 and "is damaged" in out,
        next((ln for ln in out.splitlines() if "damaged" in ln), "(no message)"),
    )

    # 7b. (issue 24) damage a loadable file cannot show: zeroed bytes inside, checked by sha256
    d = root / "zeroed"
    shutil.copytree(ref, d)
    newest = sorted((d / "checkpoints").glob("step_*"))[-1]
    state = newest / "A" / "policy_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 1000] = bytes(1000)
    state.write_bytes(bytes(data))
    rc, out, _ = finish(graft(d, "steps=9", resume=True))
    same = strip(lines(d / "metrics.jsonl"))[: len(ref_metrics)] == ref_metrics
    row(
        "1,000 zeroed bytes inside the newest policy_state.pt",
        rc == 0 and "sha256" in out and same,
        f"{next((ln for ln in out.splitlines() if 'damaged' in ln), '(no message)')}; steps 1-8 identical: {same}",
    )

    # 7c. (issue 24) every checkpoint damaged: refused, nothing deleted
    d = root / "all_damaged"
    shutil.copytree(ref, d)
    for ck in (d / "checkpoints").glob("step_*"):
        w = ck / "B" / "model.safetensors"
        w.write_bytes(w.read_bytes()[:1000])
    before = sorted(str(p) for p in d.rglob("*"))
    rc, _, err = finish(graft(d, "steps=9", resume=True))
    kept = sorted(str(p) for p in d.rglob("*") if p.name != ".lock") == [x for x in before if not x.endswith(".lock")]
    row(
        "every checkpoint damaged",
        rc == 2 and "every checkpoint is damaged" in err and kept,
        f"exit {rc}; nothing deleted: {kept}",
    )

    # 7d. (issue 24) best/ vs the logs: kill -9 after step 5's validation, resume with validation.every changed
    d = root / "best_logs"
    p = graft(d, "validation.every=1")
    wait_for(lambda: len([r for r in lines(d / "validation.jsonl") if r["step"] == 5]) == 2 or p.poll() is not None)
    p.kill()
    p.wait()
    rc, out, _ = finish(graft(d, "validation.every=4", resume=True))
    from graft_rl.engine.rundir import best_steps

    logged = best_steps(lines(d / "validation.jsonl"))
    recorded = json.loads((d / "best" / "best.json").read_text())
    row(
        "kill -9 after a validation, resume with validation.every changed",
        rc == 0 and logged == recorded,
        f"exit {rc}; best.json { ({k: v['step'] for k, v in recorded.items()}) } = the log's best: {logged == recorded}",
    )

    # 7e. (issue 24) graft eval: counts of 0, Ctrl-C keeps what finished
    ev = [sys.executable, "-m", "graft_rl.commands.cli", "eval", str(ref)]
    res = subprocess.run([*ev, "--limit", "0"], capture_output=True, text=True)
    row(
        "graft eval --limit 0",
        res.returncode == 2 and "--limit must be >= 1" in res.stderr,
        res.stderr.strip().splitlines()[-1],
    )
    out_dir = root / "eval_ctrlc"
    p = subprocess.Popen(
        [*ev, "--samples", "1", "--runs", "1", "--limit", "256", "--out", str(out_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (out_dir / "eval.json").exists() or p.poll() is not None)
    p.send_signal(signal.SIGINT)
    rc, _, err = finish(p)
    saved = json.loads((out_dir / "eval.json").read_text()) if (out_dir / "eval.json").exists() else {"policies": {}}
    row(
        "Ctrl-C in graft eval after the first policy",
        rc == 130 and list(saved["policies"]) == ["A"] and "Traceback" not in err,
        f"exit {rc}; eval.json holds {list(saved['policies'])}",
    )

    # 8. bad input: one line, exit != 0, nothing written
    bad_data = root / "binary.jsonl"
    bad_data.write_bytes(bytes(range(256)))
    answers = root / "gsm8k_answers.jsonl"  # a reference no response could match (issue 24)
    answers.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": "abc" if i == 7 else str(2 * i)}) + "\n"
            for i in range(64)
        )
    )
    long = root / "gsm8k_long.jsonl"  # a prompt over the testbed models' context, under max_prompt_tokens
    long.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "problem": ("x" * 1500 if i == 3 else "") + f"{i}+{i}=?", "answer": str(2 * i)})
            + "\n"
            for i in range(64)
        )
    )
    for over in [
        "policies.5.lr=1",
        "policies.x.lr=1",
        "steps.x=1",
        "temperature=-1",
        "validation.every=0",
        "steps=0",
        "n=1",
        f"data.train={bad_data}",
        f"data.train={answers}",
        f"data.train={long}",
        "data.limit=0",
        "validation.limit=0",
        "method.eps_low=-1",
        "method.luffy_gamma=0.3",
        "policies.0.lr=nan",
        "temperature=.inf",  # issue 33: accepted before (every gradient 0)
        "policies.0.name=Org/Model",  # issue 33: failed later with "cannot write .../best"
        "policies.0.name=..",
        "data.train=reasoning_gym:chain_sum:abc",  # issue 33: a ValueError traceback before
    ]:
        d = root / f"bad_{abs(hash(over))}"
        rc, _, err = finish(graft(d, over))
        msg = err.strip().splitlines()
        row(
            f"bad input `{over.replace(str(root), '...')}`",
            rc == 2 and len(msg) == 1 and not d.exists(),
            msg[-1] if msg else "",
        )

    # 9. rewards
    from graft_rl.rewards import verify_gsm8k

    got = verify_gsm8k([r"\boxed{1/2}", r"\boxed{12-5}", r"\boxed{3 or 4 or 5}"], ["1", "12", "3"])
    row("gsm8k: 1/2 vs 1, 12-5 vs 12, '3 or 4 or 5' vs 3", got == [0.0, 0.0, 0.0], f"scores {got}")

    # 10. a response longer than the context leaves (issue 24): clamped with one line, no IndexError
    d = root / "long_responses"
    rc, out, err = finish(graft(d, "max_new_tokens=600", "steps=1"))
    note = next((x for x in out.splitlines() if "context: max_new_tokens 600 ->" in x), "")
    row("prompt + max_new_tokens over a 512-position model", rc == 0 and bool(note), note or err.strip()[-200:])

    # 11. kill -9 of a Ray driver: nothing of its local Ray instance is left (issue 24)
    import psutil

    d = root / "ray_driver"
    p = graft(d, "execution=ray", "steps=20")
    wait_for(lambda: len(lines(d / "metrics.jsonl")) >= 2, timeout=600)
    ours = [
        c
        for c in psutil.Process(p.pid).children(recursive=True)
        if "graft_rl.engine.reaper" not in " ".join(c.cmdline())
    ]
    p.kill()
    p.wait()
    t0 = time.time()
    left = ours
    while left and time.time() - t0 < 20:
        time.sleep(0.5)
        left = [c for c in ours if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    row(
        "kill -9 of the Ray driver",
        not left and len(ours) >= 3,
        f"{len(ours)} Ray processes, none left after {time.time() - t0:.1f} s"
        if not left
        else f"left: {[' '.join(c.cmdline())[:40] for c in left]}",
    )
    user_rewards(root, ref_metrics)
    lock_and_steps(root)
    between_commands(root, ref, ref_metrics)
    issue40(root)
    issue50(root)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(ok for _, ok, _ in ROWS) else 1


def lock_and_steps(root: Path) -> None:
    """Issue 33: a deleted RUN_DIR/.lock does not let a second writer in; --resume cannot lower steps."""
    d = root / "lock_deleted"
    p = graft(d, "steps=20")
    wait_for(lambda: len(lines(d / "metrics.jsonl")) >= 2 or p.poll() is not None)
    (d / ".lock").unlink()
    rc2, _, err2 = finish(graft(d, resume=True))
    p.send_signal(signal.SIGINT)
    rc1, _, _ = finish(p)
    steps = [(r["step"], r["policy"]) for r in lines(d / "metrics.jsonl")]
    row(
        "second graft train after RUN_DIR/.lock was deleted",
        rc2 == 2 and "in use by another graft train" in err2 and rc1 == 130 and len(steps) == len(set(steps)),
        (err2.strip().splitlines() or ["(no message)"])[-1].replace(str(root), "PROBE"),
    )
    before = (d / "config.yaml").read_text()
    rc, _, err = finish(graft(d, "steps=1", resume=True))
    row(
        "--resume steps=1 on a run past step 1",
        rc == 2 and "not lower them" in err and (d / "config.yaml").read_text() == before,
        (err.strip().splitlines() or ["(no message)"])[-1].replace(str(root), "PROBE"),
    )


def cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "graft_rl.commands.cli", *args], capture_output=True, text=True, env=env, timeout=900
    )
    return p.returncode, p.stdout, p.stderr


def last(err: str, root: Path) -> str:
    return (err.strip().splitlines() or ["(no message)"])[-1].replace(str(root), "PROBE")


def between_commands(root: Path, ref: Path, ref_metrics: list[dict]) -> None:
    """Issue 33: where one command's output meets another's, or an allowed change meets resume."""
    import torch

    # resume with execution=ray: refused when the thread count changes, identical when it is kept
    d = root / "to_ray"
    finish(graft(d, "steps=3"))
    rc1, _, err1 = finish(graft(d, "steps=8", "execution=ray", "ray.num_cpus=0.5", resume=True))
    threads = torch.get_num_threads()
    rc2, _, _ = finish(
        graft(d, "steps=8", "execution=ray", "ray.num_cpus=0.5", f"ray.torch_threads={threads}", resume=True)
    )
    same = strip(lines(d / "metrics.jsonl")) == ref_metrics
    row(
        "--resume execution=ray ray.num_cpus=0.5 (1 thread), then with ray.torch_threads kept",
        rc1 == 2 and "ray.torch_threads=" in err1 and rc2 == 0 and same,
        f"exit {rc1} ({last(err1, root)[:90]}...), then {rc2}; identical to the uninterrupted run: {same}",
    )
    # graft eval of one policy, then the other: both kept
    ev = ["eval", str(ref), "--benchmarks", "testbed_heldout", "--limit", "16", "--samples", "1", "--runs", "1"]
    rc_a, _, _ = cli(*ev, "--policy", "A")
    rc_b, _, _ = cli(*ev, "--policy", "B")
    kept = list(json.loads((ref / "eval" / "eval.json").read_text())["policies"])
    row("graft eval --policy A, then --policy B", rc_a == rc_b == 0 and kept == ["A", "B"], f"eval.json holds {kept}")
    rc, _, err = cli("seeds", str(ref), str(ref))
    row("graft seeds of the same run twice", rc == 2 and "given twice" in err, last(err, root))
    # a checkpoint without its manifest and with zeroed weights: damaged, resume falls back
    d = root / "no_manifest"
    finish(graft(d, "steps=4"))
    ckpt = d / "checkpoints" / "step_000004"
    (ckpt / "manifest.json").unlink()
    w = ckpt / "A" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    w.write_bytes(bytes(data))
    rc, out, _ = finish(graft(d, "steps=8", resume=True))
    same = strip(lines(d / "metrics.jsonl")) == ref_metrics
    row(
        "--resume with a checkpoint's manifest deleted and 4 KiB of its weights zeroed",
        rc == 0 and "manifest.json is missing" in out and same,
        f"exit {rc}; fell back to step 2: {'trying the one before' in out}; identical to the uninterrupted run: {same}",
    )
    # two checkpoints swapped by name
    root_c = d / "checkpoints"
    os.replace(root_c / "step_000006", root_c / "swap")
    os.replace(root_c / "step_000008", root_c / "step_000006")
    os.replace(root_c / "swap", root_c / "step_000008")
    rc, _, err = finish(graft(d, "steps=9", resume=True))
    row("--resume with two checkpoints swapped by name", rc == 2 and "holds step" in err, last(err, root)[:160])
    # best/B replaced by a symbolic link; graft eval of a best/ that lost a file
    d = root / "best_link"
    finish(graft(d, "steps=4"))
    os.replace(d / "best" / "B", root / "kept_B")
    os.symlink(root / "kept_B", d / "best" / "B")
    rc, _, err = finish(graft(d, "steps=8", resume=True))
    row(
        "--resume with best/B a symbolic link",
        rc == 2 and "symbolic link" in err and (root / "kept_B").is_dir(),
        last(err, root)[:160],
    )
    (d / "best" / "B").unlink()
    os.replace(root / "kept_B", d / "best" / "B")
    (d / "best" / "A" / "config.json").unlink()
    rc, _, err = cli(*ev[:1], str(d), *ev[2:], "--policy", "A")
    row("graft eval of a run whose best/A lost a file", rc == 2 and "not evaluated" in err, last(err, root)[:160])
    # SIGTERM during graft probe: one line, its temporary directory removed
    tmp = root / "tmp"
    tmp.mkdir()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graft_rl.commands.cli",
            "probe",
            f"run_dir={root / 'probe_run'}",
            "--out",
            str(root / "probe"),
        ],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: any(x.name.startswith("graft_probe_") for x in tmp.iterdir()) or p.poll() is not None)
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p)
    left = [x.name for x in tmp.iterdir() if x.name.startswith("graft_probe_")]
    row(
        "SIGTERM during graft probe",
        rc == 143 and not left and "Traceback" not in err,
        f"exit {rc}; {last(err, root)}; left: {left}",
    )


USER_REWARD = """
import os, time
from graft_rl.rewards import verify_gsm8k

def same(responses, problems):  # the built-in gsm8k verifier, as a user's function
    if os.path.exists(os.path.join(os.path.dirname(__file__), "BROKEN")):
        raise RuntimeError("the user's scorer lost its lookup table")
    return verify_gsm8k(responses, [p["answer"] for p in problems])

def forever(responses, problems):
    time.sleep(10**6)

def raises(responses, problems):
    raise ValueError("unexpected answer format")

def wrong_length(responses, problems):
    return [1.0, 0.0]

def sometimes_forever(responses, problems):  # hangs on a third of the generated responses
    if responses[0] != problems[0]["answer"] and len(responses[0]) % 3 == 0:
        time.sleep(10**6)
    return verify_gsm8k(responses, [p["answer"] for p in problems])
"""


def user_rewards(root: Path, ref_metrics: list[dict]) -> None:
    """Issue 31: a user's reward that hangs, raises, or breaks its contract: one line each, no hang, no loss."""
    (root / "user_reward.py").write_text(USER_REWARD)
    fn = f"data.reward={root / 'user_reward.py'}"
    for name, what, expect in [
        ("forever", "sleeps forever", "did not return within 1s"),
        ("raises", "raises", "raised ValueError: unexpected answer format"),
        ("wrong_length", "returns the wrong length", "reward contract: returned 2 scores for 1 response"),
    ]:
        d = root / f"reward_{name}"
        t0 = time.time()
        rc, _, err = finish(graft(d, f"{fn}:{name}", "data.verify_timeout=1"), timeout=300)
        msg = err.strip().splitlines()
        row(
            f"data.reward that {what}",
            rc == 2 and len(msg) == 1 and expect in msg[0] and not (d / "metrics.jsonl").exists(),
            f"exit {rc} after {time.time() - t0:.0f} s: {msg[-1] if msg else '(no message)'}",
        )
    d = root / "reward_sometimes"
    rc, _, err = finish(graft(d, f"{fn}:sometimes_forever", "data.verify_timeout=1", "steps=2"), timeout=600)
    hung = sum(r.get("verify_timeouts", 0) for r in lines(d / "metrics.jsonl"))
    row(
        "data.reward that hangs on some responses",
        rc == 0 and hung > 0,
        f"exit {rc}; {hung} responses timed out, scored 0, counted",
    )
    d = root / "reward_breaks_midrun"
    p = graft(d, f"{fn}:same")
    wait_for(lambda: len(lines(d / "metrics.jsonl")) >= 6 or p.poll() is not None)  # step 3 written
    (root / "BROKEN").write_text("")  # from the next scoring on, every call raises
    rc1, _, err = finish(p)
    kept = len(lines(d / "metrics.jsonl"))
    (root / "BROKEN").unlink()
    rc2, _, _ = finish(graft(d, resume=True))
    same = strip(lines(d / "metrics.jsonl")) == ref_metrics
    msg = err.strip().splitlines()
    row(
        "data.reward that starts failing mid-run, fixed, --resume",
        rc1 == 2 and len(msg) == 1 and "failed on every response" in msg[0] and rc2 == 0 and same,
        f"exit {rc1} with {kept} metric lines kept ({msg[-1][:80] if msg else '-'}...), then {rc2}; identical to "
        f"the built-in verifier's uninterrupted run: {same}",
    )


PROC_REWARD = """
import subprocess, time

def hangs(responses, problems):  # starts a child, then never returns
    subprocess.Popen(["sleep", "{marker}"])
    time.sleep(600)
    return [1.0]

def leaves_one(responses, problems):  # a background job per call
    subprocess.Popen(["sleep", "{marker}"])
    return [float("\\boxed" in responses[0])]
"""


def _sleepers(marker: str) -> int:
    import psutil

    return sum(
        1
        for p in psutil.process_iter(["cmdline", "status"])
        if p.info["cmdline"] == ["sleep", marker] and p.info["status"] != psutil.STATUS_ZOMBIE
    )


def issue40(root: Path) -> None:
    """Issue 40: the operating system under a reward, what a resume reads back, the printing paths."""
    import csv

    import torch

    # what a reward's processes leave after the run
    for fn, marker, what in (
        ("hangs", "317.25", "hangs after starting a child"),
        ("leaves_one", "317.5", "starts a background job per call"),
    ):
        (root / "proc_reward.py").write_text(PROC_REWARD.replace("{marker}", marker))
        d = root / f"procs_{fn}"
        rc, _, err = finish(
            graft(d, f"data.reward={root / 'proc_reward.py'}:{fn}", "data.verify_timeout=1", "steps=2"), 600
        )
        time.sleep(2)
        left = _sleepers(marker)
        row(f"data.reward that {what}", left == 0, f"exit {rc}; processes left after the run: {left}")

    # a reward's source edited between a run and its --resume; with --allow-changed reward
    (root / "edited.py").write_text(
        "from graft_rl.rewards import verify_gsm8k\n\ndef r(responses, problems):\n    return verify_gsm8k(responses, [p['answer'] for p in problems])\n"
    )
    d = root / "edited_reward"
    finish(graft(d, f"data.reward={root / 'edited.py'}:r", "steps=2"))
    (root / "edited.py").write_text("def r(responses, problems):\n    return [1.0] * len(responses)\n")
    rc1, _, err1 = finish(graft(d, "steps=3", resume=True))
    rc2, _, _ = finish(graft(d, "steps=3", "--allow-changed", "reward", resume=True))
    recorded = lines(d / "changes.jsonl")
    row(
        "reward file edited before --resume / with --allow-changed reward",
        rc1 == 2 and "--allow-changed reward" in err1 and rc2 == 0 and [r["step"] for r in recorded] == [3],
        f"exit {rc1}: {last(err1, root)[:110]}...; then exit {rc2}, changes.jsonl step {[r['step'] for r in recorded]}",
    )

    # a crafted checkpoint: its pickle would run code
    d = root / "crafted"
    finish(graft(d, "steps=2"))
    ckpt = d / "checkpoints" / "step_000002"
    state = torch.load(ckpt / "A" / "policy_state.pt", weights_only=True)
    marker = root / "payload_ran"
    torch.save({**state, "x": _Payload(str(marker))}, ckpt / "A" / "policy_state.pt")
    from graft_rl.engine.rundir import write_manifest

    write_manifest(ckpt, 2, (d / "run_id").read_text().strip())
    rc, _, err = finish(graft(d, "steps=3", resume=True))
    row(
        "crafted policy_state.pt, manifest updated",
        rc == 2 and not marker.exists(),
        f"exit {rc}; ran: {marker.exists()}; {last(err, root)[:120]}",
    )

    # a user's task through graft eval: a CSV, a file.py reward, mapping validation sets
    with (root / "task.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "target"])
        for i in range(64):
            w.writerow([f"What is {i} + {i}?", 2 * i])
    cols = "{problem: question, answer: target}"
    d = root / "user_task"
    rc1, _, _ = finish(
        graft(
            d,
            f"data.train={root / 'task.csv'}",
            f"data.columns={cols}",
            "steps=2",
            f"validation.data=[{{data: {root / 'task.csv'}, name: mine, columns: {cols}}}]",
        )
    )
    rc2, out, err = cli("eval", str(d), "--limit", "8", "--samples", "1", "--runs", "1")
    row(
        "graft eval RUN of a user's task (mapping validation sets)",
        rc1 == 0 and rc2 == 0 and "graft eval: mine;" in out,
        f"train exit {rc1}, eval exit {rc2}; "
        + next((ln for ln in out.splitlines() if ln.startswith("graft eval: mine;")), last(err, root))[:100],
    )

    # a start killed at its first write, a YAML tab, SIGTERM in graft eval
    d = root / "first_write"
    d.mkdir()
    (d / ".lock.tmp").write_text("")
    rc1, _, err1 = finish(graft(d, resume=True))
    rc2, _, _ = finish(graft(d, "steps=1"))
    row(
        "killed at its first write: --resume, then the same command",
        rc1 == 2 and rc2 == 0 and not (d / ".lock.tmp").exists(),
        f"{last(err1, root)[:100]}; then exit {rc2}",
    )
    (root / "tab.yaml").write_text("steps: 2\ndata:\n\ttrain: x\n")
    rc, _, err = cli("train", str(root / "tab.yaml"))
    row("a tab in a YAML config", rc == 2 and ":3:1:" in err, last(err, root))
    p = subprocess.Popen(
        [sys.executable, "-m", "graft_rl.commands.cli", "eval", str(root / "reference"), "--samples", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(8)
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p)
    row("SIGTERM during graft eval", rc == 143, f"exit {rc}; {last(err, root)[:100]}")

    # a large table: the first step of 200k rows against 2k
    times = {}
    for n in (2_000, 200_000):
        path = root / f"rows_{n}.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["question", "target"])
            w.writerows([f"What is {i % 997} + {i % 1009}?", i % 997 + i % 1009] for i in range(n))
        t0 = time.time()
        rc, _, _ = finish(
            graft(root / f"rows_run_{n}", f"data.train={path}", f"data.columns={cols}", "steps=1", "validation.data=[]")
        )
        times[n] = (rc, time.time() - t0)
    ratio = times[200_000][1] / times[2_000][1]
    row(
        "200k-row CSV vs 2k: time to the end of step 1",
        all(rc == 0 for rc, _ in times.values()) and ratio < 1.5,
        f"{times[2_000][1]:.0f} s vs {times[200_000][1]:.0f} s ({ratio:.2f}x)",
    )


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


#: run graft in this process, killed with SIGKILL at the rename that commits best/.committed/<policy>
#: (between replace_dir's two renames: the old copy moved aside, the new one not yet in place)
KILL_AT_COMMIT = """
import os, signal, sys
from graft_rl.engine import rundir
real = rundir.os.replace
def replace(src, dst):
    real(src, dst)
    if os.path.basename(os.path.dirname(str(dst))) == ".committed" and os.path.basename(str(dst)).startswith(".trash_"):
        os.kill(os.getpid(), signal.SIGKILL)
rundir.os.replace = replace
from graft_rl.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""

#: run graft with the disk under GRAFT_PROBE_FULL filling after its start-up check: every write of a
#: result there fails as a full disk's write() does, ENOSPC with no file name
FULL_DISK = """
import errno, os, pathlib, sys
full = os.environ["GRAFT_PROBE_FULL"]
real = pathlib.Path.write_text
def write_text(self, *a, **k):
    if str(self).startswith(full) and self.name != ".write_test":
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, *a, **k)
pathlib.Path.write_text = write_text
from graft_rl.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def issue50(root: Path) -> None:
    ref_metrics = strip(lines(root / "reference" / "metrics.jsonl"))
    d = root / "kill_at_commit"
    args = ["train", "--no-progress", f"run_dir={d}", *SETTINGS]
    p = subprocess.run([sys.executable, "-c", KILL_AT_COMMIT, *args], capture_output=True, text=True, timeout=900)
    left = sorted(str(x.relative_to(d)) for x in (d / "best" / ".committed").glob(".trash_*"))
    rc2, _, err = cli("train", "--no-progress", "--resume", str(d))
    trash = sorted(str(x.relative_to(d)) for x in d.rglob(".trash_*"))
    same = strip(lines(d / "metrics.jsonl")) == ref_metrics
    row(
        "kill -9 at the rename that commits best/, --resume",
        p.returncode == -signal.SIGKILL and bool(left) and rc2 == 0 and same and not trash,
        f"exit {p.returncode} leaving {left}; resume exit {rc2}; identical: {same}; .trash_* left: {trash or 'none'}",
    )

    out = root / "full_disk_eval"
    env = {**os.environ, "GRAFT_PROBE_FULL": str(out)}
    ev = ["eval", str(root / "reference"), "--limit", "8", "--samples", "1", "--runs", "1", "--out", str(out)]
    p = subprocess.run([sys.executable, "-c", FULL_DISK, *ev], capture_output=True, text=True, env=env, timeout=900)
    msg = last(p.stderr, root)
    row(
        "graft eval --out on a full disk",
        p.returncode == 2 and str(out).replace(str(root), "PROBE") in msg and "No space left" in msg,
        msg[:160],
    )


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    if sys.argv[1:] in (["--only", "40"], ["--only", "50"]):
        _root = Path(tempfile.mkdtemp(prefix="graft_probe_"))
        print("| check | result | detail |\n|---|---|---|", flush=True)
        finish(graft(_root / "reference"))
        (issue40 if sys.argv[2] == "40" else issue50)(_root)
        shutil.rmtree(_root, ignore_errors=True)
        sys.exit(0 if all(ok for _, ok, _ in ROWS) else 1)
    sys.exit(main())
