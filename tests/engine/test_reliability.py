"""Nothing lost, nothing mixed (issue 14): signals at every phase, a forced stop, the run-directory
lock, partial and damaged run directories, config changes on resume, torn logs, and one-line
errors for bad input with nothing written."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest
import torch

from graft_rl.commands.cli import main
from graft_rl.engine import checkpointing as checkpointing_mod
from graft_rl.engine import validation as validation_mod
from graft_rl.engine.config import ConfigError, to_dict
from graft_rl.engine.handles import LocalHandle, Pending
from graft_rl.engine.rollouts import Rollouts
from graft_rl.engine.rundir import RunDirError, read_log
from graft_rl.engine.store import RecordStore
from graft_rl.engine.trainer import CheckpointError, RunInterrupted, Trainer
from graft_rl.engine.validation import Validation


def _patch_eval(monkeypatch) -> None:
    """Validation scores that rise with the step and depend on the weights, so every validation
    writes best/ and a resumed run with wrong weights or a wrong step would score differently."""
    real_validate = Validation.run
    at = {}

    def validate(self, step):
        at["step"] = step
        return real_validate(self, step)

    def evaluate(self, *args):  # in-process: the call's result is its own reference
        digest = sum(abs(x) for x in self.policy.param_digest())
        return Pending(self, {"pass@1": at["step"] / 100 + (digest % 1.0) / 1000})

    monkeypatch.setattr(Validation, "run", validate)
    monkeypatch.setattr(LocalHandle, "evaluate", evaluate)


@pytest.fixture
def fake_eval(monkeypatch, fake_rewards):
    _patch_eval(monkeypatch)


def _cfg_for(make_cfg, tiny_data):
    def make(run, **kw):
        args = dict(
            steps=4,
            run=run,
            checkpoint_every=2,
            keep_checkpoints=2,
            validation={"data": [str(tiny_data)], "every": 2, "samples": 1, "max_new_tokens": 4},
        )
        args.update(kw)
        return make_cfg({"name": "graft"}, **args)

    return make


@pytest.fixture
def cfg_for(make_cfg, tiny_data):
    return _cfg_for(make_cfg, tiny_data)


def _snapshot(run_dir):
    """Everything a run leaves that must not depend on interruptions (times stripped)."""

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]

    store = RecordStore(run_dir)
    records = {
        (n, s): [(g.prompt_id, g.texts, g.rewards) for g in store.read(n, s)]
        for n in ("A", "B")
        for s in store.steps(n)
    }
    exchange = {
        n: [(r["step"], r["prompt_id"], r["group_index"], r["weight"]) for r in store.read_exchange(n)]
        for n in ("A", "B")
    }
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    weights = {n: [p.detach().clone() for p in _load(final / n)] for n in ("A", "B")}
    best = {n: [p.detach().clone() for p in _load(run_dir / "best" / n)] for n in ("A", "B")}
    return {
        "metrics": strip(read_log(run_dir / "metrics.jsonl")[0]),
        "validation": strip(read_log(run_dir / "validation.jsonl")[0]),
        "records": records,
        "exchange": exchange,
        "final": final.name,
        "weights": weights,
        "best": best,
        "best.json": json.loads((run_dir / "best" / "best.json").read_text()),
    }


def _load(path):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(path).parameters())


def _same(a, b):
    for key in ("metrics", "validation", "records", "exchange", "final", "best.json"):
        assert a[key] == b[key], key
    for key in ("weights", "best"):
        for n in ("A", "B"):
            assert all(torch.equal(x, y) for x, y in zip(a[key][n], b[key][n], strict=True)), (key, n)


def _shared_run(tmp_path_factory, tiny_pair, tiny_data, name: str, max_steps: int | None = None):
    """A run made once per module, which tests copy instead of training their own."""
    from runs import cfg_maker, fake_verify

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Rollouts, "verify_groups", fake_verify)
        _patch_eval(mp)
        make = _cfg_for(cfg_maker(tmp_path_factory.mktemp("reliability"), tiny_pair, tiny_data), tiny_data)
        tr = Trainer(make(name), show_progress=False)
        tr.run(max_steps)
        tr.close()
        return tr.run_dir


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory, tiny_pair, tiny_data):
    """The uninterrupted run every interrupted one is compared with (4 steps; only read or copied)."""
    return _shared_run(tmp_path_factory, tiny_pair, tiny_data, "baseline")


@pytest.fixture(scope="module")
def baseline(baseline_run):
    return _snapshot(baseline_run)


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory, tiny_pair, tiny_data):
    """The same run stopped after step 3 (done, not checkpointed: a resume redoes it)."""
    return _shared_run(tmp_path_factory, tiny_pair, tiny_data, "stopped", max_steps=3)


def _copy_run(run_dir, tmp_path, name):
    """A copy of a shared run to resume (its config names another run_dir: a resume sets its own)."""
    dest = tmp_path / name
    shutil.copytree(run_dir, dest)
    return dest


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


# phase -> (object, attribute, predicate on the call's arguments) at which step 2's signal is sent
PHASES = {
    "generate": (Rollouts, "generation_seed", lambda self, name, step: step == 2),
    "update": (Trainer, "_train_receiver", lambda self, name, batch, step: step == 2 and name == "B"),
    "validate": (Validation, "run", lambda self, step: step == 2),
    "checkpoint": (Trainer, "save_checkpoint", lambda self, step: step == 2),
    "best-write": (
        validation_mod,
        "replace_dir",
        lambda tmp, final: final.parent.name == "best" and "step2" in str(os.environ.get("PHASE_STEP")),
    ),
    "prune": (checkpointing_mod, "remove_dir", lambda path: True),
}


#: each phase's stop is one check; these three run in the fast tier, the rest in the slow one (same path)
FAST_PHASES = ("generate", "update", "checkpoint")


@pytest.mark.parametrize("phase", [p if p in FAST_PHASES else pytest.param(p, marks=pytest.mark.slow) for p in PHASES])
def test_a_signal_at_any_phase_then_resume_equals_the_uninterrupted_run(
    phase, cfg_for, baseline, fake_eval, monkeypatch
):
    owner, attr, when = PHASES[phase]
    real = getattr(owner, attr)
    fired = []

    def wrapped(*args, **kw):
        if not fired and when(*args, **kw):
            fired.append(1)
            _sigterm()
        return real(*args, **kw)

    if phase == "best-write":  # the best/ write of step 2's validation
        real_validate = Validation.run

        def validate(self, step):
            os.environ["PHASE_STEP"] = f"step{step}"
            return real_validate(self, step)

        monkeypatch.setattr(Validation, "run", validate)
    monkeypatch.setattr(owner, attr, wrapped)
    # pruning happens only when more than keep_checkpoints exist: checkpoint every step there
    # (when checkpoints are written does not change what a step computes)
    tr = Trainer(cfg_for(f"intr_{phase}", **({"checkpoint_every": 1} if phase == "prune" else {})), show_progress=False)
    with pytest.raises(RunInterrupted) as info:
        tr.run()
    assert fired and info.value.signum == signal.SIGTERM
    stopped = json.loads((sorted((tr.run_dir / "checkpoints").glob("step_*"))[-1] / "trainer_state.json").read_text())[
        "step"
    ]
    monkeypatch.setattr(owner, attr, real)
    resumed = Trainer.resume(tr.run_dir, show_progress=False)
    assert resumed.start_step == stopped + 1  # the step in flight was finished, not lost
    resumed.run()
    _same(_snapshot(tr.run_dir), baseline)


def test_a_second_signal_stops_at_once_and_resume_still_equals_the_uninterrupted_run(
    cfg_for, baseline, fake_eval, monkeypatch
):
    real = Trainer._train_receiver

    def twice(self, name, batch, step):
        if step == 3 and name == "A":
            _sigterm()
            _sigterm()  # the second one raises here, mid-step
        return real(self, name, batch, step)

    monkeypatch.setattr(Trainer, "_train_receiver", twice)
    tr = Trainer(cfg_for("forced"), show_progress=False)
    with pytest.raises(KeyboardInterrupt) as info:
        tr.run()
    assert not isinstance(info.value, RunInterrupted)
    monkeypatch.setattr(Trainer, "_train_receiver", real)
    resumed = Trainer.resume(tr.run_dir, show_progress=False)
    assert resumed.start_step == 3  # from the step-2 checkpoint; step 3's partial work is dropped
    resumed.run()
    _same(_snapshot(tr.run_dir), baseline)


def test_sigterm_exits_143_from_the_command_line(cfg_for, fake_eval, monkeypatch, tmp_path):
    import yaml

    from graft_rl.engine.config import to_dict

    cfg = cfg_for("cli_term")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    real = Trainer._train_receiver

    def term(self, name, batch, step):
        if step == 1 and name == "A":
            _sigterm()
        return real(self, name, batch, step)

    monkeypatch.setattr(Trainer, "_train_receiver", term)
    assert main(["train", str(path), "--no-progress"]) == 128 + signal.SIGTERM


def test_a_second_run_on_the_same_directory_is_refused_naming_the_holder(cfg_for, fake_rewards):
    first = Trainer(cfg_for("locked"), show_progress=False)  # holds the lock until its run ends
    with pytest.raises(RunDirError, match=rf"in use by another graft train \(pid {os.getpid()}\)"):
        Trainer.resume(first.run_dir, show_progress=False)
    first.run(max_steps=1)
    Trainer.resume(first.run_dir, show_progress=False).close()  # free again once the run has stopped


def test_a_deleted_lock_file_does_not_let_a_second_writer_in(cfg_for, fake_rewards):
    """Issue 33: the lock is the OS's, on the run directory; RUN_DIR/.lock only names the holder."""
    first = Trainer(cfg_for("unlocked"), show_progress=False)
    try:
        (first.run_dir / ".lock").unlink()
        with pytest.raises(RunDirError, match=r"is in use by another graft train \(pid \?\)"):
            Trainer.resume(first.run_dir, show_progress=False)
        (first.run_dir / ".lock").write_text("12345\n")  # a replaced pid file: still refused
        with pytest.raises(RunDirError, match=r"in use by another graft train \(pid 12345\)"):
            Trainer.resume(first.run_dir, show_progress=False)
    finally:
        first.close()
    Trainer.resume(first.run_dir, show_progress=False).close()


