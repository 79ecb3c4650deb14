"""`graft seeds`: Table 4's mean and sample std over training runs of several seeds."""

from __future__ import annotations

import pytest


def _fake_eval(run, scores: dict[str, tuple[float, float]], complete=True):
    import json

    (run / "eval").mkdir(parents=True)
    pols = {
        name: {"benchmarks": {"math500": {"pass@1_mean": m}, "aime24": {"pass@1_mean": a}}, "average": (m + a) / 2}
        for name, (m, a) in scores.items()
    }
    (run / "eval" / "eval.json").write_text(json.dumps({"complete": complete, "policies": pols}))


def test_graft_seeds_prints_table_4s_mean_and_sample_std_over_training_runs(tmp_path, capsys):
    import json
    import statistics

    from graft_rl.commands.cli import main

    graft, grpo = [], []
    for s, (g, b) in enumerate([(0.40, 0.30), (0.44, 0.32), (0.42, 0.28)]):
        _fake_eval(tmp_path / f"graft_s{s}", {"A": (g, g / 2)})
        _fake_eval(tmp_path / f"grpo_s{s}", {"A": (b, b / 2)})
        graft.append(tmp_path / f"graft_s{s}")
        grpo.append(tmp_path / f"grpo_s{s}")
    out = tmp_path / "t4.json"
    assert main(["seeds", *map(str, graft), "--baseline", *map(str, grpo), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    avgs = [0.75 * g for g in (0.40, 0.44, 0.42)]
    assert res["policies"]["A"]["average"]["mean"] == pytest.approx(statistics.fmean(avgs))
    assert res["policies"]["A"]["average"]["std"] == pytest.approx(statistics.stdev(avgs))  # sample std, as Table 4
    assert res["delta"]["A"] == pytest.approx(
        statistics.fmean(avgs) - statistics.fmean(0.75 * b for b in (0.30, 0.32, 0.28))
    )
    text = capsys.readouterr().out
    assert "31.50 ± 1.50" in text and "+9.00" in text  # A's average over the 3 GRAFT runs; Δ vs GRPO

    _fake_eval(tmp_path / "torn", {"A": (0.1, 0.1)}, complete=False)
    assert main(["seeds", str(graft[0]), str(tmp_path / "torn")]) == 2
    assert main(["seeds", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "interrupted evaluation" in err[0] and "no eval/eval.json" in err[1]
