"""``rollout.mode: one_step_off`` (graft_rl.engine.generators, graft_rl.policy.transfer): generation of step
t+1 on generators of their own while step t updates is the ``rollout.lag: 1`` run, resumes exactly with
a batch in flight, and every push to a generator is verified."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from graft_rl.engine.config import ConfigError, load_config

LOOKUP = Path(__file__).resolve().parents[2] / "configs" / "lookup" / "graft.yaml"
#: the keys only a one-step-off run writes (besides its time_* keys)
ASYNC_KEYS = {"sample_version", "trainer_idle_frac", "generator_idle_frac"}


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _strip(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in ln.items() if not k.startswith("time_") and k not in ASYNC_KEYS} for ln in lines]


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (["rollout.mode=one_step_off"], "needs execution: ray"),
        (["rollout.mode=one_step_off", "execution=ray", "rollout.lag=1"], "already a lag of one step"),
        (["rollout.mode=async"], "rollout.mode: 'async' is not one of colocated, one_step_off"),
        (["rollout.transfer=tcp"], "rollout.transfer"),
        (["rollout.inflight_at_checkpoint=drop"], "rollout.inflight_at_checkpoint"),
        (["rollout.generators.per_policy={C: {replicas: 2}}"], "'C' is not a policy of this run"),
        (["rollout.generators.per_policy={A: {gpus: 2}}"], "rollout.generators.per_policy.A.gpus: not a generator key"),
        (
            ["rollout.mode=one_step_off", "execution=ray", "rollout.generators.replicas=0"],
            "rollout.generators.replicas must be an integer >= 1",
        ),
    ],
)
def test_one_step_off_is_refused_in_one_line_where_it_cannot_run(keys, match):
    with pytest.raises(ConfigError, match=match):
        load_config(LOOKUP, keys)


def test_a_generator_may_not_share_a_trainers_gpu():
    keys = ["rollout.mode=one_step_off", "execution=ray", "policies.0.device=cuda", "policies.1.device=cuda"]
    with pytest.raises(ConfigError, match="whole GPUs"):
        load_config(LOOKUP, [*keys, "ray.num_gpus=1", "rollout.generators.num_gpus=0.5"])
    with pytest.raises(ConfigError, match="whole GPUs"):
        load_config(LOOKUP, [*keys, "ray.num_gpus=0.5"])
    cfg = load_config(LOOKUP, [*keys, "ray.num_gpus=1", "rollout.generators.per_policy={B: {replicas: 2}}"])
    assert cfg.rollout.generators.of("B").replicas == 2 and cfg.rollout.generators.of("A").replicas == 1


def test_generator_gpus_and_transfers_are_checked_per_policy():
    gpu = ["rollout.mode=one_step_off", "execution=ray", "policies.0.device=cuda", "policies.1.device=cuda"]
    per_policy = "ray.resources={A: {num_gpus: 1}, B: {num_gpus: 1}}"
    cfg = load_config(LOOKUP, [*gpu, per_policy])  # each trainer's GPU from its own ray.resources entry
    assert cfg.rollout.mode == "one_step_off"
    with pytest.raises(ConfigError, match="exactly one for each generator replica"):
        load_config(LOOKUP, [*gpu, "ray.num_gpus=1", "rollout.generators.num_gpus=2"])
    with pytest.raises(ConfigError, match="rollout.transfer: nccl moves CUDA tensors"):
        load_config(LOOKUP, ["rollout.mode=one_step_off", "execution=ray", "rollout.transfer=nccl"])
    with pytest.raises(ConfigError, match="rollout.generators.per_policy.A: expected a mapping"):
        load_config(LOOKUP, ["rollout.generators.per_policy={A: 2}"])
    with pytest.raises(ConfigError, match="rollout.generators.num_cpus"):
        load_config(LOOKUP, ["rollout.mode=one_step_off", "execution=ray", "rollout.generators.num_cpus=many"])


def test_the_cluster_check_counts_generator_bundles():
    from graft_rl.engine.distributed import ResourceError, check_cluster

    keys = ["rollout.mode=one_step_off", "execution=ray", "ray.num_cpus=1"]
    cfg = load_config(LOOKUP, [*keys, "rollout.generators.per_policy={B: {replicas: 2}}"])
    check_cluster(cfg, cfg.policies, nodes=[{"CPU": 5.0}])  # 2 trainers + 1 + 2 generators
    with pytest.raises(ResourceError, match="generator"):
        check_cluster(cfg, cfg.policies, nodes=[{"CPU": 4.0}])
    pinned = load_config(LOOKUP, [*keys, "rollout.generators.resources={node_b: 0.5}"])
    with pytest.raises(ResourceError, match="node_b"):
        check_cluster(pinned, pinned.policies, nodes=[{"CPU": 8.0}])
    check_cluster(pinned, pinned.policies, nodes=[{"CPU": 4.0}, {"CPU": 4.0, "node_b": 1.0}])


# --------------------------------------------------------------------------- versions
def test_the_lag_history_keeps_each_entrys_weights_version(tmp_path):
    from graft_rl.policy.lag import RolloutLag

    lag = RolloutLag(1)
    params = [("w", torch.zeros(2))]
    for version in (0, 2, 2, 4):
        params[0][1].fill_(version)
        lag.observe(params, version)
    assert lag.versions == [2, 4] and lag.chosen_version() == 2
    lag.save(tmp_path / "lag.safetensors", version=6)  # the live weights moved on since (a checkpoint)
    back = RolloutLag(1)
    back.load(tmp_path / "lag.safetensors", version=6)
    assert back.versions == [4]
    back.observe(params, 6)
    assert back.chosen_version() == 4


def test_a_checkpoint_keeps_the_weights_version(tmp_path, tiny_pair):
    from graft_rl.policy import Policy, PolicyConfig

    pol = Policy(PolicyConfig(name="A", model=str(tiny_pair[0])))
    pol.weights_version = 7
    pol.save(tmp_path / "A")
    back = Policy(PolicyConfig(name="A", model=str(tmp_path / "A")))
    back.load_state(tmp_path / "A")
    assert back.weights_version == 7


# --------------------------------------------------------------------------- the push
def _policy(path, **kw):
    from graft_rl.policy import Policy, PolicyConfig

    return Policy(PolicyConfig(name="A", model=str(path), **kw))


def _push(trainer, generator) -> tuple[list, dict]:
    """A push in one process, as a generator takes it: ``(the generator's names, the digests sent)``."""
    from graft_rl.policy.transfer import generator_stream, manifest

    names = manifest(generator.model)
    sent: dict = {}
    state = generator.model.state_dict()
    with torch.no_grad():
        for n, t in generator_stream(trainer, names, sent):
            state[n].copy_(t)
    return names, sent


def test_a_push_streams_and_verifies_every_tensor(tiny_pair):
    from graft_rl.policy.transfer import check_delivery, received_digest

    trainer, generator = _policy(tiny_pair[1]), _policy(tiny_pair[1])  # GPT-2: tied head, Conv1D
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)
    names, sent = _push(trainer, generator)
    state = generator.model.state_dict()
    check_delivery("A generator 0", sent, received_digest(generator.model, names))
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), generator.model.parameters(), strict=True))
    with torch.no_grad():
        state[names[3][0]].add_(1.0)
    with pytest.raises(RuntimeError, match=f"A generator 0: the weight push is not verified: tensor '{names[3][0]}'"):
        check_delivery("A generator 0", sent, received_digest(generator.model, names))


