"""Tiny heterogeneous models for tests and the CPU testbed, built locally (no hub access).

Two families that differ the way the paper's pairs do: architecture (Llama-like vs
GPT-2-like), tokenizer (byte-level "character" vocabulary vs a small trained BPE), and
prompt formatting (a ChatML chat template vs plain text). Saved with ``save_pretrained``,
so every loader (transformers, vLLM) reads them as ordinary model directories.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["CHATML_TEMPLATE", "char_tokenizer", "bpe_tokenizer", "build_tiny_model", "build_tiny_pair", "SAMPLE_CORPUS"]

#: A minimal ChatML template (the format SmolLM2 and Qwen use).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SAMPLE_CORPUS = [
    "Q: 3+4=?\nA: 3+4=7. \\boxed{7}",
    "Q: 12-5=?\nA: 12-5=7. \\boxed{7}",
    "Q: 6*7=?\nA: 6*7=42. \\boxed{42}",
    "What is 2+3?\nLet's think step by step and output the final answer within \\boxed{}.",
    "The answer is \\frac{1}{2}, so \\boxed{\\frac{1}{2}}.",
    "Let x be the number of apples. Then x + 5 = 12, so x = 7.",
]


def _wrap(tok_obj, specials: dict[str, str], chat_template: str | None):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tok_obj, **specials)
    if chat_template:
        tok.chat_template = chat_template
    return tok


def char_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """Byte-level tokenizer without merges: one token per byte (ASCII text: one per character).

    Specials: ``<|endoftext|>`` (EOS and pad), ``<|im_start|>``, ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    return _wrap(tk, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, chat_template)


def bpe_tokenizer(corpus: Iterable[str] = SAMPLE_CORPUS, vocab_size: int = 400, chat_template: str | None = None):
    """Byte-level BPE with GPT-2's pre-tokenisation regex, trained on ``corpus`` (deterministic).

    Specials: ``<|endoftext|>`` (EOS and pad). No chat template by default (plain prompts).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(list(corpus), trainer=trainer)
    return _wrap(tk, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, chat_template)


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    tokenizer=None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 512,
    seed: int = 0,
    *,
    intermediate: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Build, randomly initialise (from ``seed``) and ``save_pretrained`` a small causal LM with a local
    tokenizer: the one toy-model builder of the package (tests, the testbed, ``graft preflight``'s
    stand-ins, ``scripts/gpu_check.py``'s Qwen3-shaped model). Nothing is fetched from a hub.

    ``arch``: ``llama`` (RoPE, RMSNorm, SwiGLU), ``gpt2`` (learned positions, LayerNorm, GELU), or any
    other transformers model type (``qwen3``, ``gemma3_text``, ``smollm3``, ...) built from its config
    class with the shape given. ``intermediate`` (MLP size; default ``2 * hidden``), ``kv_heads``
    (default ``heads``), ``head_dim`` (default ``hidden // heads``) and ``vocab_size`` (default the
    tokenizer's; larger for an embedding of a real model's size) shape it further; the embeddings are tied.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig

    tok = tokenizer if tokenizer is not None else (char_tokenizer() if arch == "llama" else bpe_tokenizer())
    ids = dict(
        vocab_size=vocab_size or len(tok),
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    shape = dict(
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **ids,
    )
    if head_dim is not None:
        shape["head_dim"] = head_dim
    if arch == "llama":
        cfg = LlamaConfig(**shape)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **ids)
    else:
        try:
            cfg = AutoConfig.for_model(arch, **shape)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"build_tiny_model: transformers cannot build a {arch!r} model offline: {exc}") from None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_pair(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Two tiny models that differ in architecture, tokenizer and formatting: ``(llama_char, gpt2_bpe)``."""
    root = Path(root)
    a = build_tiny_model(root / "llama_char", "llama", char_tokenizer(), seed=seed)
    b = build_tiny_model(root / "gpt2_bpe", "gpt2", bpe_tokenizer(), seed=seed + 1)
    return a, b
