"""Fidelity, second pass (issue 23): each test pins one item and fails on the code before it."""

from __future__ import annotations

import pytest
import torch

from graft_rl.engine.config import MethodConfig
from graft_rl.engine.rollouts import Rollouts


def _method(**kw) -> MethodConfig:
    cfg = MethodConfig(**kw)
    cfg.validate()
    return cfg


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

    monkeypatch.setattr(Rollouts, "verify", chance)
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
@pytest.mark.parametrize("pair", ["pair1", "pair2", "pair3"])
@pytest.mark.parametrize("row", ["hacpo", "hacpo_graft_which"])
def test_hacpo_presets_take_the_recipes_four_updates_of_512_responses(pair, row):
    """The recipe: 128 prompts x (8 own + 8 peer) = 2,048 responses in minibatches of
    ppo_mini_batch_size 64 x n 8 = 512: 4 updates per step (ours had minibatch 64: 2)."""
    from pathlib import Path

    from graft_rl.engine.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "paper" / pair / f"{row}.yaml")
    assert cfg.prompt_batch // cfg.minibatch == 4 and cfg.prompt_batch % cfg.minibatch == 0
    assert cfg.minibatch * 2 * cfg.n == 512


@pytest.mark.slow
def test_hacpo_peer_bound_steps_through_0_8_to_0_875_in_a_step(make_cfg, fake_rewards, monkeypatch):
    """On a tiny pair at the presets' ratio (4 minibatches per step): the peer lower bound of the
    loss is 0.8, 0.825, 0.85, 0.875 in every step, for each receiver."""
    from graft_rl import algo
    from graft_rl.engine.trainer import Trainer

    bounds = []
    real = algo.hacpo_policy_loss

    def spy(*a, **kw):
        loss, st = real(*a, **kw)
        bounds.append(round(float(st["peer_clip_lower"]), 4))
        return loss, st

    monkeypatch.setattr(algo, "hacpo_policy_loss", spy)
    Trainer(make_cfg({"name": "hacpo"}, steps=2, run="hacpo4", prompt_batch=8, minibatch=2), show_progress=False).run()
    # one micro-batch per minibatch here: 2 steps x 2 receivers x 4 updates
    assert bounds == [0.8, 0.825, 0.85, 0.875] * 4


# ---------------------------------------------------------------- 3: HACPO's small constants
def test_hacpo_omega_is_clipped_to_its_recipes_0_1_to_10():
    """omega = P_self / P_src, clipped to [0.1, 10] (recipe: 1 / CapabilityTracker.ratio, ratio in [0.1, 10])."""
    from graft_rl import algo

    # the upper clip: P_self / P_src = 20, clipped to 10. With one success in 8 own and 12 peer
    # responses the clipped baseline is (1 + 10 x 1) / 20 = 0.55; unclipped, (1 + 20 x 1) / 20 = 1.05
    # would exceed 1 and fall back to the own mean 1/8, so the two differ
    own8, peer12 = torch.zeros(1, 8), torch.zeros(1, 12)
    own8[0, 0], peer12[0, 0] = 1.0, 1.0
    a_own, a_peer = algo.hacpo_advantages(own8, peer12, 0.5, 0.025)
    pooled20 = torch.cat([own8, peer12], dim=1)[0]
    scale = pooled20.std() + 1e-6
    assert torch.allclose(a_own[0], ((own8[0] - 0.55) / scale).to(a_own.dtype))
    assert not torch.allclose(a_own[0], ((own8[0] - 1 / 8) / scale).to(a_own.dtype))  # what no clip would give
    assert torch.allclose(a_peer[0], ((peer12[0] - 0.55) / scale).to(a_peer.dtype))
    own, peer = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    pooled = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # P_self 1e-8, P_src 0.5: omega 2e-8 unclipped, 0.1 clipped
    a_own, a_peer = algo.hacpo_advantages(own, peer, 1e-8, 0.5)
    b = (1.0 + 0.0 + 0.1 + 0.1) / 4
    assert torch.allclose(a_own[0], ((pooled[:2] - b) / (pooled.std() + 1e-6)).to(a_own.dtype))