def test_a_lora_policy_pushes_its_merged_weights_into_a_plain_generator(tiny_pair):
    from graft_rl.policy.transfer import check_delivery, received_digest

    lora = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    trainer, generator = _policy(tiny_pair[0], lora=lora), _policy(tiny_pair[0])
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)  # adapters that change the weights
    before = {n: t.clone() for n, t in generator.model.state_dict().items()}
    names, sent = _push(trainer, generator)
    check_delivery("A generator 0", sent, received_digest(generator.model, names))
    moved = [n for n, t in generator.model.state_dict().items() if not torch.equal(t, before[n])]
    assert moved and all(n.endswith("proj.weight") for n in moved), moved


def test_a_weight_link_broadcasts_from_trainer_rank_0():
    from graft_rl.engine.worker import PolicyWorker
    from graft_rl.policy.transfer import WeightLink

    addr, port = PolicyWorker.link_address(None)  # type: ignore[arg-type]
    names = [("a", "float32", (2, 3)), ("b", "bfloat16", (4,))]
    sent = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.tensor([1.5, -2.0, 3.0, 0.25], dtype=torch.bfloat16))]
    got: dict = {}

    def replica(rank):
        link = WeightLink("gloo", addr, port, rank, 3, timeout=20)
        got[rank] = dict(link.receive(names))
        link.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    link = WeightLink("gloo", addr, port, 0, 3, timeout=20)
    link.send(iter(sent))
    for t in threads:
        t.join(timeout=30)
    link.close()
    for r in (1, 2):
        assert all(torch.equal(got[r][n], t) and got[r][n].dtype == t.dtype for n, t in sent), r


