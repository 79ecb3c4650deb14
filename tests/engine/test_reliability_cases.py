"""Cases outside the reliability probe's first list (issue 40, item 6), each through the command line:
a full disk names the file, a YAML error its line and column, a process out of memory is one line,
SIGTERM exits 143 from every command, and a start killed at its first write starts again."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from graft_rl.commands.cli import main
from graft_rl.engine.config import to_dict
from graft_rl.engine.rundir import append_lines
from graft_rl.engine.trainer import Trainer


@pytest.fixture
def cfg_file(make_cfg, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(to_dict(make_cfg(steps=1, run="cases"))))
    return path


def test_a_full_disk_names_the_file_even_where_the_os_does_not(cfg_file, fake_rewards, monkeypatch, capsys):
    with pytest.raises(OSError) as err:  # /dev/full: every write fails with ENOSPC, as a full disk does
        append_lines(Path("/dev/full"), ["x" * 10_000])
    assert err.value.errno == errno.ENOSPC and err.value.filename == "/dev/full"

    def full(self, lines):
        append_lines(Path("/dev/full"), [str(x) for x in lines])

    monkeypatch.setattr(Trainer, "_write_metrics", full)
    assert main(["train", str(cfg_file), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "graft train: cannot write /dev/full: No space left on device; free space or write elsewhere "
        "(earlier results are intact)"
    ]


def test_a_yaml_error_gives_its_line_and_column(tmp_path, capsys):
    bad = tmp_path / "tab.yaml"
    bad.write_text("steps: 2\ndata:\n\ttrain: x\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"graft train: {bad}:3:1: not valid YAML") and err.endswith(
        "YAML indents with spaces, not tabs)"
    )
    assert main(["plan", str(bad)]) == 2 and ":3:1:" in capsys.readouterr().err


def _command_doing(fn, command, cfg_file, tmp_path, monkeypatch) -> list[str]:
    """The command line of ``command``, whose work (the trainer's run, run_eval, probe) is ``fn``."""
    where = {
        "train": (Trainer, "run"),
        "eval": ("graft_rl.commands.evaluate_cli.run_eval",),
        "probe": ("graft_rl.commands.probe.probe",),
    }[command]
    monkeypatch.setattr(*where, fn)
    target = str(tmp_path) if command == "eval" else str(cfg_file)
    return [command, target] + ([] if command == "eval" else ["--no-progress"])


OOM = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 93458923520 bytes. Error code 12")


@pytest.mark.parametrize("command", ["train", "eval", "probe"])
def test_a_process_out_of_memory_is_one_line(command, cfg_file, tmp_path, monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise OOM

    assert main(_command_doing(oom, command, cfg_file, tmp_path, monkeypatch)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"graft {command}: out of memory (DefaultCPUAllocator")
    assert "lower prompt_batch, n, max_new_tokens" in err


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.parametrize("command", ["eval", "probe"])
def test_every_command_exits_128_plus_the_signal(command, sig, code, cfg_file, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises here

    assert main(_command_doing(interrupted, command, cfg_file, tmp_path, monkeypatch)) == code


def test_a_start_killed_at_its_first_write_starts_again(cfg_file, fake_rewards, capsys):
    cfg = yaml.safe_load(cfg_file.read_text())
    run = Path(cfg["run_dir"])
    run.mkdir(parents=True)
    (run / ".lock.tmp").write_text("")  # SIGKILL while the lock's pid file was written
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "stopped before its config was written (nothing to resume); start it again with graft train CONFIG" in err
    assert main(["train", str(cfg_file), "--no-progress"]) == 0  # the same command again starts it
    assert not (run / ".lock.tmp").exists() and (run / "metrics.jsonl").is_file()
