"""Methods are plugins: each registers itself and brings its keys, checks, exchange and objective;
the engine (trainer, worker, exchange, handles) names none of them."""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from graft_rl.engine.config import ConfigError, load_config, to_dict
from graft_rl.methods import (
    EXCHANGE_KEYS,
    Method,
    MethodConfig,
    build_method,
    method_names,
    register_method,
)
from graft_rl.methods.config import check_range
from graft_rl.methods.losses import register_loss, token_mean_clip
from graft_rl.methods.registry import LOSSES, METHODS

SRC = Path(__file__).resolve().parents[2] / "src" / "graft_rl"


def test_the_shipped_methods_are_registered_in_order():
    assert method_names()[:6] == ["grpo", "graft", "sgt", "luffy", "hacpo", "dr_grpo"]
    for name in method_names():
        assert build_method(MethodConfig(name=name)).name == name


def test_allowed_names_and_keys_come_from_the_registry():
    with pytest.raises(ConfigError, match=r"method.name: 'nope' is not one of grpo, graft, sgt, luffy, hacpo, dr_grpo"):
        MethodConfig(name="nope").validate()
    with pytest.raises(ConfigError, match=r"unknown key method.sgt_cof; did you mean 'sgt_coef'\?"):
        MethodConfig(name="sgt", sgt_cof=0.2)
    with pytest.raises(ConfigError, match=r"method.luffy_gamma is not used by method 'graft' \(it is used by: luffy\)"):
        MethodConfig(name="graft", luffy_gamma=0.2).validate()
    with pytest.raises(
        ConfigError, match=r"method.selection: 'x' is not one of complementary, random, all, graft, sgt"
    ):
        MethodConfig(name="graft", selection="x").validate()


def test_a_methods_own_keys_are_flat_in_yaml_and_read_as_attributes():
    cfg = MethodConfig(name="hacpo", hacpo_capability_window=3, kl_coef=1e-3)
    cfg.validate()
    assert cfg.hacpo_capability_window == 3 and cfg.params["hacpo_capability_window"] == 3
    flat = cfg.to_flat()
    assert flat["hacpo_capability_window"] == 3 and flat["kl_coef"] == 1e-3 and "params" not in flat
    cfg.hacpo_capability_window = 4  # assignment reaches the method's own keys
    assert cfg.params["hacpo_capability_window"] == 4
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # travels to Ray actors


def test_the_engine_names_no_method():
    """trainer, worker, handles, checkpointing, validation, the generic exchange and objective never
    branch on a method's name, the step loop has no ``execution ==`` branch, and HACPO's name
    appears in its own file only."""
    names = "|".join(method_names())
    for module in (
        "engine/trainer.py",
        "engine/rollouts.py",
        "engine/worker.py",
        "engine/handles.py",
        "engine/checkpointing.py",
        "engine/validation.py",
        "methods/exchange.py",
        "methods/objectives.py",
        "methods/base.py",
    ):
        text = (SRC / module).read_text()
        assert not re.search(rf"""name\s*(==|!=|in)\s*[(\[{{]?["']({names})["']""", text), module
    assert "execution ==" not in (SRC / "engine" / "trainer.py").read_text()
    for path in SRC.rglob("*.py"):
        if path.name != "hacpo.py":
            assert '"hacpo"' not in path.read_text(), path


# ---------------------------------------------------------------- a new method is one file
@dataclass
class _HalfParams:
    half_scale: float = 0.5  # the factor on every advantage


@pytest.fixture
def toy_method():
    """A method defined the way a contributor would, in one place: keys, check, and its one new part."""

    @register_loss("half_clip")
    def half_clip(lp, old, mask, ctx):
        loss, stats = token_mean_clip(lp, old, mask, ctx)
        return loss * ctx.cfg.half_scale, stats

    @register_method("half_grpo")
    class HalfGRPO(Method):
        Params = _HalfParams
        uses_peers = False
        preset = {**Method.preset, "loss": "half_clip"}

        @classmethod
        def check(cls, cfg):
            check_range(cfg, {"half_scale": (0.0, 1.0, False)})

    yield HalfGRPO
    del METHODS._entries["half_grpo"], LOSSES._entries["half_clip"]