# --------------------------------------------------------------------------- the schedule
class _Trainer:
    """A trainer handle's lag answers: the lag-1 choice and the live version, as a script gives them."""

    def __init__(self, answers):
        self.answers = list(answers)

    def lag_choice(self):
        from graft_rl.engine.generators import _Done

        return _Done(self.answers.pop(0))


class _Group:
    def __init__(self):
        self.version, self.pushes, self.samples = None, [], []

    def push(self, chosen, version):
        self.pushes.append((chosen, version))
        self.version = version
        return 0.5

    def generate(self, prompts, sampling, seed):
        from graft_rl.engine.generators import _Done

        self.samples.append((prompts, self.version))
        return _Done((f"sampled from {self.version}", 1.0))


def test_a_batch_in_flight_is_used_only_if_the_lag_1_run_samples_the_same_weights():
    """Step 2 takes the batch sampled during step 1 (from version 0, the lag-1 choice); every update of step 2
    is skipped (the live version stays 2), so the lag-1 run's step 3 samples version 0 again: the batch
    sampled during step 2 from version 2 is dropped and step 3's is sampled again from version 0."""
    from graft_rl.engine.generators import OneStepOff

    trainer, group = _Trainer([(0, 0), (0, 0), (0, 2), (0, 2), (0, 2), (0, 2), (2, 4)]), _Group()
    one = OneStepOff(load_config(LOOKUP, ["execution=ray"]), {"A": trainer}, {"A": group})
    assert one.batch("A", 1, ["p1"], None, 1).get()[0] == "sampled from 0"  # a run's first step: sampled now
    one.advance("A", 2, ["p2"], None, 2)  # live 0: already there, no push
    assert one.batch("A", 2, ["p2"], None, 2).get()[0] == "sampled from 0"  # the batch in flight
    one.advance("A", 3, ["p3"], None, 3)  # live 2 pushed
    assert one.batch("A", 3, ["p3"], None, 3).get()[0] == "sampled from 0"  # version 2 in flight: sampled again
    one.advance("A", 4, ["p4"], None, 4)
    assert group.pushes == [(True, 0), (False, 2), (True, 0), (False, 2)]
    assert one.take_notes("A") == {"time_push": 2.0, "sample_version": 0}
    assert one.batch("A", 4, ["p4"], None, 4).get()[0] == "sampled from 2"


def test_a_batch_read_back_is_used_for_its_own_prompts_and_refills_get_the_choice_pushed(capsys):
    """After a resume the generators hold the checkpoint's weights, not the lag-1 choice the saved batch was
    sampled from: a refill pushes the choice first. A saved batch of other prompts (the data changed) is
    sampled again."""
    from graft_rl.engine.generators import OneStepOff
    from graft_rl.policy import RolloutGroup

    trainer, group = _Trainer([(4, 6), (4, 6), (4, 6)]), _Group()
    one = OneStepOff(load_config(LOOKUP, ["execution=ray"]), {"A": trainer}, {"A": group})
    saved = [RolloutGroup("q1", "1+1=?", "A", ["2", "3"], [[5], [6]], [[-0.5], [-0.5]], ["stop", "stop"])]
    one.adopt("A", 3, saved, 1.0, 4)
    assert one.batch("A", 3, [("q1", "1+1=?")], None, 3).get()[0] is saved
    assert group.pushes == []
    one.refill("A", [("q9", "9+9=?")], None, 7)
    assert group.pushes == [(True, 4)] and group.samples == [([("q9", "9+9=?")], 4)]
    one.adopt("A", 3, saved, 1.0, 4)
    assert one.batch("A", 3, [("q2", "2+2=?")], None, 3).get()[0] == "sampled from 4"
    assert "answers other prompts" in capsys.readouterr().out


