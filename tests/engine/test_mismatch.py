"""The engine-trainer gap of a run (``mismatch_*``) and its corrections (``method.correction``)."""

from __future__ import annotations

import json

import pytest


def _lines(tr) -> list[dict]:
    return [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_hf_float32_samples_what_the_trainer_scores(make_cfg, fake_rewards):
    """The hf backend samples from the live module: with the same weights in float32 the engine's
    log-probs and pi_old agree to float rounding (KV-cached decoding against one full forward)."""
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "grpo"}, steps=2, run="gap"), show_progress=False)
    tr.run()
    lines = _lines(tr)
    assert {ln["policy"] for ln in lines} == {"A", "B"}
    for ln in lines:
        assert ln["mismatch_kl"] is not None and 0.0 <= ln["mismatch_kl"] < 1e-6, ln
        assert 0.0 <= ln["mismatch_abs"] <= ln["mismatch_max"] < 1e-3
        assert ln["mismatch_out"] == 0.0
        assert "correction_weight" not in ln  # correction none reports no weights


def test_top_p_sampling_measures_no_gap(make_cfg, fake_rewards):
    """With top-p the engine's log-probs are of the truncated distribution, the trainer's of the full
    one: the gap is not a mismatch of the two, and is not reported (None)."""
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "grpo"}, steps=1, run="topp", top_p=0.7), show_progress=False)
    tr.run()
    assert all(ln["mismatch_kl"] is None for ln in _lines(tr))


@pytest.mark.parametrize("correction", ["tis", "icepop", "tis_sequence", "mask_sequence"])
def test_a_correction_trains_and_reports_its_weight_and_masked_fraction(make_cfg, fake_rewards, correction):
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "graft", "correction": correction}, steps=1, run=correction), show_progress=False)
    tr.run()
    for ln in _lines(tr):
        if ln["mismatch_kl"] is None:  # every own group was replaced by a peer's
            continue
        assert ln["correction_weight"] == pytest.approx(1.0, abs=1e-3)  # no gap: weight 1
        assert ln["correction_masked"] == 0.0
        assert ln["loss"] is not None


def test_analyze_plots_and_reports_the_gap_and_the_summary_names_a_large_one(make_cfg, fake_rewards, capsys):
    from graft_rl.commands.cli import main
    from graft_rl.commands.report import large_gap_line
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(
        make_cfg({"name": "grpo", "correction": "icepop"}, steps=2, run="an", rollout={"lag": 1}), show_progress=False
    )
    tr.run()
    tr.close()
    assert main(["analyze", str(tr.run_dir)]) == 0
    out = tr.run_dir / "analysis"
    assert (out / "mismatch.png").is_file()
    report = (out / "report.md").read_text()
    section = report.split("## Engine and trainer", 1)[1].split("\n## ", 1)[0]
    assert "| A |" in section and "| B |" in section
    # the summary's one line: only for a gap above LARGE_GAP_KL
    rows = [{"policy": "A", "mismatch_kl": 2e-3, "mismatch_max": 1.5}, {"policy": "B", "mismatch_kl": 1e-5}]
    line = large_gap_line(rows)
    assert line is not None and "\n" not in line and "A mismatch_kl 2.0e-03" in line and "B " not in line
    assert large_gap_line([{"policy": "A", "mismatch_kl": 1e-5}, {"policy": "B", "mismatch_kl": None}]) is None
