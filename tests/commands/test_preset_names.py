"""Issue 63: the presets live inside the package, and every command that takes a config takes a preset
by name (``lookup/graft``); a file wins over a name, and says so; ``graft config list`` lists them;
``graft config init FILE --from NAME`` writes one self-contained file; ``python -m graft_rl`` is ``graft``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import graft_rl
from graft_rl.commands.cli import main
from graft_rl.engine import presets
from graft_rl.engine.config import load_config, read_config_file, to_dict
from graft_rl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
#: what a checkout holds beside its source: venvs, runs, builds, caches
NOT_SOURCE = (".git", ".venv*", "runs", "site", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis")


def test_the_presets_are_one_tree_inside_the_package_and_the_checkouts_configs_is_it():
    assert Path(graft_rl.__file__).resolve().parent / "configs" == presets.PRESETS
    assert (ROOT / "configs").resolve() == presets.PRESETS.resolve()
    names = [p.name for p in presets.presets()]
    assert {"lookup/graft", "paper/pair1/graft", "paper/pair1/graft_lora", "real/cpu", "testbed/graft"} <= set(names)
    assert names == sorted(names) and all(p.about for p in presets.presets())
    # the wheel carries them: package-data names every depth of the tree
    depths = {len(p.relative_to(presets.PRESETS).parts) for p in presets.PRESETS.rglob("*.yaml")}
    globs = (ROOT / "pyproject.toml").read_text()
    for d in depths:
        assert "configs/" + "*/" * (d - 1) + "*.yaml" in globs, d


@pytest.mark.parametrize("form", ["lookup/graft", "lookup/graft.yaml", "configs/lookup/graft.yaml"])
def test_a_preset_is_named_with_or_without_its_folder_and_suffix(form, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no checkout here
    path, note = presets.resolve(form)
    assert path == presets.PRESETS / "lookup" / "graft.yaml" and note is None
    assert load_config(form).method.name == "graft"


def test_a_local_file_wins_over_a_preset_of_its_name_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lookup").mkdir()
    (tmp_path / "lookup" / "graft.yaml").write_text(
        "base: " + str(presets.PRESETS / "lookup" / "graft.yaml") + "\nn: 4\n"
    )
    for form in ("lookup/graft", "lookup/graft.yaml"):
        cfg = load_config(form)
        assert cfg.n == 4
        err = capsys.readouterr().err
        assert "using the file lookup/graft.yaml, not the preset lookup/graft" in err and err.count("\n") == 1


def test_a_name_that_is_neither_a_file_nor_a_preset_is_one_line_with_the_nearest_presets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as exc:
        load_config("lookup/grafr")
    msg = str(exc.value)
    assert "\n" not in msg and "not found, nor a preset" in msg and "lookup/graft" in msg
    for bad in ("../secret", "/etc/passwd"):
        assert presets.preset_path(bad) is None


def test_config_list_names_every_preset_with_its_hardware(capsys):
    assert main(["config", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {ln.split()[0]: ln for ln in lines[1:]}
    assert set(rows) == {p.name for p in presets.presets()}
    assert " CPU, hf " in rows["lookup/graft"]
    assert " 4 GPUs (2 + 2), Ray, vllm " in rows["paper/pair1/graft"]


@pytest.mark.parametrize("name", ["lookup/graft", "paper/pair1/graft_lora"])
def test_config_init_from_a_preset_writes_one_file_that_loads_to_the_preset(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "init", "mine.yaml", "--from", name]) == 0
    assert "graft train mine.yaml" in capsys.readouterr().out
    text = (tmp_path / "mine.yaml").read_text()
    assert "\nbase:" not in text and text.startswith("#")
    assert read_config_file("mine.yaml") == read_config_file(name)
    assert to_dict(load_config("mine.yaml")) == to_dict(load_config(name))
    assert main(["config", "init", "mine.yaml", "--from", name]) == 2  # kept, not replaced
    assert "exists" in capsys.readouterr().err
    assert main(["config", "init", "b.yaml", "--from", name, "--data", "x.jsonl"]) == 2
    assert not (tmp_path / "b.yaml").exists()


def test_config_show_takes_a_preset_name(capsys):
    assert main(["config", "show", "paper/pair1/hacpo"]) == 0
    assert capsys.readouterr().out.startswith("method hacpo")


def test_python_dash_m_graft_rl_is_the_graft_command():
    res = subprocess.run([sys.executable, "-m", "graft_rl", "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"graft-rl {graft_rl.__version__}"


@pytest.mark.slow
def test_from_a_built_wheel_outside_the_checkout_the_presets_train_plan_and_copy(tmp_path):
    """Issue 63: the wheel (built from this checkout, installed --no-deps into a scratch target), run from
    an empty folder: ``python -m graft_rl train lookup/graft`` trains, ``plan paper/pair1/graft`` sizes the
    paper preset, and a file from ``config init --from`` trains."""
    wheels, target, work, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "empty", tmp_path / "source"
    work.mkdir()
    # built from a copy: pip builds in the tree (build/, *.egg-info), and CI installs the checkout into
    # the vLLM venv while this suite runs
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = subprocess.run(
        [*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("graft_rl-*.whl")
    with zipfile.ZipFile(wheel) as z:  # what a package index shows: classifiers, the licence's full text
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(info).decode()
        licence = z.read(info.replace("METADATA", "licenses/LICENSE")).decode()
    assert meta.count("\nClassifier: ") >= 6 and "\nLicense-Expression: Apache-2.0" in meta
    assert meta.count("\nProject-URL: ") >= 4, "Homepage, Documentation, Changelog, Issues"
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in licence and len(licence) > 10000
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(target)}

    def graft(*args):
        res = subprocess.run(
            [sys.executable, "-m", "graft_rl", *args], cwd=work, env=env, capture_output=True, text=True, timeout=900
        )
        assert res.returncode == 0, (args, res.stdout[-2000:], res.stderr[-2000:])
        return res.stdout

    assert graft("--version").strip() == f"graft-rl {graft_rl.__version__}"
    graft("train", "lookup/graft", "steps=2", "--no-progress")
    assert (work / "runs" / "lookup" / "graft" / "metrics.jsonl").is_file()
    assert "fits" in graft("plan", "paper/pair1/graft")
    graft("config", "init", "mine.yaml", "--from", "lookup/graft")
    graft("train", "mine.yaml", "steps=1", "run_dir=mine", "--no-progress")
    assert str(target) in graft("config", "list").splitlines()[0]