def test_hacpo_capability_floor_is_the_recipes_1e_8(make_cfg, fake_rewards):
    from graft_rl.engine.trainer import Trainer
    from graft_rl.methods.hacpo import CAPABILITY_FLOOR

    assert CAPABILITY_FLOOR == 1e-8
    tr = Trainer(make_cfg({"name": "hacpo"}, steps=1, run="floor"), show_progress=False)
    tr.method.load_state_dict({"success_history": {"A": [0.0, 0.0]}})
    assert tr.method.capability_of("A") == 1e-8


def test_hacpo_kl_is_seq_mean_token_mean_low_var_kl_clamped_to_10():
    """The recipe: low_var_kl (k3 clamped to +-10) token-mean per own response, summed over own
    responses and divided by the minibatch's responses; peer responses carry none."""
    from graft_rl.methods import build_objective
    from graft_rl.methods.objectives import RowTensors

    M, T = 3, 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    ref = torch.zeros(M, T)
    ref[0, 0] = 30.0  # k3 = e^20 - 21 clamped to 10 (the log ratio itself clamped to 20 first)
    ref[1] = -1.0
    t = RowTensors(
        torch.zeros(M, T),
        mask,
        [0.0] * M,
        [1.0] * M,
        [False, False, True],
        [True] * M,
        [False] * M,
        [0.0] * M,
        ref=ref,
        extras={"kappa": [1.0] * M},
    )
    coef = 0.5
    obj = build_objective(_method(name="hacpo", kl_coef=coef))
    lp = torch.zeros(M, T, requires_grad=True)
    loss, st = obj.minibatch(t, [0, 1, 2], step=1, update_index=0)(lp, mask, [0, 1, 2])
    k3_row1 = float(torch.exp(torch.tensor(-1.0)) + 1 - 1)  # r = -1: e^-1 - (-1) - 1
    expected = coef * ((10.0 / 4) + k3_row1) / 3  # advantages are 0: the policy term is 0
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_hacpo_pops_a_final_eos_from_sequence_means(tiny_pair):
    """The recipe pops a finished response's final EOS (own and peer) before the sequence mean; the
    source's mean generation log-prob likewise leaves the EOS out."""
    from graft_rl.methods import build_exchange
    from graft_rl.policy import RolloutGroup

    groups = {
        p: [
            RolloutGroup(
                "q0",
                "0+0=?",
                p,
                ["a", "b"],
                [[5, 6, 2], [5, 6]],
                [[-1.0, -2.0, -9.0], [-1.0, -2.0]],
                ["stop", "length"],
                [1.0, 0.0],
            )
        ]
        for p in ("A", "B")
    }
    ex = build_exchange(_method(name="hacpo"))
    batch = ex.build("B", groups, {"A", "B"}, 2, torch.Generator().manual_seed(0))
    peer = [r for r in batch.rows if r.is_peer]
    assert peer[0].src_mean_logprob == pytest.approx(-1.5)  # (-1 - 2) / 2: the EOS's -9 left out
    assert peer[1].src_mean_logprob == pytest.approx(-1.5)  # truncated: every token counts


