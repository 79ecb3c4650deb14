"""Run-directory primitives (graft_rl.engine.rundir): what an interrupted swap leaves, and write errors
that name their file."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from graft_rl.engine import rundir


def test_clean_stale_looks_inside_best_committed_and_restores_a_lone_trash(tmp_path):
    committed = tmp_path / "best" / ".committed"
    (committed / ".trash_A").mkdir(parents=True)  # killed between replace_dir's renames: A is gone
    (committed / ".trash_A" / "w").write_text("old")
    (committed / "B").mkdir()
    (committed / ".trash_B").mkdir()  # killed after both renames: B is the new copy, the trash is stale
    removed = rundir.clean_stale(tmp_path)
    assert (committed / "A" / "w").read_text() == "old" and not (committed / ".trash_A").exists()
    assert not (committed / ".trash_B").exists() and (committed / "B").is_dir()
    assert len(removed) == 2


def test_a_full_disk_write_names_its_file(tmp_path, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")  # as write() fails: no file name

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as info:
        rundir.write_text_atomic(tmp_path / "eval.json", "{}")
    assert info.value.filename == str(tmp_path / "eval.json") and info.value.errno == errno.ENOSPC
