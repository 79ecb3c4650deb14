"""A policy's lagged generations (``rollout.lag``, graft_rl.policy.lag) with each engine: the hf backend
sampling from the live module, and vLLM (a fake with the real push path, verification included), each
with full weights and with LoRA adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from graft_rl.policy import Policy, PolicyConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm as fv  # noqa: E402

PROMPTS = [("p1", "What is 2+3?"), ("p2", "6*7?")]
SP = SamplingParams(n=3, max_new_tokens=6)
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def _update(pol: Policy) -> None:
    batch = pol.encode_texts(["Q", "Q"], ["3+4=7", "no"], [True, True])
    stats = pol.update(batch, lambda lp, mask, rows: (-(lp * mask).sum() / mask.sum(), {}))
    assert stats["skipped"] == 0


def _state(pol: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pol.model.named_parameters()}


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_hf_lagged_generation_samples_the_weights_before_the_update(tiny_pair, lora):
    if lora:
        pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=5e-2, lora=lora))
    first = pol.generate(PROMPTS, SP, seed=3, lag=1)
    _update(pol)
    live = _state(pol)
    stale = pol.generate(PROMPTS, SP, seed=3, lag=1)
    assert [g.texts for g in stale] == [g.texts for g in first]
    assert [g.gen_logprobs for g in stale] == [g.gen_logprobs for g in first]
    assert all(torch.equal(live[n], p) for n, p in pol.model.named_parameters())  # the live weights, exactly
    now = pol.generate(PROMPTS, SP, seed=3)  # an evaluation: the current weights
    assert [g.gen_logprobs for g in now] != [g.gen_logprobs for g in first]
    if lora:  # only the adapters are kept: the frozen base is never copied
        assert all(".lora_" in n for n in pol.lag.history[0])


@pytest.fixture
def fake_vllm(monkeypatch):
    return fv.install(monkeypatch)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_vllm_is_pushed_the_lagged_weights_and_verifies_them(fake_vllm, tiny_pair, lora):
    """The push and its trainer-side digest both read the snapshot (a mismatch would be refused), the
    engine then holds the weights of one push back, and the next unlagged generation pushes the live ones."""
    if lora:
        pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    fv.FakeLLM.source = None
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=5e-2, backend="vllm", lora=lora))
    try:
        engine = pol.backend.llm.engine_model
        pol.generate(PROMPTS, SP, seed=0, lag=1)  # observes the start weights (no push: the engine has them)

        def engine_matches() -> bool:
            state = pol.rollout_state()
            got = dict(engine.named_parameters())
            return all(torch.allclose(got[n], state[n].float(), atol=1e-6) for n in got if n in state)

        before = {n: t.detach().clone().float() for n, t in pol.rollout_state().items()}
        _update(pol)
        live = _state(pol)
        reloads = [c for c in pol.backend.llm.calls if c[0] == "reload"]
        pol.generate(PROMPTS, SP, seed=1, lag=1)
        assert len([c for c in pol.backend.llm.calls if c[0] == "reload"]) == len(reloads) + 1
        got = dict(engine.named_parameters())
        assert all(torch.allclose(got[n], before[n], atol=1e-6) for n in got if n in before)  # one push back
        assert all(torch.equal(live[n], p) for n, p in pol.model.named_parameters())
        assert not engine_matches()  # the live weights moved on
        pol.generate(PROMPTS, SP, seed=2)  # unlagged: the live weights are pushed (and verified)
        assert engine_matches()
    finally:
        pol.close()


def test_a_policy_at_lag_0_keeps_no_history_and_a_best_checkpoint_holds_none(tiny_pair, tmp_path):
    """A checkpoint written at lag 1 brings its history; a training generation at lag 0 drops it, so a
    checkpoint after it saves none (a later resume at lag > 0 warms up afresh instead of sampling stale
    weights); a validation generation (lag None) leaves it; ``save(lag=False)`` (best/) writes none."""
    from graft_rl.policy.lag import LAG_FILE

    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=5e-2))
    pol.generate(PROMPTS, SP, seed=3, lag=1)
    _update(pol)
    pol.generate(PROMPTS, SP, seed=3, lag=1)
    ckpt = pol.save(tmp_path / "lag1")
    assert (ckpt / LAG_FILE).is_file()
    assert not (pol.save(tmp_path / "best", lag=False) / LAG_FILE).exists()

    again = Policy(PolicyConfig("A", str(ckpt), lr=5e-2))
    again.load_state(ckpt)
    assert again.lag is not None and len(again.lag.history) == 2
    again.generate(PROMPTS, SP, seed=3)  # validation: the history stays
    assert again.lag is not None
    again.generate(PROMPTS, SP, seed=3, lag=0)  # a training generation at lag 0
    assert again.lag is None
    assert not (again.save(tmp_path / "lag0") / LAG_FILE).exists()


def test_the_lag_ramps_over_the_first_k_pushes():
    from graft_rl.policy.lag import RolloutLag

    lag, seen = RolloutLag(3), []
    for version in range(6):
        lag.observe([("w", torch.full((1,), float(version)))], version)
        i = lag.chosen()
        seen.append(0 if i is None else len(lag.history) - 1 - i)
    assert seen == [0, 1, 2, 3, 3, 3]
