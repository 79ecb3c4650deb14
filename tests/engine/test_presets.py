"""Every preset in configs/ is a valid config (keys, values, base chains), paper and testbed scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from graft_rl.engine.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))


def test_presets_exist_for_every_table_row():
    names = {p.stem for p in CONFIGS} | {"graft_stored" for p in CONFIGS if p.stem.startswith("graft_stored_")}
    for row in (
        "grpo_n8",
        "grpo_n16",
        "grpo_n32",
        "grpo_dynamic_sampling",
        "hacpo",
        "sgt",
        "graft",
        "graft_stored",
        "graft_no_gate",
        "graft_no_floor",
        "graft_no_balance",
        "graft_sequence_ratio",
        "graft_peer_first",
        "graft_random_prompts",
        "graft_random_admission",
        "graft_pooled",
        "graft_success_only",
        "luffy",
    ):
        assert row in names


@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if p.name != "base.yaml"], ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_preset_loads(path):
    cfg = load_config(path)
    assert cfg.policies and cfg.run_dir
    if "paper" in path.parts:
        # the paper's lr (Table 3); the LoRA presets' adapters take 10x it (not a paper row)
        lr = 1e-5 if path.stem.endswith("_lora") else 1e-6
        assert cfg.prompt_batch == 128 and cfg.minibatch in (32, 64) and cfg.policies[0].lr == lr
        assert all((pc.lora is not None) == path.stem.endswith("_lora") for pc in cfg.policies)
        assert cfg.method.eps_low == 0.2 and cfg.method.eps_high == 0.28
        assert cfg.method.delta == (float(path.stem.split("_")[-1]) if "delta" in path.stem else 0.8)
