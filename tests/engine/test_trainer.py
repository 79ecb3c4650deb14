"""End-to-end trainer tests with two (or three) tiny models of different tokenizers, on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from metric_docs import undocumented
from runs import EXPECTED_A_TO_B, EXPECTED_B_TO_A, K

from graft_rl import algo
from graft_rl.engine.config import ConfigError, load_config
from graft_rl.engine.rundir import read_log
from graft_rl.engine.store import RecordError, RecordStore
from graft_rl.engine.trainer import Trainer

METHODS = {
    "grpo": {"name": "grpo"},
    "grpo_dynamic_sampling": {"name": "grpo", "dynamic_sampling": True, "max_num_gen_batches": 8},
    "graft": {"name": "graft"},
    "graft_no_balance": {"name": "graft", "balance": False},
    "graft_no_gate": {"name": "graft", "gate": False},
    "graft_no_floor": {"name": "graft", "floor": False},
    "graft_sequence_ratio": {"name": "graft", "ratio": "sequence"},
    "graft_random_prompts": {"name": "graft", "selection": "random"},
    "graft_random_admission": {"name": "graft", "admission": "random"},
    "graft_peer_first": {"name": "graft", "position": "first"},
    "graft_peer_uniform": {"name": "graft", "position": "uniform"},
    "graft_pooled": {"name": "graft", "pooled": True},
    "graft_success_only": {"name": "graft", "success_only": True},
    "graft_per_char": {"name": "graft", "compatibility": "per_char"},
    "sgt": {"name": "sgt"},
    "sgt_graft_which": {"name": "sgt", "selection": "graft"},
    "sgt_graft_how": {"name": "graft", "selection": "sgt", "balance": False},
    "luffy": {"name": "luffy"},
    "hacpo": {"name": "hacpo"},
    "hacpo_graft_which": {"name": "hacpo", "selection": "graft"},
    "graft_kl": {"name": "graft", "kl_coef": 0.1},
    "hacpo_kl": {"name": "hacpo", "kl_coef": 1e-3},
}


#: the fast tier's smoke set: one of each method (the full suite runs every variant)
SMOKE = ("grpo", "grpo_dynamic_sampling", "graft", "sgt", "luffy", "hacpo")


@pytest.mark.parametrize("method", [m if m in SMOKE else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_every_method_runs_two_steps(method, make_cfg, fake_rewards):
    # dynamic sampling draws extra prompts from outside the batch: A has 3 mixed groups of 8, B 2
    cfg = make_cfg(METHODS[method], **({"prompt_batch": 2} if "dynamic" in method else {}))
    tr = Trainer(cfg, show_progress=False)
    lines = tr.run()
    assert [(ln["step"], ln["policy"]) for ln in lines] == [(1, "A"), (1, "B"), (2, "A"), (2, "B")]
    for ln in lines:
        assert ln["skipped_updates"] == 0 and ln["loss"] is not None
    store = RecordStore(cfg.run_dir)
    assert store.steps("A") == [1, 2] and store.steps("B") == [1, 2]
    metrics = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4
    assert not undocumented(metrics), "metric keys missing from docs/metrics.md"
    assert not undocumented(read_log(tr.run_dir / "validation.jsonl")[0], "validation.jsonl")
    if method in ("graft", "graft_pooled", "luffy"):
        assert {ln["policy"]: ln["exchanged_in"] for ln in lines[:2]} == {"A": 2.0, "B": 2.0}
    if method == "graft_no_balance":
        assert {ln["policy"]: ln["exchanged_in"] for ln in lines[:2]} == {"A": 2.0, "B": 3.0}
    if method == "grpo":
        assert all(ln["exchanged_in"] == 0 for ln in lines)
    if "kl" in method:  # KL to the initial policy: >= 0, and > 0 once the policy has moved
        assert all(ln["kl_ref"] >= 0 for ln in lines) and all(ln["kl_ref"] > 0 for ln in lines[2:])
    else:
        assert "kl_ref" not in lines[0]
    if method == "grpo_dynamic_sampling":
        # every generation batch (2 prompts x 4) counted in Table 5's rollouts; some steps needed more than one
        assert all(ln["rollouts"] == ln["gen_batches"] * 2 * 4 for ln in lines if ln["gen_batches"] == 1)
        # refills of up to refill_factor (3) x prompt_batch (2) prompts, n = 4
        assert all(ln["rollouts"] <= (2 + 6 * (ln["gen_batches"] - 1)) * 4 for ln in lines)
        assert max(ln["gen_batches"] for ln in lines) > 1


def test_every_receiver_update_is_started_before_any_is_awaited(make_cfg, fake_rewards, tiny_data, monkeypatch):
    """Issue 22: the driver starts every policy's update (a Ray future under execution: ray) before it
    waits for the first, so the policies' devices train at once; validation and checkpoint writes too."""
    from graft_rl.engine.handles import Pending, WorkerHandle

    events = []
    for method in ("_train_receiver", "_finish_receiver"):
        real = getattr(Trainer, method)

        def spy(self, *args, _real=real, _method=method):
            events.append((_method, args[0]))
            return _real(self, *args)

        monkeypatch.setattr(Trainer, method, spy)
    real_submit, real_get = WorkerHandle._submit, Pending.get

    def submit(self, call, *args):  # every typed worker call goes through here
        events.append(("submit", call.__name__, self.name))
        return real_submit(self, call, *args)

    def get(self):
        events.append(("result",))
        return real_get(self)

    monkeypatch.setattr(WorkerHandle, "_submit", submit)
    monkeypatch.setattr(Pending, "get", get)
    val = {"data": [str(tiny_data)], "every": 1, "samples": 1, "max_new_tokens": 4, "limit": 2}
    tr = Trainer(make_cfg({"name": "graft"}, steps=1, validation=val), show_progress=False)
    tr.run()
    trains = [e for e in events if e[0] in ("_train_receiver", "_finish_receiver")]
    assert trains == [
        ("_train_receiver", "A"),
        ("_train_receiver", "B"),
        ("_finish_receiver", "A"),
        ("_finish_receiver", "B"),
    ]
    for method in ("train", "evaluate", "save"):  # each phase: every policy's call submitted, then the results
        i = [k for k, e in enumerate(events) if e[:2] == ("submit", method)]
        assert len(i) >= 2 and not any(e == ("result",) for e in events[i[0] : i[1]]), method


