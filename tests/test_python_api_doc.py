"""docs/python_api.md runs as written: its Python blocks, in order, in a fresh process and folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "python_api.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_the_promised_parts():
    code = "\n".join(blocks())
    for call in (
        "probe(",
        "Trainer(cfg, reward=exact_number",
        "my_reward.py:exact_number",
        "run_eval(",
        "metrics.jsonl",
    ):
        assert call in code, call


@pytest.mark.slow
def test_every_python_block_of_the_doc_runs(tmp_path):
    script = "\n\n".join(blocks())
    (tmp_path / "doc.py").write_text(script)
    res = subprocess.run([sys.executable, "doc.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout.splitlines()
    assert any(line.startswith("A {'mine':") for line in out), res.stdout[-2000:]
    assert (tmp_path / "runs" / "notebook" / "metrics.jsonl").is_file()
    assert (tmp_path / "runs" / "by_path" / "best").is_dir() and (tmp_path / "probe_out" / "probe.json").is_file()