def test_a_fresh_run_refuses_a_partial_directory_and_resume_restarts_it(cfg_for, fake_eval, monkeypatch):
    tr = Trainer(cfg_for("partial"), show_progress=False)
    real = Trainer._train_receiver

    def killed(self, name, batch, step):  # killed during step 1: no checkpoint, a step-0 validation
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_train_receiver", killed)
    with pytest.raises(KeyboardInterrupt):
        tr.run()
    assert (tr.run_dir / "validation.jsonl").is_file() and not (tr.run_dir / "checkpoints").exists()
    monkeypatch.setattr(Trainer, "_train_receiver", real)
    with pytest.raises(ConfigError, match=r"already holds a run \(.*config.yaml.*\); use --resume"):
        Trainer(cfg_for("partial"), show_progress=False)
    resumed = Trainer.resume(tr.run_dir, show_progress=False)
    assert resumed.start_step == 1
    resumed.run()
    steps0 = [r for r in read_log(tr.run_dir / "validation.jsonl")[0] if r["step"] == 0]
    assert len(steps0) == 2  # one line per policy, not a second set


def test_resume_refuses_a_config_change_that_alters_results(cfg_for, fake_rewards):
    import yaml

    tr = Trainer(cfg_for("cfgcheck"), show_progress=False)
    tr.run(max_steps=2)
    path = tr.run_dir / "config.yaml"
    data = yaml.safe_load(path.read_text())
    data["method"]["name"] = "grpo"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(
        ConfigError, match=r"config key method.name changed since checkpoint step_000002 \('graft' -> 'grpo'\)"
    ):
        Trainer.resume(tr.run_dir, show_progress=False)
    data["method"]["name"] = "graft"
    path.write_text(yaml.safe_dump(data))
    longer = Trainer.resume(tr.run_dir, show_progress=False, overrides=["steps=5"])  # harmless: more steps
    assert longer.total_steps == 5
    longer.close()


