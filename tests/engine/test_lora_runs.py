"""LoRA policies through the trainer (policy.lora): a run stopped and resumed equals the uninterrupted
one, the KL reference is the base with the adapter disabled, checkpoints hold adapters, graft eval and
graft probe read the run."""

from __future__ import annotations

import json

import pytest

from graft_rl.commands.cli import main
from graft_rl.engine.rollouts import Rollouts
from graft_rl.engine.trainer import Trainer

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
pytestmark = pytest.mark.slow  # whole runs

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def _policies(tiny_pair):
    return [
        {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-2, "lora": LORA},
        {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-2, "lora": LORA},
    ]


def _strip(lines):
    return [{k: v for k, v in ln.items() if not k.startswith("time_")} for ln in lines]


@pytest.mark.parametrize("method", [{"name": "graft"}, {"name": "hacpo", "kl_coef": 0.1}], ids=["graft", "hacpo-kl"])
def test_a_lora_run_stopped_and_resumed_equals_the_uninterrupted_run(
    make_cfg, tiny_pair, tiny_data, monkeypatch, method
):
    from runs import fake_verify, quick_eval_args

    monkeypatch.setattr(Rollouts, "verify_groups", fake_verify)
    full = Trainer(make_cfg(method, steps=3, run="full", policies=_policies(tiny_pair)), show_progress=False)
    whole = full.run()
    assert all(p.lora is not None and p.reference is None for p in full.policies.values())  # no second model
    first = Trainer(make_cfg(method, steps=3, run="resumed", policies=_policies(tiny_pair)), show_progress=False)
    first.run(max_steps=2)
    rest = Trainer.resume(first.run_dir, show_progress=False).run()
    assert _strip(whole[-2:]) == _strip(rest)
    if method.get("kl_coef"):  # the KL to the base (adapter disabled) grows from 0 as the adapters train
        kl = [ln["kl_ref"] for ln in whole if ln["policy"] == "A"]
        assert 0 < kl[0] < kl[-1]
    ckpt = first.run_dir / "checkpoints" / "step_000003" / "A"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    settings = json.loads((ckpt / "graft_policy.json").read_text())
    assert settings["lora"]["r"] == 4 and settings["lora_base"]["model"] == str(tiny_pair[0].absolute())
    if method["name"] == "graft":
        assert main(quick_eval_args(first.run_dir, tiny_data)) == 0
        evals = json.loads((first.run_dir / "eval" / "eval.json").read_text())["policies"]
        assert evals["A"]["model"] == str(ckpt) and evals["B"]["benchmarks"]["arith"]["problems"] == 8