@pytest.mark.slow
def test_hacpo_training_masks_the_final_eos(make_cfg, fake_rewards, monkeypatch):
    from graft_rl.engine.trainer import Trainer
    from graft_rl.engine.worker import PolicyWorker
    from graft_rl.methods.objectives import Objective

    seen = {}
    real_enc = PolicyWorker._encode

    def enc(self, batch, max_new_tokens=None):
        tb = real_enc(self, batch, max_new_tokens)
        seen[self.policy.name] = (batch, tb)
        return tb

    masks = []
    real = Objective.minibatch

    def spy(self, t, rows, step, update_index=0):
        masks.append(t.mask.clone())
        return real(self, t, rows, step, update_index)

    monkeypatch.setattr(PolicyWorker, "_encode", enc)
    monkeypatch.setattr(Objective, "minibatch", spy)
    Trainer(make_cfg({"name": "hacpo"}, steps=1, run="eos", max_new_tokens=24, minibatch=8), show_progress=False).run()
    batch, tb = seen["B"]
    mask = masks[-1]
    checked = 0
    for i, r in enumerate(batch.rows):
        n_tok = len(tb.response_ids[i])
        if r.finished and n_tok > 1 and i not in tb.cut:
            assert mask[i, n_tok - 1] == 0 and mask[i, : n_tok - 1].all()
            checked += 1
        else:
            assert mask[i, :n_tok].all()
    assert len(batch.rows) == 8 * 8 and checked > 0  # own + peer on every prompt; some finished


# ---------------------------------------------------------------- 2: HACPO + GRAFT which
def test_hacpo_graft_which_keeps_peer_responses_of_unselected_prompts_with_zero_advantage():
    """Appendix G: 'We keep the HACPO configuration [...] Peer responses on all other prompts receive
    zero advantage': every prompt pools the peer group (own advantages from HACPO's pooled
    baseline), and only the selected prompts' peer responses carry an advantage."""
    from runs import EXPECTED_A_TO_B

    from graft_rl import algo
    from graft_rl.methods import build_exchange

    from .test_exchange import _groups

    ex = build_exchange(_method(name="hacpo", selection="graft"))
    groups = {"A": _groups("A"), "B": _groups("B")}
    b = ex.build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0), capability={"A": 0.4, "B": 0.2})
    assert len(b.rows) == 8 * 8 and b.stats["exchanged_in"] == 2
    for q in range(8):
        rows = [r for r in b.rows if r.prompt_id == f"q{q}"]
        own = torch.tensor([[r.reward for r in rows if not r.is_peer]], dtype=torch.float64)
        peer = torch.tensor([[r.reward for r in rows if r.is_peer]], dtype=torch.float64)
        a_own, a_peer = algo.hacpo_advantages(own, peer, 0.2, 0.4)
        assert [r.advantage for r in rows if not r.is_peer] == pytest.approx(a_own[0].tolist())
        want = a_peer[0].tolist() if f"q{q}" in EXPECTED_A_TO_B else [0.0] * 4
        assert [r.advantage for r in rows if r.is_peer] == pytest.approx(want)


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


def test_hacpo_keeps_cut_peer_responses_in_the_loss_as_its_recipe_truncates_them(make_cfg, fake_rewards):
    """Issue 32 item 9: HACPO's recipe truncates an over-long peer response to the budget and trains
    on it (overflow="truncate"); GRAFT leaves it out (test_the_trainer_counts_cut_peer_responses)."""
    import json

    from graft_rl.engine.store import RecordStore
    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "hacpo"}, steps=1, run="cut_hacpo", max_new_tokens=6), show_progress=False)
    tr.run()
    lines = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    cut = sum(ln["peer_cut"] for ln in lines if ln["policy"] == "A")
    assert cut > 0
    rows = RecordStore(tr.run_dir).read_exchange("A")
    assert rows and all(r["included"] for r in rows)


def test_a_run_saved_before_refill_factor_keeps_refilling_with_one_batch():
    """Its saved config.yaml has no refill_factor: resume, eval and analyze read it as the run ran (1),
    a new config gets DAPO's 3."""
    from graft_rl.engine.config import load_config

    pols = [{"name": n, "model": "m"} for n in "AB"]
    old = {"method": {"name": "grpo", "dynamic_sampling": True}, "policies": pols}
    assert load_config(old, saved=True).method.params["refill_factor"] == 1
    assert load_config(old).method.params["refill_factor"] == 3