def _zero_inside(path, n=1000):
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start : start + n] = bytes(min(n, len(data) - start))
    path.write_bytes(bytes(data))


DAMAGE = {  # how a file of the newest checkpoint is damaged -> what resume says
    "emptied optimiser state": (
        lambda d: (d / "A" / "policy_state.pt").write_bytes(b""),
        r"A/policy_state.pt has 0 bytes",
    ),
    "zeroed bytes inside the optimiser state": (
        lambda d: _zero_inside(d / "A" / "policy_state.pt"),
        r"A/policy_state.pt differs from what was written \(sha256\)",
    ),
    "truncated weights": (
        lambda d: (d / "B" / "model.safetensors").write_bytes((d / "B" / "model.safetensors").read_bytes()[:500]),
        r"B/model.safetensors has 500 bytes",
    ),
    "deleted tokenizer": (lambda d: (d / "A" / "tokenizer.json").unlink(), r"A/tokenizer.json is missing"),
    "changed trainer state": (
        lambda d: (d / "trainer_state.json").write_text(
            (d / "trainer_state.json").read_text().replace('"step": 4', '"step": 3')
        ),
        r"trainer_state.json differs",
    ),
    # issue 33: a missing manifest disabled the check, and the damaged weights were trained on
    "deleted manifest and zeroed weights": (
        lambda d: ((d / "manifest.json").unlink(), _zero_inside(d / "A" / "model.safetensors", 4096)),
        r"manifest.json is missing",
    ),
}