def test_graft_replaces_exactly_the_complementary_groups_with_source_advantages_last(
    make_cfg, fake_rewards, monkeypatch
):
    cfg = make_cfg({"name": "graft"}, steps=1)
    tr = Trainer(cfg, show_progress=False)
    seen, orders = {}, {}
    real_train, real_order = tr._train_receiver, algo.minibatch_order

    def spy_train(name, batch, step):
        seen[name] = batch
        return real_train(name, batch, step)

    def spy_order(is_peer, size, position, gen):
        out = real_order(is_peer, size, position, gen)
        orders[len(orders)] = (is_peer.clone(), out)
        return out

    monkeypatch.setattr(tr, "_train_receiver", spy_train)
    monkeypatch.setattr(algo, "minibatch_order", spy_order)  # the worker looks it up at call time
    tr.run()
    for receiver, source, expected in (("B", "A", EXPECTED_A_TO_B), ("A", "B", EXPECTED_B_TO_A)):
        batch = seen[receiver]
        grafted = {r.prompt_id for r in batch.rows if r.is_peer}
        assert grafted == expected
        assert all(r.source == source for r in batch.rows if r.is_peer)
        # a grafted prompt carries the whole source group (n = 4) and no own response
        for pid in expected:
            rows = [r for r in batch.rows if r.prompt_id == pid]
            assert len(rows) == 4 and all(r.is_peer for r in rows)
            k = K[source][int(pid[1:])]
            rewards = torch.tensor([[1.0 if i < k else 0.0 for i in range(4)]])
            assert [r.advantage for r in rows] == pytest.approx(algo.grpo_advantages(rewards)[0].tolist())
            assert all(r.weight == 0.0 or 0.8 < r.weight <= 1.0 for r in rows)
        # own responses keep weight 1
        assert all(r.weight == 1.0 for r in batch.rows if not r.is_peer)
    # peer-last: in both receivers' orders every minibatch with a grafted group comes after the own-only ones
    for is_peer, order in orders.values():
        flags = [bool(is_peer[b].any()) for b in order]
        assert flags == sorted(flags) and any(flags)


