"""Methods as presets of parts (methods/base.py, methods/config.py): every shipped method is one,
combinations that cannot work are refused in one line, a swapped part reaches the objective and
trains from the command line, and the engine reads no method attribute."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graft_rl.engine.config import ConfigError
from graft_rl.methods import MethodConfig, build_method
from graft_rl.methods.registry import LOSSES, PART_KEYS

SRC = Path(__file__).resolve().parents[2] / "src" / "graft_rl"


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            {"name": "graft", "advantage": "hacpo"},
            r"method.advantage 'hacpo' compares a receiver's group with a peer's",
        ),
        ({"name": "graft", "composition": "hacpo_pool", "advantage": "hacpo"}, r"reads each policy's capability"),
        ({"name": "graft", "composition": "aux_target"}, r"auxiliary targets and their loss come together"),
        ({"name": "sgt", "aux_loss": "none"}, r"auxiliary targets and their loss come together"),
        ({"name": "graft", "loss": "luffy"}, r"set method.weighting: none"),
        ({"name": "sgt", "pooled": True}, r"method.pooled: true is composition 'pool'"),
        ({"name": "graft", "loss": "nope"}, r"method.loss: 'nope' is not one of token_mean_clip, gspo"),
        ({"name": "graft", "gspo_clip_low": 0.1}, r"method.gspo_clip_low is not used by method 'graft'"),
        ({"name": "graft", "loss": "gspo", "gspo_clip_low": 1.5}, r"method.gspo_clip_low must be in \[0, 1\)"),
        ({"name": "grpo", "weighting": "none"}, r"method.weighting is not used by method 'grpo'"),
    ],
)
def test_combinations_that_cannot_work_are_refused_in_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as err:
        MethodConfig(**keys).validate()
    assert "\n" not in str(err.value)


def test_every_shipped_method_is_a_preset_of_registered_parts():
    from graft_rl.methods import method_class, method_names

    for name in method_names():
        cls = method_class(name)
        assert set(cls.preset) == set(PART_KEYS)
        for kind, registry in PART_KEYS.items():
            registry.get(cls.preset[kind])
    assert method_class("graft").preset == {
        "advantage": "grpo",
        "selection": "complementary",
        "composition": "replace",
        "weighting": "gate",
        "loss": "token_mean_clip",
        "aux_loss": "none",
        "correction": "none",
    }


def test_a_preset_written_before_the_correction_key_gets_its_default():
    """A user's method whose preset names no ``correction`` (written before the key existed) registers,
    builds and validates, with correction ``none``."""
    from graft_rl.methods import Method, MethodConfig, register_method
    from graft_rl.methods.registry import METHODS

    old_preset = {k: v for k, v in Method.preset.items() if k != "correction"}

    @register_method("_old_preset_method")
    class OldPreset(Method):
        preset = old_preset

    try:
        cfg = MethodConfig(name="_old_preset_method")
        cfg.validate()
        assert cfg.part_name("correction") == "none"
        cfg = MethodConfig(name="_old_preset_method", correction="tis")
        cfg.validate()
        assert cfg.part_name("correction") == "tis"
    finally:
        METHODS._entries.pop("_old_preset_method", None)


def test_a_swapped_part_reaches_the_receivers_objective():
    assert build_method(MethodConfig(name="graft", loss="gspo")).receiver().objective.loss is LOSSES.get("gspo")


def test_each_shipped_part_is_short():
    """Each part is at most 40 lines apart from its docstring (the equation is in graft_rl.algo)."""
    import ast
    import inspect

    for registry in PART_KEYS.values():
        for name in registry.names():
            obj = registry.get(name).fn
            if not obj.__module__.startswith("graft_rl."):
                continue
            node = ast.parse(inspect.getsource(obj).lstrip()).body[0]
            doc = ast.get_docstring(node) or ""
            body = len(inspect.getsource(obj).splitlines()) - (len(doc.splitlines()) if doc else 0)
            assert body <= 40, (registry.kind, name, body)


# ---------------------------------------------------------------- the engine reads no method attribute
def test_no_file_under_engine_or_policy_names_a_method_or_reads_its_attributes():
    from graft_rl.methods import method_names

    names = "|".join(method_names())
    attrs = ["keeps_cut", "is_aux", ".position", "loss_mask", "compatibility_score", "extras", "uses_peers"]
    for folder in ("engine", "policy"):
        for path in (SRC / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(rf"""["']({names})["']""", text), path
            for attr in attrs:
                assert attr not in text, (path, attr)


# ---------------------------------------------------------------- GRAFT with another part, as a user runs it
@pytest.mark.parametrize("override", ["method.advantage=rloo", "method.advantage=dr_grpo", "method.loss=gspo"])
def test_graft_trains_with_a_swapped_part_from_the_command_line(override, tmp_path, capsys):
    """``graft train configs/testbed/graft.yaml method.advantage=rloo`` (and the others) train."""
    import json

    from graft_rl.commands.cli import main

    root = Path(__file__).resolve().parents[2]
    small = ["prompt_batch=16", "minibatch=4", "n=4", "max_new_tokens=24", "checkpoint_every=100", "validation.data=[]"]
    args = [
        "train",
        str(root / "configs/testbed/graft.yaml"),
        override,
        "steps=2",
        f"run_dir={tmp_path / 'run'}",
        *small,
    ]
    assert main([*args, "--no-progress"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(ln["loss"] is not None for ln in lines)
    assert sum(ln["exchanged_in"] for ln in lines) > 0  # it grafts
    key, value = override.removeprefix("method.").split("=")
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"{key}: {value}" in saved


def test_a_method_written_against_the_old_hooks_is_refused_when_registered():
    from graft_rl.methods import Method, register_method

    with pytest.raises(ValueError, match=r"method 'old_style' overrides objective\(\): a method now names its parts"):

        @register_method("old_style")
        class OldStyle(Method):
            def objective(self):
                return None


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("graft_rl.methods.grpo", "OwnGroupsOnly"),
        ("graft_rl.methods.dr_grpo", "DrGRPOExchange"),
        ("graft_rl.methods.graft", "PooledExchange"),
        ("graft_rl.methods.sgt", "SGTObjective"),
        ("graft_rl.methods.hacpo", "HacpoExchange"),
        ("graft_rl.methods.luffy", "LuffyObjective"),
        ("graft_rl.methods.exchange", "Weighting"),
    ],
)
def test_a_removed_public_name_points_to_the_porting_guide(module, name):
    import importlib

    mod = importlib.import_module(module)
    with pytest.raises(
        ImportError,
        match=rf"{module}.{name} was removed in 0.1.0.*porting guide, https://graft-rl.github.io/graft-rl/porting/",
    ):
        exec(f"from {module} import {name}", {})
    assert not hasattr(mod, "no_such_name")
    assert name in (Path(__file__).parents[2] / "docs" / "porting.md").read_text()  # the guide names it