@pytest.mark.parametrize(  # two kinds in the fast tier (one per check: size, sha256), every kind in the slow one
    "damage",
    [
        d
        if d in ("emptied optimiser state", "deleted manifest and zeroed weights")
        else pytest.param(d, marks=pytest.mark.slow)
        for d in DAMAGE
    ],
)
def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_damaged(
    damage, baseline_run, baseline, fake_eval, capsys, tmp_path
):
    """Issue 24: every checkpoint file is checked against the sha256 recorded when it was written, so
    damage that leaves a loadable file (zeroed bytes inside, a changed state) is caught too."""
    run_dir = _copy_run(baseline_run, tmp_path, "damaged")
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    harm, message = DAMAGE[damage]
    harm(newest)
    capsys.readouterr()
    resumed = Trainer.resume(run_dir, show_progress=False)
    out = capsys.readouterr().out
    assert re.search(rf"checkpoint step_000004 is damaged \({message}", out), out
    assert resumed.start_step == 3
    resumed.run()
    _same(_snapshot(run_dir), baseline)


def test_when_every_checkpoint_is_damaged_resume_refuses_and_deletes_nothing(cfg_for, fake_eval):
    tr = Trainer(cfg_for("all_damaged", keep_checkpoints=1), show_progress=False)
    tr.run()
    (only,) = sorted((tr.run_dir / "checkpoints").glob("step_*"))
    _zero_inside(only / "A" / "model.safetensors")
    before = sorted(str(p.relative_to(tr.run_dir)) for p in tr.run_dir.rglob("*") if p.name != ".lock")
    with pytest.raises(
        CheckpointError,
        match=r"every checkpoint is damaged \(step_000004: A/model.safetensors differs.*nothing was deleted",
    ):
        Trainer.resume(tr.run_dir, show_progress=False)
    assert sorted(str(p.relative_to(tr.run_dir)) for p in tr.run_dir.rglob("*") if p.name != ".lock") == before


def test_graft_eval_refuses_a_best_checkpoint_that_is_not_what_was_written(cfg_for, fake_eval):
    from graft_rl.commands.evaluate_cli import resolve_targets
    from graft_rl.data import DatasetError

    tr = Trainer(cfg_for("best_damaged"), show_progress=False)
    tr.run()
    assert [pc.model for pc in resolve_targets(str(tr.run_dir))] == [str(tr.run_dir / "best" / n) for n in "AB"]
    _zero_inside(tr.run_dir / "best" / "B" / "model.safetensors", 64)
    for target in (tr.run_dir, tr.run_dir / "best" / "B"):  # the run, or the directory itself
        with pytest.raises(
            DatasetError, match=r"best/B: model.safetensors differs from what was written.*not evaluated"
        ):
            resolve_targets(str(target))
    ckpt = sorted((tr.run_dir / "checkpoints").glob("step_*"))[-1]
    _zero_inside(ckpt / "A" / "model.safetensors", 64)
    with pytest.raises(DatasetError, match=r"step_000004/A: A/model.safetensors differs"):
        resolve_targets(str(ckpt / "A"))
    assert resolve_targets(str(ckpt / "B"))[0].model == str(ckpt / "B")  # B's files are intact


