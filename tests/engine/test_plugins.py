"""Your own parts from a config (issue 41): a method, advantage and loss defined in a file outside the
package, named in YAML, train with ``graft train``, resume (a changed plugin refused as a changed reward
is), and reach every command that reads the run and, under ``execution: ray``, every actor."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from graft_rl.commands.cli import main

PARTS = textwrap.dedent(
    '''
    """A user's parts: an advantage, a loss and a method made of them (outside the package)."""
    import os
    from pathlib import Path

    import torch

    from graft_rl.methods import Method, register_advantage, register_loss, register_method
    from graft_rl.methods.losses import token_mean_clip

    MARKS = Path(__file__).parent / "marks"


    def _mark(what):
        MARKS.mkdir(exist_ok=True)
        (MARKS / f"{what}.{os.getpid()}").touch()  # which process ran which part


    @register_advantage("sign")
    def sign(rewards, ctx):
        """+1 above the group's mean, -1 below, 0 at it."""
        _mark("advantage")
        return torch.sign(rewards - rewards.mean(dim=1, keepdim=True))


    @register_loss("user_half_clip")
    def half_clip(lp, old, mask, ctx):
        """GRAFT's token loss at half the step."""
        _mark("loss")
        loss, stats = token_mean_clip(lp, old, mask, ctx)
        return loss * 0.5, stats


    def plain_loss(lp, old, mask, ctx):
        """Not registered: named as parts.py:plain_loss, it is a token-mean, weighted loss by default."""
        _mark("plain")
        return token_mean_clip(lp, old, mask, ctx)


    @register_method("sign_graft")
    class SignGraft(Method):
        preset = {**Method.preset, "advantage": "sign", "loss": "user_half_clip"}
    '''
)

REWARD = "def odd(responses, problems):\n    return [float(len(r) % 2) for r in responses]\n"


@pytest.fixture()
def task(tmp_path, tiny_pair, monkeypatch):
    """A folder as a user has it: parts.py, reward.py, data, and a config naming them by relative path."""
    (tmp_path / "parts.py").write_text(PARTS)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    cfg = {
        "run_dir": "run",
        "steps": 2,
        "prompt_batch": 4,
        "minibatch": 4,
        "n": 4,
        "max_new_tokens": 6,
        "checkpoint_every": 1,
        "plugins": ["parts.py"],
        "data": {"train": "train.jsonl", "reward": "reward.py:odd", "success_threshold": 1.0},
        "method": {"name": "sign_graft", "balance": False},
        "policies": [
            {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
            {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3},
        ],
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forget_file_plugins()


def forget_file_plugins() -> None:
    """Remove from every registry what file plugins registered: it leaves with the test that imported them."""
    from graft_rl.methods.registry import METHODS, PART_KEYS

    for registry in (METHODS, *PART_KEYS.values()):
        for key, obj in list(registry._entries.items()):
            if str(getattr(getattr(obj, "fn", obj), "__module__", "")).startswith("graft_rl_plugin_"):
                del registry._entries[key]


def _marks(root: Path, what: str) -> set[int]:
    return {int(p.suffix[1:]) for p in (root / "marks").glob(f"{what}.*")}


def _advantages(run: Path) -> set[float]:
    """The advantages of every grafted peer response of the run (its exchange records)."""
    from graft_rl.engine.store import RecordStore

    store = RecordStore(run)
    return {r["advantage"] for name in ("A", "B") for r in store.read_exchange(name)}


def test_a_users_method_from_a_file_trains_resumes_and_refuses_a_changed_plugin(task, capsys):
    assert main(["train", "task.yaml", "--no-progress"]) == 0
    saved = yaml.safe_load((task / "run" / "config.yaml").read_text())
    assert saved["plugins"] == [str(task / "parts.py")]  # made absolute: the run resumes from anywhere
    assert _marks(task, "advantage") and _marks(task, "loss")
    grafted = _advantages(task / "run")
    assert grafted and grafted <= {-1.0, 0.0, 1.0}  # the user's estimator computed the grafted advantages
    (task / "parts.py").write_text(PARTS + "\n# edited\n")
    capsys.readouterr()
    assert main(["train", "--resume", "run", "--no-progress", "steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plugin" in err[0] and "parts.py changed" in err[0] and "--allow-changed plugin" in err[0]
    assert main(["train", "--resume", "run", "--no-progress", "steps=3", "--allow-changed", "plugin"]) == 0
    changes = [json.loads(x) for x in (task / "run" / "changes.jsonl").read_text().splitlines()]
    assert [(c["step"], c["kind"]) for c in changes] == [(3, "plugin")]


def test_a_part_named_by_file_and_name_needs_no_plugins_list(task):
    cfg = yaml.safe_load((task / "task.yaml").read_text())
    cfg.update(plugins=[], run_dir="run2", steps=1)
    cfg["method"] = {"name": "graft", "advantage": "parts.py:sign", "loss": "parts.py:plain_loss", "balance": False}
    (task / "keyed.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "keyed.yaml", "--no-progress"]) == 0
    saved = yaml.safe_load((task / "run2" / "config.yaml").read_text())
    assert saved["method"]["advantage"] == f"{task / 'parts.py'}:sign"
    assert saved["method"]["loss"] == f"{task / 'parts.py'}:plain_loss"
    assert _marks(task, "advantage") and _marks(task, "plain")


@pytest.mark.slow
def test_the_commands_that_read_a_run_import_its_plugins(task, capsys, tmp_path_factory):
    import subprocess
    import sys

    assert main(["train", "task.yaml", "--no-progress", "steps=1"]) == 0
    # a fresh process (nothing imported yet) reads the run: the plugin is imported from the saved config
    out = tmp_path_factory.mktemp("probe")
    code = (
        "from graft_rl.commands.cli import main; import sys; "
        f"sys.exit(main(['probe', 'run/config.yaml', '--limit', '4', '--no-progress', '--out', {str(out)!r}]))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=task, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert (out / "probe.json").is_file()
    assert main(["config", "show", "sign_graft"]) == 0
    assert "advantage sign" in capsys.readouterr().out


def test_a_missing_plugin_is_one_line(task, capsys):
    cfg = yaml.safe_load((task / "task.yaml").read_text())
    cfg["plugins"] = ["nowhere.py"]
    (task / "bad.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "bad.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plugins.0" in err[0] and "nowhere.py: no such file" in err[0]
    cfg["plugins"] = []
    cfg["method"] = {"name": "graft", "loss": "parts.py:nothing_here"}
    (task / "bad2.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "bad2.yaml", "--no-progress"]) == 2
    assert "has no 'nothing_here'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_users_method_trains_and_resumes_under_ray_where_the_file_is_only_on_the_driver(task, ray_local):
    """Each actor imports the driver's copy of the plugin (sent as its source), so a node without the
    file trains too: the file is moved away once the driver has read it."""
    import os

    cfg = yaml.safe_load((task / "task.yaml").read_text())
    cfg.update(execution="ray", ray={"num_cpus": 0.5, "torch_threads": 1})
    (task / "ray.yaml").write_text(yaml.safe_dump(cfg))
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    config = load_config(task / "ray.yaml")
    (task / "parts.py").rename(task / "parts.moved")  # the actors cannot read it from disk
    tr = Trainer(config, show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    loss_pids = _marks(task, "loss")
    assert loss_pids and os.getpid() not in loss_pids  # the loss ran in the actors
    (task / "parts.moved").rename(task / "parts.py")
    assert main(["train", "--resume", "run", "--no-progress", "steps=3"]) == 0
    lines = [json.loads(x) for x in (task / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 1, 2, 2, 3, 3]


def test_one_plugin_file_named_as_a_module_and_as_a_path_is_one_plugin(task, monkeypatch, capsys):
    """`plugins: [mytask_issue50.parts]` with `method.loss: /abs/.../parts.py:NAME` (the same file)."""
    import sys

    pkg = task / "mytask_issue50"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parts.py").write_text(PARTS.replace('"sign"', '"median_baseline"'))
    monkeypatch.syspath_prepend(str(task))
    cfg = yaml.safe_load((task / "task.yaml").read_text())
    cfg.update(plugins=["mytask_issue50.parts"], run_dir="run_named", steps=1)
    cfg["method"] = {"name": "graft", "advantage": "median_baseline", "loss": f"{pkg / 'parts.py'}:half_clip"}
    (task / "named.yaml").write_text(yaml.safe_dump(cfg))
    try:
        assert main(["train", "named.yaml", "--no-progress"]) == 0, capsys.readouterr().err
        assert _marks(pkg, "loss") and _marks(pkg, "advantage")
    finally:
        from graft_rl.methods.registry import METHODS, PART_KEYS

        for registry in (METHODS, *PART_KEYS.values()):
            for key, obj in list(registry._entries.items()):
                if "mytask_issue50" in str(getattr(getattr(obj, "fn", obj), "__module__", "")):
                    del registry._entries[key]
        sys.modules.pop("mytask_issue50.parts", None)
        sys.modules.pop("mytask_issue50", None)


def test_two_files_registering_one_name_are_refused_naming_both(task, capsys):
    (task / "other.py").write_text(
        "from graft_rl.methods import register_advantage\n\n\n"
        "@register_advantage('sign')\ndef sign(rewards, ctx):\n    return rewards\n"
    )
    cfg = yaml.safe_load((task / "task.yaml").read_text())
    cfg.update(plugins=["parts.py", "other.py"], run_dir="run_clash")
    (task / "clash.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "clash.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "registered twice" in err[0]
    assert f"{task / 'parts.py'}: sign" in err[0] and f"{task / 'other.py'}: sign" in err[0]


@pytest.mark.parametrize("gone", ["parts.py", "reward.py"])
def test_a_plugin_or_reward_file_gone_at_resume_is_named_in_one_line(task, capsys, gone):
    import hashlib

    assert main(["train", "task.yaml", "--no-progress", "steps=1"]) == 0
    digest = hashlib.sha256((task / gone).read_bytes()).hexdigest()
    (task / gone).rename(task / f"{gone}.moved")
    from graft_rl.methods import registry
    from graft_rl.rewards import custom

    for cache in (registry._MODULES, registry._SOURCES, registry._PLUGIN_FILES, custom._CACHE):
        cache.clear()  # as a fresh `graft train --resume` process finds them
    capsys.readouterr()
    assert main(["train", "--resume", "run", "--no-progress", "steps=2"]) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert len(err) == 1 and "damaged" not in err[0] + out, err
    assert str(task / gone) in err[0] and digest[:12] in err[0] and "no such file" in err[0]
    assert "put it back" in err[0], err[0]
    (task / f"{gone}.moved").rename(task / gone)  # back where the run recorded it: the resume goes on
    assert main(["train", "--resume", "run", "--no-progress", "steps=2"]) == 0


def test_config_show_lists_a_users_method_from_its_plugins_or_its_config(task, capsys):
    assert main(["config", "show", "sign_graft", "--plugins", "parts.py"]) == 0
    out = capsys.readouterr().out
    out = " ".join(out.split())  # the listing wraps at 100 columns
    assert "method sign_graft" in out and "advantage sign" in out and "loss user_half_clip" in out
    assert main(["config", "show", "task.yaml"]) == 0  # its plugins: parts.py
    assert "method sign_graft" in capsys.readouterr().out
    assert main(["config", "show", "no_such_method"]) == 2
    assert "add --plugins SPEC" in capsys.readouterr().err
