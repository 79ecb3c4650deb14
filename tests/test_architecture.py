"""SPEC §4: layers import only downwards (a module never imports from a layer below it), and the code lints clean."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "graft_rl"

#: SPEC §4 layers (1 = the equations ... 6 = the command line). ``config`` and ``store`` describe
#: policies and their rollouts, so they sit just below the methods that use them.
LAYERS: dict[str, float] = {
    "algo": 1,
    "seeding": 1,
    "rewards": 2,
    "data": 2,
    "policy": 3,
    "methods": 4,
    "config": 4,
    "store": 3.5,
    "rundir": 3.5,
    "rollouts": 5,
    "evaluation": 4,
    "plan": 4,
    "worker": 5,
    "distributed": 5,
    "reaper": 0,
    "errors": 0,
    "handles": 5,
    "trainer": 5,
    "checkpointing": 5,
    "validation": 5,
    "testbed": 5,
    "report": 5,
    "analyze": 5,
    "defaults": 6,
    "evaluate_cli": 6,
    "preflight": 6,
    "probe": 6,
    "cli": 6,
}


def _part(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("").parts
    return rel[0]


def _imports(path: Path) -> set[str]:
    """Top-level graft_rl parts imported anywhere in the file (function-local imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "graft_rl":
                continue
            if len(parts) > 1:
                out.add(parts[1])
            else:  # from graft_rl import algo
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; use absolute graft_rl imports")
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("graft_rl."))
    return out


def test_every_module_has_a_layer():
    parts = {_part(p) for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC}
    assert parts <= set(LAYERS), f"modules without a layer: {sorted(parts - set(LAYERS))}"


def test_layers_import_only_downwards():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path.parent == SRC and path.name == "__init__.py":
            continue
        own = _part(path)
        for dep in _imports(path):
            if dep in LAYERS and LAYERS[dep] > LAYERS[own]:
                bad.append(f"{path.relative_to(ROOT)} ({own}, layer {LAYERS[own]}) imports {dep} (layer {LAYERS[dep]})")
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff not installed")
def test_lint_clean():
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "src", "tests", "benchmarks", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


#: the size bounds (lines of code, docstrings not counted): a class or function past them is split
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def _code_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    doc = body[0] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else None
    doc_lines = doc.end_lineno - doc.lineno + 1 if doc is not None and isinstance(doc.value.value, str) else 0
    return node.end_lineno - node.lineno + 1 - doc_lines


def test_no_class_or_function_is_too_long():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and _code_lines(node) > MAX_CLASS_LINES:
                long.append(
                    f"{path.relative_to(ROOT)}: class {node.name} has {_code_lines(node)} lines (> {MAX_CLASS_LINES})"
                )
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _code_lines(node) > MAX_FUNCTION_LINES:
                long.append(
                    f"{path.relative_to(ROOT)}: {node.name}() has {_code_lines(node)} lines (> {MAX_FUNCTION_LINES})"
                )
    assert not long, "\n".join(long)


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff not installed")
def test_formatted():
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "src", "tests", "benchmarks", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed")
def test_algo_and_methods_type_check():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--ignore-missing-imports",
            "--follow-imports=silent",
            "--no-error-summary",
            "src/graft_rl/algo",
            "src/graft_rl/methods",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