def test_a_torn_last_metrics_line_neither_breaks_resume_nor_analysis(cfg_for, fake_rewards):
    from graft_rl.commands.report import run_summary

    tr = Trainer(cfg_for("torn", validation={"data": []}), show_progress=False)
    tr.run(max_steps=2)
    with (tr.run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "policy": "A", "rew')  # power lost mid-line
    assert len(run_summary(tr.run_dir)) == 2
    resumed = Trainer.resume(tr.run_dir, show_progress=False)
    resumed.run()
    assert [r["step"] for r in read_log(tr.run_dir / "metrics.jsonl")[0]] == [1, 1, 2, 2, 3, 3, 4, 4]


def test_interrupted_writes_are_cleaned_up_on_resume(cfg_for, fake_rewards, capsys):
    tr = Trainer(cfg_for("stale", validation={"data": []}), show_progress=False)
    tr.run(max_steps=2)
    (tr.run_dir / "checkpoints" / ".step_000003.tmp" / "A").mkdir(parents=True)
    (tr.run_dir / "checkpoints" / ".trash_step_000001").mkdir()
    Trainer.resume(tr.run_dir, show_progress=False).close()
    out = capsys.readouterr().out
    assert "removed checkpoints/.step_000003.tmp" in out and "removed checkpoints/.trash_step_000001" in out
    assert sorted(p.name for p in (tr.run_dir / "checkpoints").iterdir()) == ["step_000002"]


def test_a_full_disk_at_checkpoint_time_is_one_line(cfg_for, fake_rewards, monkeypatch):
    def full(*a, **k):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        )

    monkeypatch.setattr(torch, "save", full)
    tr = Trainer(cfg_for("full", validation={"data": []}), show_progress=False)
    with pytest.raises(
        CheckpointError,
        match=r"cannot write checkpoint .*step_000002: the disk is full or failed while "
        r"writing \(RuntimeError from torch/safetensors\); [\d,]+ MB free there",
    ):
        tr.run()


def test_a_full_disk_while_best_is_written_is_one_line(cfg_for, fake_eval, monkeypatch, capsys):
    """Issue 24: the best/ write (safetensors) on a full disk: one line from graft train, not a traceback."""
    from transformers import PreTrainedModel

    def full(self, *a, **k):
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    tr = Trainer(cfg_for("full_best"), show_progress=False)
    with pytest.raises(CheckpointError, match=r"cannot write .*best: No space left on device; [\d,]+ MB free there$"):
        tr.run()