def test_a_saved_batch_in_flight_reads_back_as_it_was_sampled(tmp_path):
    from graft_rl.engine.generators import InFlight, OneStepOff, _Done, load_inflight, save_inflight
    from graft_rl.policy import RolloutGroup

    groups = [
        RolloutGroup("q1", "1+1=?", "A", ["2", "3"], [[5, 6], [7]], [[-0.25, -1.5], [-0.125]], ["stop", "length"])
    ]
    one = OneStepOff(load_config(LOOKUP, ["execution=ray"]), {"A": None, "B": None}, {})
    one.inflight = {n: InFlight(3, _Done((groups if n == "A" else [], 1.5)), 4) for n in "AB"}
    one.inflight["B"] = InFlight(3, _Done(([RolloutGroup(**{**vars(groups[0]), "policy": "B"})], 2.0)), 4)
    save_inflight(tmp_path / "inflight", one, 3)
    back = load_inflight(tmp_path / "inflight", 3, ["A", "B"])
    assert back is not None
    (got, seconds, version) = back["A"]
    assert (seconds, version) == (1.5, 4)
    g = got[0]
    assert (g.prompt_id, g.texts, g.token_ids, g.gen_logprobs, g.finish_reasons) == (
        "q1",
        ["2", "3"],
        [[5, 6], [7]],
        [[-0.25, -1.5], [-0.125]],
        ["stop", "length"],
    )
    assert load_inflight(tmp_path / "inflight", 4, ["A", "B"]) is None  # another step's: sampled again
    (tmp_path / "inflight" / "records" / "A" / "step_000003.parquet").write_bytes(b"torn")
    assert load_inflight(tmp_path / "inflight", 3, ["A", "B"]) is None


# --------------------------------------------------------------------------- runs under Ray
@pytest.fixture(scope="module")
def lookup_runs(tmp_path_factory, ray_local):
    """The lookup pair (hf backend, float32, 4 steps) at rollout.lag: 1, and one step off (a checkpoint at
    step 2 with step 3's batch in flight)."""
    from graft_rl.engine.trainer import Trainer

    root = tmp_path_factory.mktemp("one_step_off")
    base = ["steps=4", "validation.data=[]", "execution=ray", "ray.num_cpus=0.5", "ray.torch_threads=1"]
    runs = {}
    for name, keys in {
        "lag1": ["rollout.lag=1"],
        "one_step_off": ["rollout.mode=one_step_off", "checkpoint_every=2", "rollout.generators.num_cpus=0.5"],
    }.items():
        tr = Trainer(load_config(LOOKUP, [*base, *keys, f"run_dir={root / name}"]), show_progress=False)
        tr.run()
        tr.close()
        runs[name] = root / name
    return runs


