"""End-to-end regression check on GRAFT's mechanism (issue 13, item 3).

The lookup pair (``graft_rl.testbed``, ``zoo:lookup-a/b``, ``configs/lookup/graft.yaml``): model A
was taught a wrong rule for the family ``shift3`` and sharpened, so none of its samples there is
expected to be right (p ~ 1e-6 each) and its groups all fail; model B is right about half the
time. The pool holds only ``shift3``. So GRPO gives A no gradient at all, and the only way A can learn the family is from B's mixed groups,
grafted in with B's advantages and admitted by the compatibility gate (the failed response differs
from B's in one answer token of ~80 characters, so the gate admits).

The check: with the same seed and steps, A's held-out accuracy on ``shift3`` rises under GRAFT and
stays where it was under GRPO. It must fail when the mechanism is broken, and the last two tests
show that it does: with the exchange switched off (GRAFT's selection picks no prompt) and with
every group's advantages zeroed, A ends where it started.

Margins (``Intel(R) Xeon(R) Processor``, 2 cores): over seeds 0-3 GRAFT took A from 0 % to
19-60 % (about 380 groups grafted, 76-99 % of their responses admitted); the assertion asks for 10
points. Under GRPO A ended at 0.0 % in all four (every group failed; A's weights change only by
weight decay). About 30 s a run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graft_rl import algo
from graft_rl.commands.report import family_summary
from graft_rl.data import load_jsonl
from graft_rl.engine.config import load_config
from graft_rl.engine.trainer import Trainer
from graft_rl.testbed import lookup_right_digit_probability, shipped_root

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "lookup" / "graft.yaml"
LORA_CONFIG = CONFIG.with_name("graft_lora.yaml")  # the same pair, seed and steps with LoRA on both policies
FAMILY = "shift3"  # A's missing family: the whole pool
RISE = 0.10  # GRAFT must lift A's held-out accuracy on it by at least this much
STAY = 0.02  # without the mechanism A may move by at most this (it gets no gradient: sampling noise only)

_runs: dict[str, dict] = {}


def _run(tmp_path_factory, variant: str) -> dict:
    """One run of the lookup config (40 steps, seed 0); A's and B's per-family summary rows."""
    if variant in _runs:
        return _runs[variant]
    run_dir = tmp_path_factory.mktemp(variant) / "run"
    # grpo: graft.yaml's exchange switch (balance: false) goes back to its default, as configs/lookup/grpo.yaml does
    grpo = variant in ("grpo", "lora_grpo")
    extra = ["method.name=grpo", "method.balance=true"] if grpo else ["seed=0"]
    config = LORA_CONFIG if variant.startswith("lora_") else CONFIG
    # 4 validation samples a prompt, not 8: training is the same (validation draws from its own seeds) and
    # 256 samples of shift3 still resolve the 10-point rise (the graft.yaml runs rose 19-60 points)
    cfg = load_config(config, [f"run_dir={run_dir}", "validation.samples=4", *extra])
    mp = pytest.MonkeyPatch()
    try:
        if variant == "exchange_off":  # GRAFT's selection picks no prompt: nothing is ever grafted

            def no_exchange(k_a, k_b, n, balance=True):
                none = torch.zeros_like(k_a, dtype=torch.bool)
                return none, none.clone()

            mp.setattr(algo, "balanced_exchange", no_exchange)
        elif variant == "advantages_zeroed":  # every group's (own and grafted) advantages are zero
            mp.setattr(
                algo, "grpo_advantages", lambda rewards, eps=1e-6: torch.zeros_like(rewards, dtype=torch.float32)
            )
        Trainer(cfg, show_progress=False).run()
    finally:
        mp.undo()
    rows = {(r["policy"], r["family"]): r for r in family_summary(run_dir)}
    rows["run_dir"] = run_dir
    _runs[variant] = rows
    return rows


def right_digit_probability(which: str, family: str) -> list[float]:
    root = shipped_root("lookup")
    held = [p for p in load_jsonl(root / "heldout.jsonl") if p.subject == family]
    return lookup_right_digit_probability(root / f"model_{which}", held)


def test_the_pair_is_built_as_described():
    """A is confidently wrong on shift3 (no sample of a 40-step run is expected to be right: 5,120
    samples x p < 1e-5); B is right about half the time there, so its groups are mixed."""
    a, b = right_digit_probability("a", FAMILY), right_digit_probability("b", FAMILY)
    assert len(a) == len(b) == 64
    assert max(a) < 1e-5
    assert 0.35 < sum(b) / len(b) < 0.65


@pytest.mark.slow
def test_graft_teaches_the_receiver_its_missing_family_and_grpo_does_not(tmp_path_factory):
    graft, grpo = _run(tmp_path_factory, "graft"), _run(tmp_path_factory, "grpo")
    g, c = graft[("A", FAMILY)], grpo[("A", FAMILY)]
    # the same start (same pair, seed and validation samples), and A's groups all fail there
    assert g["val_before"] == c["val_before"] < 0.01
    assert c["groups"] > 0 and c["all_fail"] >= 0.99 * c["groups"]  # p ~ 1e-6 a sample: all 640 fail here
    # GRPO: no gradient from all-failed groups, so no progress
    assert c["val_after"] <= c["val_before"] + STAY
    assert c["grafted"] == 0
    # GRAFT: B's groups replace A's failed ones, the gate admits them, and A learns the family
    assert g["grafted"] >= 100 and g["admitted_frac"] > 0.5
    assert g["val_after"] >= g["val_before"] + RISE, (
        f"GRAFT moved A's {FAMILY} only {g['val_before']:.3f} -> {g['val_after']:.3f}"
    )
    assert g["val_after"] >= c["val_after"] + RISE
    # and not by wrecking A: its other family stays within noise of where GRPO leaves it
    assert graft[("A", "shift6")]["val_after"] >= grpo[("A", "shift6")]["val_after"] - 0.25


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["exchange_off", "advantages_zeroed"])
def test_the_check_fails_without_the_mechanism(tmp_path_factory, variant):
    rows = _run(tmp_path_factory, variant)
    a = rows[("A", FAMILY)]
    assert a["val_after"] <= a["val_before"] + STAY  # the assertion of the check above would fail
    if variant == "exchange_off":
        assert a["grafted"] == 0
    else:
        assert a["grafted"] >= 100  # exchanged, but with nothing to learn from


@pytest.mark.slow
def test_with_lora_adapters_graft_still_teaches_the_missing_family_and_grpo_does_not(tmp_path_factory):
    """configs/lookup/graft_lora.yaml: only adapters train (frozen bases), and the mechanism shows as with
    full fine-tuning; its checkpoints hold the adapters, a fraction of the model's bytes."""
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    graft, grpo = _run(tmp_path_factory, "lora_graft"), _run(tmp_path_factory, "lora_grpo")
    g, c = graft[("A", FAMILY)], grpo[("A", FAMILY)]
    assert g["val_before"] == c["val_before"] < 0.01
    assert c["val_after"] <= c["val_before"] + STAY and c["grafted"] == 0
    assert g["grafted"] >= 100 and g["admitted_frac"] > 0.5
    assert g["val_after"] >= g["val_before"] + RISE
    best = graft["run_dir"] / "best" / "A"
    adapter = (best / "adapter_model.safetensors").stat().st_size
    assert not (best / "model.safetensors").exists()
    assert adapter < 0.25 * (shipped_root("lookup") / "model_a" / "model.safetensors").stat().st_size
