"""`graft config show`: every config key, its default and a one-line meaning from the config
classes' own comments, per section and per method."""

from __future__ import annotations

import pytest

from graft_rl.commands.cli import main
from graft_rl.commands.keys import SECTIONS, describe, show
from graft_rl.methods import method_names
from graft_rl.methods.config import method_params


def test_every_key_of_every_section_and_method_has_a_default_and_a_meaning():
    for name, (_, cls) in SECTIONS.items():
        rows = describe(cls)
        assert rows, name
        assert all(meaning for _, _, meaning in rows), [(name, k) for k, _, m in rows if not m]
    for name in method_names():
        for params in method_params(name):
            assert all(meaning for _, _, meaning in describe(params)), name


def test_a_section_lists_its_keys_with_defaults():
    text = show("method")
    assert text.startswith("method (method.KEY)")
    assert "delta" in text and "0.8" in text and "s > delta" in text
    assert "hacpo: hacpo_capability_window, hacpo_self_clip_low" in text.replace("\n    ", " ")  # parts included
    assert "loss: token_mean_clip, gspo" in text.replace("\n    ", " ")  # the parts a key can name
    hacpo = show("hacpo")
    assert "hacpo_capability_window" in hacpo and "5" in hacpo and "hacpo_peer_clip_start" in hacpo
    assert "advantage hacpo" in hacpo
    assert "no keys of its own" in show("graft")


def test_the_command_prints_and_refuses_what_it_does_not_know(capsys):
    assert main(["config", "show", "data"]) == 0
    out = capsys.readouterr().out
    assert "verify_timeout" in out and "5.0" in out
    assert main(["config", "show", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope' is neither a section" in err[0]


@pytest.mark.parametrize("what", [None, *SECTIONS])
def test_every_listing_fits_100_columns(what):
    assert all(len(line) <= 100 for line in show(what).splitlines() if not line.startswith("methods:"))


def test_config_init_writes_a_commented_starter_that_loads(tmp_path, capsys, tiny_pair):
    from graft_rl.engine.config import load_config

    path = tmp_path / "my_task.yaml"
    assert main(["config", "init", str(path)]) == 0
    text = path.read_text()
    assert "# your reward: path/to/file.py:function" in text and "success_threshold: 1.0" in text
    cfg = load_config(path)
    assert cfg.data.reward == "my_reward.py:reward" and cfg.run_dir == "runs/my_task" and len(cfg.policies) == 2
    assert main(["config", "init", str(path)]) == 2  # never replaced without --force
    assert "exists; give another path or --force" in capsys.readouterr().err
    args = ["--data", "d.parquet", "--reward", "r.py:f", "--models", str(tiny_pair[0]), str(tiny_pair[1]), "--force"]
    assert main(["config", "init", str(path), *args]) == 0
    cfg = load_config(path)
    assert (cfg.data.train, cfg.data.reward) == ("d.parquet", "r.py:f")
    assert [p.model for p in cfg.policies] == [str(tiny_pair[0]), str(tiny_pair[1])]


def test_every_method_is_listed_with_its_source():
    text = show(None)
    for name in method_names():
        assert f"\n  {name}: " in text, name
    assert "from the description" in show("ftis") and "paper text" in show("sapo")