def _data(tmp_path: Path) -> Path:
    p = tmp_path / "arith.jsonl"
    p.write_text(
        "".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    return p


def _cfg(tmp_path, tiny_pair, method: dict, run: str = "run"):
    return load_config(
        {
            "run_dir": str(tmp_path / run),
            "steps": 2,
            "prompt_batch": 8,
            "minibatch": 4,
            "n": 4,
            "max_new_tokens": 6,
            "checkpoint_every": 2,
            "data": {"train": str(_data(tmp_path))},
            "method": method,
            "policies": [
                {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
                {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3},
            ],
        }
    )


def pattern_reward(groups) -> dict:
    """A reward given to the trainer (no verifier): response i of prompt q is right iff i < q % 3."""
    for g in groups:
        g.rewards = [1.0 if i < int(g.prompt_id[1:]) % 3 else 0.0 for i in range(g.n)]
    return {"verify_timeouts": 0, "verify_errors": 0}


def test_a_method_registered_in_one_place_configures_and_trains(toy_method, tmp_path, tiny_pair):
    from graft_rl.engine.trainer import Trainer

    with pytest.raises(ConfigError, match=r"method.half_scale must be in \(0, 1\), got 2"):
        _cfg(tmp_path, tiny_pair, {"name": "half_grpo", "half_scale": 2.0})
    with pytest.raises(
        ConfigError, match=r"method.half_scale is not used by method 'grpo' \(it is used by: half_grpo\)"
    ):
        _cfg(tmp_path, tiny_pair, {"name": "grpo", "half_scale": 0.5})
    for key in EXCHANGE_KEYS[:1]:  # it reads no peer, so the exchange switches are refused
        with pytest.raises(ConfigError, match=rf"method.{key} is not used by method 'half_grpo'"):
            _cfg(tmp_path, tiny_pair, {"name": "half_grpo", key: "random"})
    cfg = _cfg(tmp_path, tiny_pair, {"name": "half_grpo", "half_scale": 0.25})
    assert to_dict(cfg)["method"]["half_scale"] == 0.25
    tr = Trainer(cfg, show_progress=False, reward_groups=pattern_reward)
    try:
        lines = tr.run()
    finally:
        tr.close()
    assert [(ln["step"], ln["policy"]) for ln in lines] == [(1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert all(ln["loss"] is not None and ln["exchanged_in"] == 0 for ln in lines)


def test_the_trainer_scores_with_the_reward_it_is_given(tmp_path, tiny_pair):
    from graft_rl.engine.trainer import Trainer

    seen = []

    def constant(groups):
        seen.extend(groups)
        for g in groups:
            g.rewards = [0.25] * g.n
        return {}

    tr = Trainer(_cfg(tmp_path, tiny_pair, {"name": "grpo"}), show_progress=False, reward_groups=constant)
    try:
        lines = tr.run(max_steps=1)
    finally:
        tr.close()
    assert len(seen) == 16 and all(ln["reward_mean"] == 0.25 for ln in lines)
    assert all(r == 0.25 for g in seen for r in g.rewards)

    # its old name still works for one version, with a warning; both at once is refused
    with pytest.warns(DeprecationWarning, match=r"Trainer\(scorer=...\) is deprecated .*reward_groups"):
        tr = Trainer(_cfg(tmp_path, tiny_pair, {"name": "grpo"}, "old"), show_progress=False, scorer=constant)
    try:
        assert tr.run(max_steps=1)[0]["reward_mean"] == 0.25
    finally:
        tr.close()
    with pytest.raises(TypeError, match="give reward_groups= only"):
        Trainer(_cfg(tmp_path, tiny_pair, {"name": "grpo"}, "both"), reward_groups=constant, scorer=constant)


def test_a_config_of_every_method_is_written_flat_and_reloads_identically(tmp_path):
    for name in method_names():
        cfg = load_config(
            {"policies": [{"name": "A", "model": "x"}, {"name": "B", "model": "y"}], "method": {"name": name}}
        )
        again = load_config(to_dict(cfg))
        assert again.method == cfg.method and to_dict(again) == to_dict(cfg)


def test_methods_state_is_checkpointed_through_the_method(tmp_path, tiny_pair):
    """HACPO's capability window lives in the method; a checkpoint carries it and resume restores it."""
    from graft_rl.engine.trainer import Trainer

    cfg = _cfg(tmp_path, tiny_pair, {"name": "hacpo"}, run="hacpo")
    tr = Trainer(cfg, show_progress=False, reward_groups=pattern_reward)
    try:
        tr.run()
        history = {k: list(v) for k, v in tr.method.success_history.items()}
    finally:
        tr.close()
    state = json.loads((Path(cfg.run_dir) / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["method_state"]["success_history"] == history and len(history["A"]) == 2
    resumed = Trainer.resume(cfg.run_dir, show_progress=False)
    try:
        assert {k: list(v) for k, v in resumed.method.success_history.items()} == history
        assert resumed.method.capability_of("A") == pytest.approx(sum(history["A"]) / 2)
    finally:
        resumed.close()


def test_no_part_declaration_is_read_with_getattr():
    """Issue 49: a part's declarations are fields of its typed record (``registry.Part`` and its kinds),
    read as attributes mypy checks; nothing in the package reads them off a function with ``getattr``."""
    import dataclasses
    import re
    from pathlib import Path

    from graft_rl.methods import registry

    names = {
        f.name
        for cls in (registry.AdvantagePart, registry.CompositionPart, registry.LossPart)
        for f in dataclasses.fields(cls)
    }
    names -= {"name"}
    src = Path(registry.__file__).resolve().parents[1]
    pattern = re.compile(r"getattr\([^)]*[\"'](" + "|".join(sorted(names)) + r")[\"']")
    hits = [
        f"{p.relative_to(src)}:{i}"
        for p in src.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
