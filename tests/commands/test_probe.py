"""`graft probe` (issue 25): complementarity and compatibility before training, from the training
step's own code path."""

from __future__ import annotations

import json

import pytest

from graft_rl.commands.probe import ProbeError, format_probe, probe
from graft_rl.engine.trainer import Trainer


@pytest.mark.slow
@pytest.mark.parametrize("method", [{"name": "graft"}, {"name": "graft", "balance": False, "delta": 0.5}])
def test_probe_predicts_the_first_training_steps_exchange_and_admission(make_cfg, fake_rewards, tmp_path, method):
    """Same config and seed: the probe's grafted groups and admitted share per receiver are what
    training step 1 grafts and admits (the same rollouts, selection, scores and gate draws)."""
    cfg = make_cfg(method, steps=1, run="probe_cfg")
    res = probe(cfg, out_dir=tmp_path / "probe", show=False)
    lines = {ln["policy"]: ln for ln in Trainer(make_cfg(method, steps=1, run="trained"), show_progress=False).run()}
    for recv in ("A", "B"):
        src = "B" if recv == "A" else "A"
        d = res["directions"][f"{src}->{recv}"]
        assert d["grafted"] == lines[recv]["exchanged_in"]
        assert d["grafted_per_step"] == lines[recv]["exchanged_in"]  # one batch of the config's size
        assert d["candidates"] == lines[recv]["candidates_in"]
        assert res["moves"][recv]["groups"] == lines[recv]["exchanged_in"]  # what the config's method moves
        got = d["grafted_compat"]
        if lines[recv]["exchanged_in"]:
            assert got["admitted"] == pytest.approx(lines[recv]["admitted_frac"])
            assert got["median_token"] == pytest.approx(lines[recv]["compat_token_median"], abs=1e-4)
    assert res["directions"]["B->A"]["grafted"] > 0 and res["directions"]["A->B"]["grafted"] > 0
    saved = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert saved["directions"].keys() == res["directions"].keys() and saved["verdict"] == res["verdict"]
    assert (tmp_path / "probe" / "probe.png").stat().st_size > 10_000
    assert not (tmp_path / "probe_cfg").exists()  # nothing trained, no run directory


@pytest.mark.slow
def test_probe_report_fits_80_columns_and_ends_with_a_verdict(make_cfg, fake_rewards, tmp_path):
    res = probe(make_cfg({"name": "grpo"}, steps=1, run="p80"), limit=12, out_dir=tmp_path / "p", show=False)
    text = format_probe(res)
    assert max(len(x) for x in text.splitlines()) <= 80
    assert "probed with GRAFT's exchange" in text  # a GRPO config is probed as GRAFT would run it
    assert text.split("\n\n")[-1].startswith("GRAFT would graft ~")
    assert res["batches"] == 2 and res["prompts"] == 12  # 12 prompts: 2 batches of at most prompt_batch 8


def test_probe_refuses_what_it_cannot_measure(make_cfg, tiny_pair, tmp_path):
    one = make_cfg({"name": "grpo"}, policies=[{"name": "A", "model": str(tiny_pair[0])}], run="one")
    with pytest.raises(ProbeError, match="one policy and no stored peer"):
        probe(one, out_dir=tmp_path / "p", show=False)
    with pytest.raises(ProbeError, match="--limit must be >= 1"):
        probe(make_cfg(run="zero"), limit=0, out_dir=tmp_path / "p", show=False)


def test_graft_probe_command(make_cfg, fake_rewards, tmp_path, capsys):
    import yaml

    from graft_rl.commands.cli import main
    from graft_rl.engine.config import to_dict

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(to_dict(make_cfg(run="cli"))))
    assert main(["probe", str(path), "--limit", "8", "--out", str(tmp_path / "out"), "--no-progress", "n=4"]) == 0
    out = capsys.readouterr().out
    assert "GRAFT would graft ~" in out and f"written: {tmp_path / 'out' / 'probe.json'}" in out


def test_probe_families_cover_every_step_s_prompts(make_cfg, fake_rewards, tmp_path):
    """The trainer keeps only recent steps' rows; the probe keeps each prompt's family as drawn, so a
    probe of many batches counts the first batch's prompts under their family, never '?'."""
    import json

    data = tmp_path / "fam.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i), "subject": "ab"[i % 2]}) + "\n"
            for i in range(8)
        )
    )
    cfg = make_cfg(run="fams", prompt_batch=2, data={"train": str(data)})
    res = probe(cfg, limit=8, out_dir=tmp_path / "p", show=False)  # 4 batches of 2
    fams = {f for d in res["directions"].values() for f in d.get("by_family", {})}
    assert fams == {"a", "b"}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["xgrpo", "prp"])
def test_probe_says_what_the_configs_own_method_would_move(make_cfg, fake_rewards, tmp_path, method):
    res = probe(make_cfg({"name": method}, steps=1, run="pm"), out_dir=tmp_path / "p", show=False)
    text = format_probe(res)
    for recv in ("A", "B"):
        m = res["moves"][recv]
        if method == "xgrpo":  # rewards only: every peer answer of every prompt shapes a baseline
            assert m["responses"] == 0 and m["rewards"] == 8 * 4
        else:  # every peer group of every prompt, its responses and their tokens
            assert m["groups"] == 8 and m["responses"] == 32 and m["tokens"] > 0
        assert f"{method} would move ~" in text and f"into {recv}" in text
