"""Run-directory primitives (graft_rl.engine.rundir): what an interrupted swap leaves, and write errors
that name their file."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from graft_rl.engine import rundir


def test_clean_stale_looks_inside_best_committed_and_restores_a_lone_complete_trash(tmp_path):
    committed = tmp_path / "best" / ".committed"
    (committed / ".trash_A").mkdir(parents=True)  # killed between replace_dir's renames: A is gone
    (committed / ".trash_A" / "w").write_text("old")
    rundir.write_manifest(committed / ".trash_A", step=2)
    (committed / "B").mkdir()
    (committed / ".trash_B").mkdir()  # killed after both renames: B is the new copy, the trash is stale
    (tmp_path / "checkpoints" / ".trash_step_000001").mkdir(parents=True)  # remove_dir killed mid-rmtree
    (tmp_path / "checkpoints" / ".trash_step_000001" / "w").write_text("half")
    removed = rundir.clean_stale(tmp_path)
    assert (committed / "A" / "w").read_text() == "old" and not (committed / ".trash_A").exists()
    assert not (committed / ".trash_B").exists() and (committed / "B").is_dir()
    assert not (tmp_path / "checkpoints" / "step_000001").exists()  # no manifest: never a checkpoint again
    assert not (tmp_path / "checkpoints" / ".trash_step_000001").exists()
    assert len(removed) == 3


def test_a_full_disk_write_names_its_file(tmp_path, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")  # as write() fails: no file name

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as info:
        rundir.write_text_atomic(tmp_path / "eval.json", "{}")
    assert info.value.filename == str(tmp_path / "eval.json") and info.value.errno == errno.ENOSPC
