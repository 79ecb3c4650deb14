"""The layers of docs/design.md: each is a folder (two small layer-0/1 modules sit at the top), and a
module imports only from its own layer or the layers below it; the code lints, formats and
type-checks clean, and no class or function grows past the size bounds."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "graft_rl"

#: docs/design.md's layers: 0 = errors ... 6 = the commands. A folder is a layer; ``errors``,
#: ``locks``, ``seeding`` and ``stats`` are the modules at the package's top; ``__main__`` (``python -m
#: graft_rl``) runs the commands.
LAYERS: dict[str, int] = {
    "errors": 0,
    "locks": 0,
    "seeding": 0,
    "stats": 0,
    "algo": 1,
    "rewards": 2,
    "data": 2,
    "policy": 3,
    "methods": 4,
    "engine": 5,
    "testbed": 5,
    "commands": 6,
    "__main__": 6,
}


def test_the_package_is_its_layer_folders():
    """Every module sits in a layer's folder (or is one of the top-level modules named above)."""
    top = {p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"}
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top <= set(LAYERS) and folders <= set(LAYERS), f"outside the layers: {sorted((top | folders) - set(LAYERS))}"


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


def _module_graph() -> dict[str, set[str]]:
    """graft_rl module -> the graft_rl modules it imports anywhere (function-local imports included);
    ``from graft_rl.x import y`` is an edge to ``graft_rl.x.y`` when that is a module, else to ``graft_rl.x``."""
    mods = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("").parts
        mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = p
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("graft_rl"):
                for a in node.names:
                    out.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("graft_rl"))
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def test_no_import_circle():
    """No module imports, directly or through others, a module that imports it back (no import is put
    inside a function to break a circle)."""
    graph = _module_graph()
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
    assert not circles, f"modules on an import circle: {sorted(circles)}"


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


@pytest.mark.slow  # mypy's first run analyses torch: 52-63 s on 2 cores of an AMD EPYC, 7 s with its cache
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed")
def test_algo_methods_and_engine_type_check():
    import mypy.version

    from graft_rl.policy.zoo import cache_dir

    # the cache (torch's analysis, checked against the files' hashes) in graft-rl's user cache, not the
    # checkout, so a fresh clone on a machine that ran the suite before does not analyse torch again
    cache = cache_dir() / f"mypy-{mypy.version.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--cache-dir",
            str(cache),
            "--ignore-missing-imports",
            "--follow-imports=silent",
            "--no-error-summary",
            "src/graft_rl/algo",
            "src/graft_rl/methods",
            "src/graft_rl/engine",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_worker_call_is_made_by_a_string_name():
    """The driver calls a policy's worker through typed handle methods (``handle.train(...)``), never by
    naming a ``PolicyWorker`` method in a string; each public worker call has its handle method."""
    import inspect
    import re

    from graft_rl.engine.handles import WorkerHandle
    from graft_rl.engine.worker import PolicyWorker

    calls = [
        n for n, f in inspect.getmembers(PolicyWorker, inspect.isfunction) if not n.startswith("_") and n != "name"
    ]
    pattern = re.compile(rf"""["']({"|".join(calls)})["']\s*,""")
    for folder in ("engine", "commands"):
        for path in (SRC / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                if re.search(r"submit|_call|\.call\(|getattr\(", line):
                    assert not pattern.search(line), f"{path.name}: {line.strip()}"
    typed = {n for n, _ in inspect.getmembers(WorkerHandle, inspect.isfunction)}
    wanted = {"generate", "train", "weigh_peers", "evaluate", "save", "load_state", "prompt_bound", "prompt_budget"}
    assert wanted <= typed


def test_the_tests_mirror_the_package():
    """A folder of tests is a folder of the package (tests/engine tests graft_rl/engine, ...); tests of the
    top-level modules, scripts, benchmarks and docs sit in tests/ itself."""
    package = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tests = {p.parent.name for p in (ROOT / "tests").glob("*/test_*.py")}
    assert tests <= package, f"test folders that are not package folders: {sorted(tests - package)}"