def test_three_policies_take_the_peer_with_most_successes(tmp_path, tiny_trio, tiny_data, fake_rewards, monkeypatch):
    a, b, c = tiny_trio
    cfg = load_config(
        {
            "run_dir": str(tmp_path / "trio"),
            "steps": 1,
            "prompt_batch": 8,
            "minibatch": 4,
            "n": 4,
            "max_new_tokens": 6,
            "data": {"train": str(tiny_data)},
            "method": {"name": "graft", "balance": False},
            "policies": [
                {"name": "A", "model": str(a)},
                {"name": "B", "model": str(b)},
                {"name": "C", "model": str(c)},
            ],
        }
    )
    tr = Trainer(cfg, show_progress=False)
    seen = {}
    real = tr._train_receiver
    monkeypatch.setattr(tr, "_train_receiver", lambda n, bt, s: (seen.__setitem__(n, bt), real(n, bt, s))[1])
    tr.run()
    src_b = {r.prompt_id: r.source for r in seen["B"].rows if r.is_peer}
    # B fails on q0 (A:1, C:0), q2 (A:2, C:3 -> C), q5 (A:3, C:1 -> A), q7? B has 2 -> no
    assert src_b == {"q0": "A", "q2": "C", "q5": "A"}
    src_a = {r.prompt_id: r.source for r in seen["A"].rows if r.is_peer}
    # A fails on q1 (B:1), q3 (none), q6 (B:4 all-pass, C:0 -> none), q7 (B:2, C:3 -> C)
    assert src_a == {"q1": "B", "q7": "C"}


