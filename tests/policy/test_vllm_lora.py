"""A LoRA policy under the vLLM backend (CPU build here): the engine loads the base and is pushed the
merged weights (W + alpha/r B A, policy.lora.MergedState) through the verified push; its samples' log-probs
are the adapted trainer's, after updates and when an adapter checkpoint is loaded back (graft eval)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
vllm = pytest.importorskip("vllm")
pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

from graft_rl.algo import policy_loss  # noqa: E402
from graft_rl.policy import Policy, PolicyConfig, SamplingParams  # noqa: E402
from graft_rl.policy.tiny import build_tiny_model, char_tokenizer  # noqa: E402

PROMPTS = [("p1", "What is 2+3?"), ("p2", "6*7?")]


def _config(model: str) -> PolicyConfig:
    kwargs = {"max_model_len": 512}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return PolicyConfig(
        "A", model, backend="vllm", device=device, vllm_kwargs=kwargs, lr=5e-2, lora={"r": 4, "alpha": 16}
    )


def _engine_matches_trainer(pol) -> None:
    groups = pol.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=24), seed=0)
    lp, mask = pol.token_logprobs(pol.encode_own(groups))
    for i, row in enumerate(x for g in groups for x in g.gen_logprobs):
        assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-4)


def test_a_lora_policy_samples_from_its_merged_weights_and_its_adapter_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per CPU engine: two engines after others in this process
    d = build_tiny_model(tmp_path / "llama", "llama", char_tokenizer(), hidden=128, heads=2, seed=0)
    pol = Policy(_config(str(d)))
    _engine_matches_trainer(pol)  # fresh adapters (B = 0): the base itself
    batch = pol.encode_texts(["Q"] * 2, ["3+4=7 \\boxed{7}", "no"], [True, True])
    old, _ = pol.token_logprobs(batch)
    adv = torch.tensor([1.0, -1.0])
    for _ in range(3):
        stats = pol.update(batch, lambda lp, m, rows: (policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], m)[0], {}))
        assert stats["skipped"] == 0
    moved = pol.token_logprobs(batch)[0]
    assert not torch.allclose(moved, old, atol=1e-3)
    _engine_matches_trainer(pol)  # the push merged the trained adapters
    ckpt = pol.save(tmp_path / "ckpt")
    pol.close()
    again = Policy(_config(str(ckpt)))  # graft eval / resume: the base from disk, the adapter pushed at start
    assert torch.equal(again.token_logprobs(batch)[0], moved)
    _engine_matches_trainer(again)
    again.close()
