"""The rollout phase (graft_rl.engine.rollouts): DAPO's dynamic sampling, its refills and limits,
and how configs saved before its keys changed are read."""

from __future__ import annotations

import pytest

from graft_rl.engine.rollouts import Rollouts


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


def test_a_run_saved_before_refill_factor_keeps_refilling_with_one_batch():
    """Its saved config.yaml has no refill_factor: resume, eval and analyze read it as the run ran (1),
    a new config gets DAPO's 3."""
    from graft_rl.engine.config import load_config

    pols = [{"name": n, "model": "m"} for n in "AB"]
    old = {"method": {"name": "grpo", "dynamic_sampling": True}, "policies": pols}
    assert load_config(old, saved=True).method.params["refill_factor"] == 1
    assert load_config(old).method.params["refill_factor"] == 3