def test_stored_trajectory_replay_reproduces_online_selection(make_cfg, tiny_pair, fake_rewards, monkeypatch, tmp_path):
    grpo = make_cfg({"name": "grpo"}, steps=1, run="peer_grpo")
    Trainer(grpo, show_progress=False).run()
    captured = {}

    def capture(tr):
        real = tr._train_receiver
        monkeypatch.setattr(
            tr,
            "_train_receiver",
            lambda n, bt, s: (captured.setdefault(tr.cfg.run_dir, {}).__setitem__(n, bt), real(n, bt, s))[1],
        )

    online = make_cfg({"name": "graft", "balance": False}, steps=1, run="online")
    tr_online = Trainer(online, show_progress=False)
    capture(tr_online)
    tr_online.run()
    replay = make_cfg(
        {"name": "graft"},
        steps=1,
        run="replay",
        policies=[{"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3}],
        peers=[{"records": grpo.run_dir, "policy": "B"}],
    )
    assert replay.method.balance is False  # one direction: balancing is inactive
    tr_replay = Trainer(replay, show_progress=False)
    assert "B" not in tr_replay.policies  # the peer model is never loaded
    capture(tr_replay)
    tr_replay.run()
    on, re = captured[online.run_dir]["A"], captured[replay.run_dir]["A"]
    assert [(r.prompt_id, r.text, r.advantage, r.weight) for r in on.rows] == [
        (r.prompt_id, r.text, r.advantage, r.weight) for r in re.rows
    ]
    assert {r.prompt_id for r in re.rows if r.is_peer} == {"q1", "q7"}


def test_replay_refuses_mismatched_prompt_and_missing_step(make_cfg, tiny_pair, fake_rewards, tmp_path):
    grpo = make_cfg({"name": "grpo"}, steps=1, run="peer")
    Trainer(grpo, show_progress=False).run()
    replay = make_cfg(
        {"name": "graft"},
        steps=2,
        run="replay2",
        policies=[{"name": "A", "model": str(tiny_pair[0])}],
        peers=[{"records": grpo.run_dir, "policy": "B"}],
    )
    tr = Trainer(replay, show_progress=False)
    tr.run(max_steps=1)
    with pytest.raises(RecordError, match="policy 'B' has no record for step 2"):
        tr.run()
    # tamper with a recorded prompt text
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = RecordStore(grpo.run_dir).path("B", 1)
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array(["changed"] * t.num_rows))
    pq.write_table(t, path)
    replay3 = make_cfg(
        {"name": "graft"},
        steps=1,
        run="replay3",
        policies=[{"name": "A", "model": str(tiny_pair[0])}],
        peers=[{"records": grpo.run_dir, "policy": "B"}],
    )
    with pytest.raises(RecordError, match="recorded prompt text differs"):
        Trainer(replay3, show_progress=False).run()


def _params(tr):
    return {n: [p.detach().clone() for p in pol.model.parameters()] for n, pol in tr.policies.items()}


def _strip(lines):
    return [{k: v for k, v in ln.items() if not k.startswith("time_")} for ln in lines]


@pytest.mark.slow
@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_resume_reproduces_an_uninterrupted_run(make_cfg, fake_rewards, kl_coef):
    # with a KL term the resumed run must still compare against the *initial* weights, not the checkpoint's
    method = {"name": "graft", "kl_coef": kl_coef}
    full = Trainer(make_cfg(method, steps=4, run="full", checkpoint_every=2), show_progress=False)
    full.run()
    part = Trainer(make_cfg(method, steps=4, run="part", checkpoint_every=2), show_progress=False)
    part.run(max_steps=3)  # "killed" after step 3: its records and metrics exist, the last checkpoint is step 2
    assert RecordStore(part.run_dir).steps("A") == [1, 2, 3]
    resumed = Trainer.resume(part.run_dir, show_progress=False)
    assert resumed.start_step == 3
    resumed.run()
    for name in ("A", "B"):
        for p, q in zip(_params(full)[name], _params(resumed)[name], strict=True):
            assert torch.equal(p, q)

    def read(tr):
        return [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]

    assert _strip(read(full)) == _strip(read(resumed))
    s_full, s_res = RecordStore(full.run_dir), RecordStore(resumed.run_dir)
    assert s_full.steps("A") == s_res.steps("A") == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        for name in ("A", "B"):
            a, b = s_full.read(name, step), s_res.read(name, step)
            assert [(g.prompt_id, g.texts, g.rewards) for g in a] == [(g.prompt_id, g.texts, g.rewards) for g in b]


def test_nonfinite_loss_skips_the_update_and_is_logged(make_cfg, fake_rewards, monkeypatch):
    def poison(trainer):  # every receiver's objective returns a NaN loss
        for handle in trainer.workers.values():
            objective = handle.worker.receiver.objective
            real = objective.contribution

            def nan_contribution(*args, _real=real, **kw):
                loss, stats = _real(*args, **kw)
                return loss * float("nan"), stats

            monkeypatch.setattr(objective, "contribution", nan_contribution)

    tr = Trainer(make_cfg({"name": "graft"}, steps=1, run="nan"), show_progress=False)
    poison(tr)
    lines = tr.run()
    assert all(ln["skipped_updates"] == ln["minibatches"] > 0 for ln in lines)
    stop = Trainer(make_cfg({"name": "graft"}, steps=1, run="nan_stop", nonfinite_loss="stop"), show_progress=False)
    poison(stop)
    with pytest.raises(FloatingPointError, match="non-finite"):
        stop.run()


def test_config_errors_are_one_clear_line(make_cfg, tiny_pair, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key method.dleta; did you mean 'delta'\?"):
        make_cfg({"name": "graft", "dleta": 0.9})
    with pytest.raises(ConfigError, match=r"unknown key prompt_bach; did you mean 'prompt_batch'\?"):
        make_cfg(prompt_bach=3)
    with pytest.raises(ConfigError, match=r"method.position: 'middle' is not one of last, first, uniform"):
        make_cfg({"name": "graft", "position": "middle"})
    with pytest.raises(ConfigError, match="needs at least two policies"):
        make_cfg({"name": "graft"}, policies=[{"name": "A", "model": str(tiny_pair[0])}])
    with pytest.raises(ConfigError, match="fewer than prompt_batch"):
        Trainer(make_cfg(prompt_batch=64), show_progress=False)


def test_overrides_and_resolved_config(make_cfg, fake_rewards):
    cfg = make_cfg({"name": "graft"}, steps=1, run="ov")
    from graft_rl.engine.config import apply_overrides, to_dict

    data = apply_overrides(to_dict(cfg), ["method.delta=0.9", "policies.1.lr=5e-4", "n=2"])
    cfg2 = load_config(data)
    assert cfg2.method.delta == 0.9 and cfg2.policies[1].lr == 5e-4 and cfg2.n == 2
    tr = Trainer(cfg2, show_progress=False)
    import yaml

    saved = yaml.safe_load((tr.run_dir / "config.yaml").read_text())
    assert saved["method"]["delta"] == 0.9 and saved["policies"][1]["lr"] == 5e-4
    with pytest.raises(ConfigError, match="already holds a run"):
        tr.run()
        Trainer(cfg2, show_progress=False)


def test_validation_verifies_within_the_steps_budget_and_reports_what_it_skipped(
    make_cfg, fake_rewards, tiny_data, monkeypatch
):
    """Issue 24: validation shares data.verify_budget with the training step (slow references cannot
    stall it), per chunk of problems, and its line says how many answers the budget left unchecked."""
    from graft_rl.rewards import functions
    from graft_rl.rewards.pool import VerifyStats

    seen = []

    def fake_score(responses, answers, verifier, sources, ids, timeout, budget=None):
        seen.append(budget)
        return [0.0] * len(responses), VerifyStats(total=len(responses), budget=len(responses))

    monkeypatch.setattr(functions, "score_responses", fake_score)  # the built-in verifiers' entry
    val = {"data": [str(tiny_data)], "every": 1, "samples": 2, "max_new_tokens": 4, "limit": 3}
    tr = Trainer(
        make_cfg({"name": "graft"}, steps=1, validation=val, data={"train": str(tiny_data), "verify_budget": 7.5}),
        show_progress=False,
    )
    tr.run()
    assert seen and set(seen) == {7.5}
    lines = read_log(tr.run_dir / "validation.jsonl")[0]
    assert [ln["verify_over_budget"] for ln in lines] == [6] * len(lines)  # 3 problems x 2 samples, per policy


def test_groups_larger_than_int16_are_recorded(tmp_path):
    """Issue 24: n = 33,000 failed after generating, when the record's group index (int16) overflowed."""
    from graft_rl.policy import RolloutGroup

    n = 33_000
    g = RolloutGroup("q0", "1+1", "A", ["2"] * n, [[5]] * n, [[-0.1]] * n, ["stop"] * n)
    g.rewards = [1.0] * n
    store = RecordStore(tmp_path)
    store.write(1, [g])
    assert store.read("A", 1)[0].n == n


def test_an_override_of_one_policy_leaves_a_yaml_alias_of_it_alone(tmp_path):
    """The paper presets share one ``vllm_kwargs`` block between the policies through a YAML anchor
    (``&id001`` / ``*id001``): ``policies.0.vllm_kwargs.sleep=false`` changes policy 0's alone."""
    from graft_rl.engine.config import load_config

    cfg = load_config("configs/paper/pair1/graft.yaml", ["policies.0.vllm_kwargs.sleep=false"])
    assert [p.vllm_kwargs["sleep"] for p in cfg.policies] == [False, True]
