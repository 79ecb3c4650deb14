"""Fidelity, second pass (issue 23): each test pins one item and fails on the code before it."""

from __future__ import annotations

import pytest

from graft_rl.engine.rollouts import Rollouts


# ---------------------------------------------------------------- 6: peer re-tokenisation
def test_peer_responses_are_cut_at_the_receivers_max_new_tokens_and_lose_their_eos(tiny_pair):
    """A peer's text can be more tokens in the receiver's tokenizer than the receiver's own budget;
    it is cut there (counted in ``cut``), and a cut response is a truncated one: no EOS."""
    from graft_rl.policy import Policy, PolicyConfig

    pol = Policy(PolicyConfig(name="A", model=str(tiny_pair[0])))  # byte-level: one token per character
    eos = pol.end_token_ids()[0]
    texts = ["x" * 40 + " \\boxed{1}", "short \\boxed{2}", "y" * 40]
    full = pol.encode_texts(["Q"] * 3, texts, [True, True, False])
    assert full.cut == [] and full.response_ids[0][-1] == eos and full.response_ids[1][-1] == eos
    capped = pol.encode_texts(["Q"] * 3, texts, [True, True, False], max_tokens=20)
    assert capped.cut == [0, 2]
    assert [len(r) for r in capped.response_ids] == [20, len(full.response_ids[1]), 20]
    assert capped.response_ids[0] == full.response_ids[0][:20] and eos not in capped.response_ids[0]
    assert capped.response_ids[1] == full.response_ids[1]  # fits: unchanged, EOS kept


def test_peer_responses_never_run_past_the_receivers_context(tmp_path):
    from graft_rl.policy import Policy, PolicyConfig
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model

    model = build_tiny_model(tmp_path / "gpt2_48", "gpt2", bpe_tokenizer(), max_positions=48)
    pol = Policy(PolicyConfig(name="B", model=str(model)))
    batch = pol.encode_texts(["1+1=?"], ["two " * 60 + "\\boxed{2}"], [True], max_tokens=4096)
    assert batch.cut == [0] and batch.lengths()[0] == 48
    pol.token_logprobs(batch)  # a learned-position model indexes out of its table past 48


def test_the_trainer_counts_cut_peer_responses(make_cfg, fake_rewards):
    """``peer_cut`` in metrics: GRAFT's peer groups re-tokenised over the receiver's budget."""
    import json

    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "graft", "gate": False}, steps=1, run="cut", max_new_tokens=6), show_progress=False)
    tr.run()
    lines = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= ln["peer_cut"] <= ln["exchanged_in"] * tr.cfg.n for ln in lines)
    # A (one token per character) receives B's BPE responses of 6 tokens: most are longer here
    assert sum(ln["peer_cut"] for ln in lines if ln["policy"] == "A") > 0
    # and a cut response is left out of the loss (the exchange records say so)
    from graft_rl.engine.store import RecordStore

    rows = RecordStore(tr.run_dir).read_exchange("A")
    assert sum(not r["included"] for r in rows) == sum(ln["peer_cut"] for ln in lines if ln["policy"] == "A")


# ---------------------------------------------------------------- 7: checkpoint selection
@pytest.mark.slow
def test_validation_samples_default_to_the_papers_8_and_train_says_what_it_uses(
    make_cfg, tiny_data, fake_rewards, capsys
):
    from graft_rl.engine.config import ValidationConfig
    from graft_rl.engine.trainer import Trainer

    assert ValidationConfig().samples == 8
    tr = Trainer(
        make_cfg({"name": "grpo"}, steps=1, run="val8", validation={"data": [str(tiny_data)], "every": 1, "limit": 2}),
        show_progress=False,
    )
    tr.run()
    out = " ".join(capsys.readouterr().out.split())
    assert "validation every 1 steps: 8 samples per problem at temperature 0.6" in out


# ---------------------------------------------------------------- 5: dynamic sampling (DAPO)
def test_dynamic_sampling_stops_loudly_past_max_num_gen_batches(make_cfg, fake_rewards, tmp_path):
    """DAPO's semantics (verl recipe/dapo, filter_groups.max_num_gen_batches): batches counted with
    the first; past the cap the run stops with one line, instead of training a short batch."""
    from graft_rl.engine.trainer import DynamicSamplingError, Trainer

    # A has 3 prompts of 8 with mixed rewards: a batch of 4 can never fill
    cfg = make_cfg(
        {"name": "grpo", "dynamic_sampling": True, "max_num_gen_batches": 3}, steps=1, run="dapo_cap", prompt_batch=4
    )
    calls = []
    tr = Trainer(cfg, show_progress=False)
    for name, handle in tr.workers.items():
        real = handle.generate
        handle.generate = lambda *a, _name=name, _real=real: (calls.append((_name, "generate")), _real(*a))[1]
    with pytest.raises(
        DynamicSamplingError,
        match=r"policy 'A' has 3 of 4 prompts with mixed rewards after 3 generation "
        r"batches \(method.max_num_gen_batches=3\)",
    ):
        tr.run()
    assert calls.count(("A", "generate")) == 3  # the step's batch + 2 more = 3