def _same_run(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    from graft_rl.engine.store import RecordStore

    assert _strip(_lines(a)) == _strip(_lines(b))
    for name in ("A", "B"):
        assert RecordStore(a).read_exchange(name) == RecordStore(b).read_exchange(name)
        for step in range(1, 5):
            x, y = RecordStore(a).read(name, step), RecordStore(b).read(name, step)
            assert [(g.token_ids, g.gen_logprobs) for g in x] == [(g.token_ids, g.gen_logprobs) for g in y]
        x = load_file(str(a / "checkpoints" / "step_000004" / name / "model.safetensors"))
        y = load_file(str(b / "checkpoints" / "step_000004" / name / "model.safetensors"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        ox = torch.load(a / "checkpoints" / "step_000004" / name / "policy_state.pt", weights_only=False)["optimizer"]
        oy = torch.load(b / "checkpoints" / "step_000004" / name / "policy_state.pt", weights_only=False)["optimizer"]
        for p, s in ox["state"].items():
            assert all(torch.equal(s[k], oy["state"][p][k]) for k in s if isinstance(s[k], torch.Tensor)), name


@pytest.mark.slow
def test_one_step_off_is_the_lag_1_run(lookup_runs):
    """Issue 64: the same metrics (timings aside), stored groups, exchange records, final weights and
    optimiser state as rollout.lag: 1; and it reports its overlap."""
    _same_run(lookup_runs["lag1"], lookup_runs["one_step_off"])
    lines = _lines(lookup_runs["one_step_off"])
    assert [ln["sample_version"] for ln in lines if ln["policy"] == "A"] == [0, 0, 2, 4]  # two updates a step
    assert all("time_wait_generation" in ln and 0 <= ln["generator_idle_frac"] <= 1 for ln in lines)
    assert all(ln["time_push"] > 0 for ln in lines if ln["step"] < 4)


@pytest.mark.slow
@pytest.mark.parametrize("saved", [True, False], ids=["batch-saved", "batch-deleted"])
def test_a_resume_with_a_batch_in_flight_is_the_uninterrupted_run(lookup_runs, tmp_path, saved):
    """Stopped after the checkpoint at step 2 (step 3's batch in flight, saved with it): a resume trains on the
    saved batch, or with the file deleted samples it again from the weights the lag-1 run samples; both
    equal the uninterrupted run. The resume pushes over the object store."""
    from graft_rl.engine.trainer import Trainer

    run = tmp_path / "run"
    shutil.copytree(lookup_runs["one_step_off"], run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    inflight = run / "checkpoints" / "step_000002" / "inflight"
    assert (inflight / "records" / "A" / "step_000003.parquet").is_file()
    if not saved:
        shutil.rmtree(inflight)
    tr = Trainer.resume(run, show_progress=False, overrides=["rollout.transfer=object_store"])
    assert sorted((n, f.step) for n, f in tr.one_step.inflight.items()) == ([("A", 3), ("B", 3)] if saved else [])
    tr.run()
    tr.close()
    _same_run(lookup_runs["one_step_off"], run)


@pytest.mark.slow
def test_a_lora_policy_and_an_fsdp2_policy_train_one_step_off(make_cfg, ray_local, tiny_pair):
    """A LoRA policy (merged weights pushed to a plain generator) and an FSDP2 policy of world 2 (each
    tensor gathered and broadcast from rank 0) train one step off, every push verified, stopped after step 2
    and resumed (generators load the run's own models, not the checkpoint's adapter): step 3 samples the
    weights after step 1's update, read back from the checkpoint's batch in flight."""
    from runs import fake_verify

    from graft_rl.engine.rollouts import Rollouts
    from graft_rl.engine.trainer import Trainer

    pols = [
        {"name": "A", "model": str(tiny_pair[0]), "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}},
        {"name": "B", "model": str(tiny_pair[1]), "world_size": 2},
    ]
    ray_kw = {"execution": "ray", "ray": {"num_cpus": 0.25, "torch_threads": 1}, "checkpoint_every": 2}
    rollout = {"mode": "one_step_off", "generators": {"num_cpus": 0.25}}
    cfg = make_cfg({"name": "graft"}, steps=4, run="lora_fsdp", policies=pols, rollout=rollout, **ray_kw)
    orig = Rollouts.verify_groups
    Rollouts.verify_groups = fake_verify
    try:
        tr = Trainer(cfg, show_progress=False)
        tr.run(max_steps=2)
        tr.close()
        tr = Trainer.resume(cfg.run_dir, show_progress=False)
        assert sorted(tr.one_step.inflight) == ["A", "B"]
        tr.run()
        versions = {n: g.version for n, g in tr.one_step.groups.items()}
        tr.close()
    finally:
        Rollouts.verify_groups = orig
    lines = _lines(cfg.run_dir)
    assert [ln["step"] for ln in lines] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [ln["sample_version"] for ln in lines[:4]] == [0, 0, 0, 0]
    assert all(ln["sample_version"] > 0 for ln in lines[4:])
    assert all(ln["time_push"] > 0 for ln in lines if ln["step"] in (1, 3))  # the first push, the resumed one
    assert all(v is not None and v > 0 for v in versions.values()), versions
