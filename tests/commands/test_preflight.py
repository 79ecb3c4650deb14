"""`graft preflight` (issue 21): a config's own code path at toy size on this machine, stage by stage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from graft_rl.commands.cli import main
from graft_rl.commands.preflight import STAGES, pattern_rewards, run_preflight, toy_config
from graft_rl.engine.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs" / "paper" / "pair1"


def _stages(result) -> dict[str, dict]:
    return {s["name"]: s for s in result["stages"]}


def test_toy_config_keeps_what_the_config_decides(tmp_path):
    cfg = load_config(PAPER / "hacpo.yaml", ["ray.resources={SmolLM3-3B-Base: {resources: {node_a: 1}}}"])
    toy = toy_config(cfg, tmp_path / "run", tmp_path)
    t = toy.cfg
    assert (t.method.name, t.method.kl_coef, t.execution, t.n) == ("hacpo", cfg.method.kl_coef, "ray", cfg.n)
    assert [pc.world_size for pc in t.policies] == [2, 2]
    assert all(pc.dtype == "bfloat16" and pc.gradient_checkpointing for pc in t.policies)
    assert all(pc.fused_logprobs for pc in t.policies)  # the real vocabularies take the chunked head
    vllm = importlib.util.find_spec("vllm") is not None
    assert all(pc.backend == ("vllm" if vllm else "hf") for pc in t.policies)
    assert t.prompt_batch == 4 and t.minibatch == 1 and t.max_new_tokens == 16  # HACPO's 32/128 ratio kept: 4 updates
    assert toy.ray_resources == {"node_a": 1.0} and t.ray.resources == cfg.ray.resources
    assert "toy smollm3" in toy.families["SmolLM3-3B-Base"] and "toy qwen3" in toy.families["Qwen3-1.7B-Base"]
    import torch

    if not torch.cuda.is_available():
        assert all(pc.device == "cpu" for pc in t.policies) and t.ray.num_gpus == 0
        assert any("CPU process" in n for n in toy.notes)


def test_reward_pattern_has_both_directions_in_any_batch():
    for batch in (2, 3, 4, 128):
        a = [pattern_rewards(i, 0, 8) for i in range(batch)]
        b = [pattern_rewards(i, 1, 8) for i in range(batch)]
        a_to_b = sum(1 for x, y in zip(a, b, strict=True) if sum(y) == 0 and 0 < sum(x) < 8)
        b_to_a = sum(1 for x, y in zip(a, b, strict=True) if sum(x) == 0 and 0 < sum(y) < 8)
        assert a_to_b >= 1 and b_to_a >= 1


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["graft.yaml", "graft_stored_Qwen3-1.7B-Base.yaml"])
def test_paper_preset_passes_every_stage(preset):
    """The paper preset (Ray, FSDP2 over 2 ranks per policy, vLLM, bf16) rehearsed on this CPU;
    the stored-trajectory row replays a toy peer run made first."""
    pytest.importorskip("ray")
    result = run_preflight(str(PAPER / preset), show=False)
    st = _stages(result)
    assert list(st) == list(STAGES)
    bad = {k: v["detail"] for k, v in st.items() if v["status"] not in ("ok", "n/a")}
    assert result["ok"] and not bad, bad
    assert st["exchange"]["status"] == "ok" and "received" in st["exchange"]["detail"]
    assert st["weight push"]["status"] == "ok" and st["resume"]["detail"] == "from checkpoint step 2 to step 3"
    assert "4 replica(s)" in st["graft eval"]["detail"] or "stored" in preset  # the run's 4 devices
    assert (st["peer records"]["status"] == "ok") == ("stored" in preset)
    assert "| SmolLM3-3B-Base |" in result["plan"] or "| Qwen3-1.7B-Base |" in result["plan"]


def test_a_failing_stage_is_one_line_and_stops_the_rest(monkeypatch, capsys):
    from graft_rl.engine.trainer import Trainer

    def broken(self, step, stop=None):
        raise RuntimeError("the step broke\nsecond line")

    monkeypatch.setattr(Trainer, "step", broken)
    assert main(["preflight", str(ROOT / "configs" / "testbed" / "graft.yaml")]) == 1
    out = capsys.readouterr().out
    assert "| generate | FAIL |" in out and "RuntimeError: the step broke |" in out
    assert "| update | not reached |" in out and "preflight FAILED" in out


def test_bad_config_is_one_line(capsys, tmp_path):
    assert main(["preflight", str(tmp_path / "nope.yaml")]) == 1
    assert "| config | FAIL |" in capsys.readouterr().out