@pytest.mark.slow
def test_dynamic_sampling_without_a_cap_draws_until_the_batch_is_full(make_cfg, fake_rewards):
    from graft_rl.engine.trainer import Trainer

    # A has 3 prompts with mixed rewards, B 2 (q1, q7): a batch of 2 fills for both, after a few draws
    method = {"name": "grpo", "dynamic_sampling": True, "max_num_gen_batches": 0, "refill_factor": 1}
    cfg = make_cfg(method, steps=1, run="dapo_free", prompt_batch=2)
    lines = Trainer(cfg, show_progress=False).run()
    for ln in lines:
        assert ln["rollouts"] == ln["gen_batches"] * 2 * 4
    assert max(ln["gen_batches"] for ln in lines) >= 2


def test_dynamic_sampling_refills_with_dapos_three_times_the_batch(make_cfg, fake_rewards):
    """Issue 32 item 11: DAPO's scripts generate gen_prompt_bsz = 3 x train_prompt_bsz prompts per
    batch; the refill batches take method.refill_factor (default 3) x prompt_batch prompts."""
    from graft_rl.engine.trainer import Trainer

    cfg = make_cfg({"name": "grpo", "dynamic_sampling": True}, steps=1, run="dapo_x3", prompt_batch=2)
    tr = Trainer(cfg, show_progress=False)
    sizes = {name: [] for name in tr.workers}
    for name, handle in tr.workers.items():
        real = handle.generate
        handle.generate = lambda p, *a, _name=name, _real=real: (sizes[_name].append(len(p)), _real(p, *a))[1]
    lines = tr.run()
    refills = [n for s in sizes.values() for n in s[1:]]  # each policy's first batch is the step's 2 prompts
    assert all(s[0] == 2 for s in sizes.values())
    assert refills and set(refills) == {6}  # 3 x 2 prompts in every refill (8 prompts: 6 left after the first 2)
    for ln in lines:
        assert ln["rollouts"] == (2 + 6 * (ln["gen_batches"] - 1)) * 4


@pytest.mark.slow
def test_dynamic_sampling_never_puts_a_prompt_in_a_step_twice(make_cfg, monkeypatch):
    """Past one pass over the data the refill draws only prompts not kept yet (a prompt's group is
    recorded once per step): rewards that are mixed by chance, 6 of 8 prompts to fill."""
    import random

    from graft_rl.engine.trainer import Trainer

    rng = random.Random(0)

    def chance(self, groups):
        for g in groups:
            mixed = rng.random() < 0.4
            g.rewards = [1.0 if (mixed and i == 0) else 0.0 for i in range(g.n)]
        return {"verify_timeouts": 0, "verify_errors": 0}

    monkeypatch.setattr(Rollouts, "verify_groups", chance)
    cfg = make_cfg(
        {"name": "grpo", "dynamic_sampling": True, "max_num_gen_batches": 0}, steps=1, run="dapo_dup", prompt_batch=6
    )
    tr = Trainer(cfg, show_progress=False)
    lines = tr.run()
    assert max(ln["gen_batches"] for ln in lines) > 2  # more than one pass over the 8 prompts
    from graft_rl.engine.store import RecordStore

    for name in ("A", "B"):
        for step in (1,):
            ids = [g.prompt_id for g in RecordStore(tr.run_dir).read(name, step)]
            assert len(ids) == 6 and len(set(ids)) == 6


def test_an_old_dynamic_max_rounds_key_is_named_and_a_saved_one_converted():
    from graft_rl.engine.config import ConfigError, load_config

    data = {
        "policies": [{"name": "A", "model": "x"}],
        "method": {"name": "grpo", "dynamic_sampling": True, "dynamic_max_rounds": 3},
    }
    with pytest.raises(ConfigError, match="now method.max_num_gen_batches"):
        load_config(data)
    assert load_config(data, saved=True).method.max_num_gen_batches == 4


# ---------------------------------------------------------------- 1: HACPO's update count


# ---------------------------------------------------------------- 3: HACPO's small constants


# ---------------------------------------------------------------- 2: HACPO + GRAFT which


# ---------------------------------------------------------------- 8: Table 4 (3 seeds)
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


def test_a_run_saved_before_refill_factor_keeps_refilling_with_one_batch():
    """Its saved config.yaml has no refill_factor: resume, eval and analyze read it as the run ran (1),
    a new config gets DAPO's 3."""
    from graft_rl.engine.config import load_config

    pols = [{"name": n, "model": "m"} for n in "AB"]
    old = {"method": {"name": "grpo", "dynamic_sampling": True}, "policies": pols}
    assert load_config(old, saved=True).method.params["refill_factor"] == 1
    assert load_config(old).method.params["refill_factor"] == 3