BAD = [
    (["policies.5.lr=1"], "policies has 2 entries"),
    (["policies.x.lr=1"], "policies is a list; index it with a number"),
    (["steps.x=1"], "steps is a value"),
    (["temperature=-1"], "temperature must be a finite number > 0"),
    (["temperature=.inf"], "temperature must be a finite number > 0, got inf"),  # issue 33: every gradient 0
    (["validation.temperature=.inf"], "validation.temperature must be a finite number > 0"),
    (["policies.0.name=Org/Model"], "policies.0.name 'Org/Model': a policy name is letters, digits"),
    (["policies.0.name=.."], "policies.0.name '..': a policy name is"),
    (['policies.0.name=""'], "policies.0.name '': a policy name is"),
    ([" policies.5.lr=1"], "policies has 2 entries"),  # a leading space: the key, not an empty first part
    (
        ["data.train=reasoning_gym:chain_sum:abc"],
        "reasoning_gym:chain_sum:abc: expected reasoning_gym:NAME[:SIZE[:SEED]]",
    ),
    (["validation.every=0"], "validation.every must be >= 1"),
    (["steps=0"], "steps must be >= 1"),
    (["steps=-1"], "steps must be >= 1"),
    (["n=1"], "n must be >= 2"),
    (["data.train=BINARY"], "not UTF-8 text"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(overrides, message, cfg_for, tmp_path, capsys):
    import yaml

    from graft_rl.engine.config import to_dict

    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    cfg = to_dict(cfg_for("unused"))
    run_dir = tmp_path / "bad_run"
    cfg["run_dir"] = str(run_dir)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = main(["train", str(path), "--no-progress", *[o.replace("BINARY", str(binary)) for o in overrides]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not run_dir.exists()


def test_a_config_that_is_not_utf8_or_is_a_directory_is_one_line(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run_dir: r\n# caf\xe9\n".encode("latin-1"))
    assert main(["train", str(bad), "--no-progress"]) == 2
    assert main(["train", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "latin1.yaml: not UTF-8 text (byte" in err[0], err
    assert f"{tmp_path} is a directory, not a config file (to continue a run in it: graft train --resume" in err[1]


def test_resume_with_fewer_steps_than_done_is_refused_and_changes_nothing(cfg_for, fake_rewards):
    """Issue 33: `--resume steps=2` on a run at step 4 exited 0 and rewrote config.yaml to steps: 2."""
    tr = Trainer(cfg_for("shorter", steps=4), show_progress=False)
    tr.run()
    tr.close()
    before = (tr.run_dir / "config.yaml").read_text()
    with pytest.raises(
        ConfigError, match=r"has done 4 steps \(checkpoint step_000004\) and would stop at 2; .* not lower"
    ):
        Trainer.resume(tr.run_dir, show_progress=False, overrides=["steps=2"])
    assert (tr.run_dir / "config.yaml").read_text() == before


def test_disk_full_while_logging_is_one_line(cfg_for, fake_rewards, monkeypatch, tmp_path, capsys):
    import errno

    import yaml

    from graft_rl.engine.config import to_dict

    def enospc(self, lines):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir / "metrics.jsonl"))

    monkeypatch.setattr(Trainer, "_write_metrics", enospc)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg_for("enospc", validation={"data": []}))))
    assert main(["train", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl: No space left on device; free space or write elsewhere" in err[0]


def test_best_matches_the_logs_after_a_resume_that_drops_later_validations(cfg_for, fake_eval, monkeypatch, capsys):
    """Issue 24: killed right after step 3's validation (best/ then holds step 3's weights), resumed
    from the step-2 checkpoint with validation.every changed: the log keeps steps <= 2, and best/
    holds exactly the weights best.json and the log name (step 2's, kept beside that checkpoint)."""
    real = Validation.run

    def killed_after(self, step):
        lines = real(self, step)
        if step == 3:
            raise KeyboardInterrupt  # as kill -9 right after the validation's writes
        return lines

    monkeypatch.setattr(Validation, "run", killed_after)
    val = {**to_dict(cfg_for("probe").validation), "every": 1}
    tr = Trainer(cfg_for("best_vs_logs", validation=val), show_progress=False)
    with pytest.raises(KeyboardInterrupt):
        tr.run()
    assert json.loads((tr.run_dir / "best" / "best.json").read_text())["A"]["step"] == 3
    monkeypatch.setattr(Validation, "run", real)
    resumed = Trainer.resume(tr.run_dir, show_progress=False, overrides=["validation.every=2"])
    assert "best/A restored to step 2's weights" in capsys.readouterr().out
    best = json.loads((tr.run_dir / "best" / "best.json").read_text())
    logged = {
        r["policy"]: r["step"] for r in read_log(tr.run_dir / "validation.jsonl")[0] if r.get("best_step") == r["step"]
    }
    assert {n: best[n]["step"] for n in "AB"} == {"A": 2, "B": 2} == {n: logged[n] for n in "AB"}
    for n in "AB":
        for p, q in zip(
            _load(tr.run_dir / "best" / n), _load(tr.run_dir / "checkpoints" / "step_000002" / n), strict=True
        ):
            assert torch.equal(p, q)
    resumed.run()  # and the run goes on to its end
    assert json.loads((tr.run_dir / "best" / "best.json").read_text())["A"]["step"] == 4


def test_a_torn_record_file_or_damaged_log_line_is_one_line(cfg_for, fake_rewards, tmp_path, capsys):
    """Issue 24: a stored peer's record file cut short (graft train) and a damaged middle line of
    validation.jsonl (graft analyze): one line naming the file, exit 2 -- not a pyarrow traceback."""
    import yaml

    peer = Trainer(cfg_for("peer_src", steps=2, validation={"data": []}), show_progress=False)
    peer.run()
    rec = RecordStore(peer.run_dir).path("A", 1)
    rec.write_bytes(rec.read_bytes()[: rec.stat().st_size // 2])
    cfg = to_dict(cfg_for("with_peer", steps=2, validation={"data": []}))
    cfg["policies"] = [p for p in cfg["policies"] if p["name"] == "B"]
    cfg["peers"] = [{"records": str(peer.run_dir), "policy": "A"}]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("graft")]
    assert len(err) == 1 and "step_000001.parquet: not a readable record file" in err[0]

    tr = Trainer(cfg_for("damaged_log", steps=4), show_progress=False)
    tr.run()
    log = tr.run_dir / "validation.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:20]
    log.write_text("\n".join(lines) + "\n")
    assert main(["analyze", str(tr.run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "validation.jsonl:2: not valid JSON" in err[0]


def test_a_torn_run_config_is_recovered_from_the_checkpoint(cfg_for, baseline, fake_eval, capsys):
    """Issue 24: a config.yaml cut short (it said "at least one policy is required") is named as damaged,
    and resume takes the config every checkpoint saved; the run still equals the uninterrupted one."""
    tr = Trainer(cfg_for("torn_cfg"), show_progress=False)
    tr.run(max_steps=2)
    cfg = tr.run_dir / "config.yaml"
    cfg.write_text(cfg.read_text()[:200])
    resumed = Trainer.resume(tr.run_dir, show_progress=False)
    assert "config.yaml is damaged" in capsys.readouterr().out and resumed.start_step == 3
    resumed.run()
    _same(_snapshot(tr.run_dir), baseline)


# ---------------------------------------------------------------- issue 33: manifests that bind, best/ that is not swapped
def test_checkpoints_swapped_by_name_are_refused_not_resumed(cfg_for, fake_eval):
    """step_000002 and step_000004 swapped by name: each holds another step's state (its manifest and
    trainer_state say so): resume refuses, naming it, and deletes nothing."""
    tr = Trainer(cfg_for("swapped"), show_progress=False)
    tr.run()
    root = tr.run_dir / "checkpoints"
    os.replace(root / "step_000002", root / "tmp")
    os.replace(root / "step_000004", root / "step_000002")
    os.replace(root / "tmp", root / "step_000004")
    with pytest.raises(CheckpointError, match=r"step_000004: it holds step 2's state, not step 4's"):
        Trainer.resume(tr.run_dir, show_progress=False)


def test_a_checkpoint_of_another_run_is_refused(cfg_for, fake_eval, capsys):
    import shutil

    other = Trainer(cfg_for("other_run", steps=2, validation={"data": []}), show_progress=False)
    other.run()
    tr = Trainer(cfg_for("this_run", steps=2, validation={"data": []}), show_progress=False)
    tr.run(max_steps=1)  # no checkpoint yet (checkpoint_every 2)
    shutil.copytree(other.run_dir / "checkpoints" / "step_000002", tr.run_dir / "checkpoints" / "step_000002")
    (tr.run_dir / "run_id").write_text("f" * 32)
    with pytest.raises(CheckpointError, match=r"written by another run"):
        Trainer.resume(tr.run_dir, show_progress=False)


def test_a_symbolic_link_at_best_policy_is_refused_in_one_line(cfg_for, fake_eval, tmp_path):
    from graft_rl.engine.rundir import RunDirError

    tr = Trainer(cfg_for("best_link"), show_progress=False)
    tr.run(max_steps=2)
    elsewhere = tmp_path / "kept_B"
    os.replace(tr.run_dir / "best" / "B", elsewhere)
    os.symlink(elsewhere, tr.run_dir / "best" / "B")
    with pytest.raises(RunDirError, match=r"best/B is a symbolic link.*its target is left as it is") as err:
        Trainer.resume(tr.run_dir, show_progress=False)  # refused before anything loads
    assert "\n" not in str(err.value) and (elsewhere / "config.json").is_file()
    # a link made while a run trains: the next best/ write refuses it (nothing written through it)
    from graft_rl.engine.rundir import replace_dir

    (tr.run_dir / "tmp_best").mkdir()
    with pytest.raises(RunDirError, match="symbolic link"):
        replace_dir(tr.run_dir / "tmp_best", tr.run_dir / "best" / "B")
    assert (elsewhere / "config.json").is_file()


def test_graft_eval_never_evaluates_another_checkpoint_in_place_of_best(cfg_for, fake_eval):
    """Issue 33: best/A that lost a file made graft eval evaluate checkpoints/step_N/A and say ok."""
    from graft_rl.commands.evaluate_cli import resolve_targets
    from graft_rl.data import DatasetError

    tr = Trainer(cfg_for("no_swap"), show_progress=False)
    tr.run()
    (tr.run_dir / "best" / "A" / "config.json").unlink()
    with pytest.raises(
        DatasetError, match=r"best.json names step 4, but best/A is missing.*graft eval .*step_000004/A"
    ):
        resolve_targets(str(tr.run_dir), "A")
    (tr.run_dir / "best" / "B" / "manifest.json").unlink()
    with pytest.raises(DatasetError, match=r"best/B: manifest.json is missing"):
        resolve_targets(str(tr.run_dir), "B")
    import shutil

    shutil.rmtree(tr.run_dir / "best" / "B")  # best.json still names it (a crash between the renames)
    with pytest.raises(DatasetError, match=r"best.json names step 4, but best/B is missing"):
        resolve_targets(str(tr.run_dir), "B")


# ---------------------------------------------------------------- issue 33: what a resume may change
def _training_part(snap, steps=4):
    return (
        [m for m in snap["metrics"] if m["step"] <= steps],
        {k: v for k, v in snap["records"].items() if k[1] <= steps},
        {n: [r for r in rows if r[0] <= steps] for n, rows in snap["exchange"].items()},
    )


ALLOWED = {  # override on resume -> what stays comparable with the uninterrupted run
    "steps=6": ["steps=6"],
    "validation.every=1": ["validation.every=1"],
    "checkpoint_every=1, keep_checkpoints=3": ["checkpoint_every=1", "keep_checkpoints=3"],
    "report_to, tracking, tensorboard": [
        "report_to=[tensorboard]",
        "tracking.completions_every=1",
        "tensorboard=false",
    ],
    "torch_threads as it was": ["torch_threads={threads}"],
    "validation.at_start": ["validation.at_start=true"],
}


@pytest.mark.parametrize(  # two changes in the fast tier, every one in the slow one (the same resume path)
    "change",
    [c if c in ("steps=6", "validation.every=1") else pytest.param(c, marks=pytest.mark.slow) for c in ALLOWED],
)
def test_every_change_a_resume_allows_gives_the_uninterrupted_run(change, stopped_at_3, baseline, fake_eval, tmp_path):
    """Issue 33 (docs/reliability.md lists these): stopped within step 3 (the last checkpoint is step 2's),
    resumed with the change: steps 1-4's rollouts, exchanges, metrics and step 4's weights are the
    uninterrupted run's."""
    run_dir = _copy_run(stopped_at_3, tmp_path, "allowed")
    overrides = [o.format(threads=torch.get_num_threads()) for o in ALLOWED[change]]
    resumed = Trainer.resume(run_dir, show_progress=False, overrides=overrides)
    assert resumed.start_step == 3
    resumed.run()
    snap = _snapshot(run_dir)
    assert _training_part(snap) == _training_part(baseline)
    step4 = run_dir / "checkpoints" / "step_000004"
    for n in ("A", "B"):
        assert all(torch.equal(x, y) for x, y in zip(_load(step4 / n), baseline["weights"][n], strict=True)), n


def test_a_resume_with_another_thread_count_is_refused_naming_the_override(cfg_for, fake_rewards):
    pytest.importorskip("ray", reason="the override moves the run to execution: ray (the ray extra)")
    """Issue 33: `--resume execution=ray ray.num_cpus=0.5` on a local run of 2 threads gave 1 thread per
    actor: sums rounded differently and steps 4+ diverged. The thread count is checked, with the override."""
    tr = Trainer(cfg_for("threads", validation={"data": []}, torch_threads=2), show_progress=False)
    tr.run(max_steps=2)
    with pytest.raises(
        ConfigError, match=r"policy A computed with 2 torch threads .* would resume with 1.*ray.torch_threads=2"
    ):
        Trainer.resume(tr.run_dir, show_progress=False, overrides=["execution=ray", "ray.num_cpus=0.5"])
    with pytest.raises(ConfigError, match=r"would resume with 1.*torch_threads=2"):
        Trainer.resume(tr.run_dir, show_progress=False, overrides=["torch_threads=1"])
