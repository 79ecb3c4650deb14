"""Where a tied alias lands in vLLM, per architecture (issue 62), on vLLM's CPU build: every model the
package supports in vLLM ties its head to the embedding's *parameter* (one storage: found in the engine
by storage, not assumed), so the embedding's digest covers it; what enters under the alias is checked at
the engine's door. GPT-2's ``Conv1D`` weights, which vLLM holds transposed, are digested by column. For
each: a push that leaves the alias out, or zeroes it, is refused; a full push then samples what the
trainer scores. Llama is ``test_vllm_backend.py``'s (its module engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
vllm = pytest.importorskip("vllm")

from graft_rl.policy import Policy, PolicyConfig, SamplingParams  # noqa: E402
from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model, char_tokenizer  # noqa: E402
from graft_rl.policy.vllm_backend import VLLMEngineError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from push_faults import FAULTS  # noqa: E402

#: architecture -> (the engine tensor the tied head shares, engine tensors digested by column)
ARCHS = {
    "qwen2": ("model.embed_tokens.weight", 0),
    "qwen3": ("model.embed_tokens.weight", 0),
    "gemma3_text": ("model.embed_tokens.weight", 0),
    "smollm3": ("model.embed_tokens.weight", 0),  # vLLM's Transformers backend
    "gpt2": ("transformer.wte.weight", 8),  # c_attn, attn.c_proj, c_fc, mlp.c_proj of 2 layers
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_tied_alias_left_out_or_zeroed_is_refused_and_a_full_push_works(arch, tmp_path):
    tok = bpe_tokenizer() if arch == "gpt2" else char_tokenizer()
    d = build_tiny_model(tmp_path / arch, arch, tok, hidden=128, heads=2, seed=0)
    kw = {"max_model_len": 256, "enforce_eager": True}  # eager: no compile warm-up (a faster start)
    pol = Policy(PolicyConfig("A", str(d), backend="vllm", device="cpu", vllm_kwargs=kw))
    try:
        b = pol.backend
        shared, columns = ARCHS[arch]
        assert b.layout.aliases == {"lm_head.weight": shared} and not b.layout.unplaced
        assert len(b.layout.columns) == columns
        stream = b.weights_fn
        for key in ("the tied alias left out", "the tied alias zeroed", None):
            with torch.no_grad():  # an update that moves every weight
                for p in pol.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            pol.weights_version += 1
            if key is None:  # the full push: verified, and the engine samples what the trainer scores
                b.weights_fn = stream
                groups = pol.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=8), seed=0)
                lp, _ = pol.token_logprobs(pol.encode_own(groups))
                gen = torch.tensor(groups[0].gen_logprobs[0])
                assert torch.allclose(lp[0, : len(gen)], gen, atol=1e-4)
                continue
            fault, name = FAULTS[key]
            b.weights_fn = lambda *a, fault=fault: fault(stream(*a))
            with pytest.raises(VLLMEngineError, match=name):
                pol.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=4), seed=0)
    finally:
        pol.close()
