"""Paper-scale numerics on tiny models (issue 11): fp32 master weights under bf16 compute,
gradient checkpointing, and log-probs that never build ``[tokens x vocab]`` logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graft_rl.policy import Policy, PolicyConfig, PolicyError
from graft_rl.policy.heads import chunked_head_logprobs

TEXTS = ["3+4=7. \\boxed{7}", "no idea", "6*7=42 so \\boxed{42}", "x y z"]
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])


def _loss_fn(old, adv, total_tokens):
    from graft_rl.algo import policy_loss

    def fn(lp, mask, rows):
        loss, st = policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], mask)
        return loss * (float(mask.sum()) / total_tokens), {}

    return fn


def _step(pol: Policy, steps: int = 1):
    batch = pol.encode_texts(["Q"] * 4, TEXTS, [True] * 4)
    old, mask = pol.token_logprobs(batch)
    for _ in range(steps):
        pol.update(batch, _loss_fn(old, ADV, float(mask.sum())))
    return batch, old, mask


def _grads(pol: Policy) -> torch.Tensor:
    """The flat gradient of one minibatch loss (not applied)."""
    batch = pol.encode_texts(["Q"] * 4, TEXTS, [True] * 4)
    old, mask = pol.token_logprobs(batch)
    pol.optimizer.zero_grad(set_to_none=True)
    if pol.config.gradient_checkpointing:
        pol.model.train()
    pol.accumulate(batch, _loss_fn(old, ADV, float(mask.sum())))
    pol.model.eval()
    g = torch.cat([p.grad.detach().float().flatten() for p in pol.model.parameters() if p.grad is not None])
    pol.optimizer.zero_grad(set_to_none=True)
    return g


def _touched(pol: Policy) -> list[torch.Tensor]:
    """Per parameter, the elements the batch gives a gradient (GPT-2's unused position rows get none)."""
    _grads(pol)
    batch = pol.encode_texts(["Q"] * 4, TEXTS, [True] * 4)
    old, mask = pol.token_logprobs(batch)
    pol.accumulate(batch, _loss_fn(old, ADV, float(mask.sum())))
    out = [p.grad != 0 if p.grad is not None else torch.zeros_like(p, dtype=torch.bool) for p in pol.model.parameters()]
    pol.optimizer.zero_grad(set_to_none=True)
    return out


def _changed_fraction(pol: Policy, before: list[torch.Tensor], touched: list[torch.Tensor]) -> float:
    """Fraction of the weights that received a gradient and changed value."""
    pairs = zip(pol.model.parameters(), before, touched, strict=True)
    changed = sum(int(((p.detach() != b) & t).sum()) for p, b, t in pairs)
    return changed / sum(int(t.sum()) for t in touched)


@pytest.mark.parametrize("arch", [0, 1])
def test_bf16_compute_keeps_fp32_master_weights_and_trains_at_lr_1e_6(tiny_pair, arch):
    """SPEC §2 Precision: dtype bfloat16 computes in bf16, but weights and AdamW state are fp32, so
    an lr 1e-6 step changes (almost) every weight; pure bf16 (opt-in) leaves most of them unchanged."""
    mixed = Policy(PolicyConfig("A", str(tiny_pair[arch]), dtype="bfloat16", lr=1e-6))
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    touched = _touched(mixed)
    assert sum(int(t.sum()) for t in touched) > 0.75 * sum(p.numel() for p in mixed.model.parameters())
    before = [p.detach().clone() for p in mixed.model.parameters()]
    _step(mixed, steps=3)
    assert all(s["exp_avg"].dtype == torch.float32 for s in mixed.optimizer.state.values())
    assert _changed_fraction(mixed, before, touched) >= 0.99

    pure = Policy(PolicyConfig("A", str(tiny_pair[arch]), dtype="bfloat16", master_dtype="bfloat16", lr=1e-6))
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())
    touched = _touched(pure)
    before = [p.detach().clone() for p in pure.model.parameters()]
    _step(pure, steps=3)
    assert _changed_fraction(pure, before, touched) < 0.5  # the failure mode the default avoids


def test_bf16_compute_loss_and_gradient_agree_with_fp32(tiny_pair):
    """bf16 autocast vs full fp32 on the same weights: log-probs within 0.05 nats, gradient
    direction within cosine 0.99 and norm within 5 %."""
    fp32 = Policy(PolicyConfig("A", str(tiny_pair[0])))
    bf16 = Policy(PolicyConfig("A", str(tiny_pair[0]), dtype="bfloat16"))
    batch = fp32.encode_texts(["Q"] * 4, TEXTS, [True] * 4)
    a, mask = fp32.token_logprobs(batch)
    b, _ = bf16.token_logprobs(batch)
    assert (a - b).abs().max() < 0.05
    ga, gb = _grads(fp32), _grads(bf16)
    assert torch.nn.functional.cosine_similarity(ga, gb, dim=0) > 0.99
    assert gb.norm() == pytest.approx(float(ga.norm()), rel=0.05)


def test_master_dtype_must_be_fp32_or_the_compute_dtype(tiny_pair):
    with pytest.raises(PolicyError, match="master_dtype"):
        PolicyConfig("A", str(tiny_pair[0]), dtype="float32", master_dtype="bfloat16")


@pytest.mark.parametrize("arch", [0, 1])
def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_pair, arch):
    plain = Policy(PolicyConfig("A", str(tiny_pair[arch])))
    ckpt = Policy(PolicyConfig("A", str(tiny_pair[arch]), gradient_checkpointing=True))
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.model.modules())
    batch = plain.encode_texts(["Q"] * 4, TEXTS, [True] * 4)
    assert torch.equal(plain.token_logprobs(batch)[0], ckpt.token_logprobs(batch)[0])
    torch.testing.assert_close(_grads(ckpt), _grads(plain), rtol=1e-5, atol=1e-7)
    assert not ckpt.model.training  # back in eval mode after the update


# ------------------------------------------------------------------ bounded log-prob memory
class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    """A tiny Llama with a 32k vocabulary: logits dominate memory as in real LMs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from graft_rl.policy.tiny import char_tokenizer

    tok = char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=32768,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("bigvocab")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_fused_logprobs_equal_the_naive_path_with_bounded_memory(big_vocab_model):
    """The chunked LM head reproduces the full-logits log-probs and gradients, and neither forward
    nor backward creates a tensor anywhere near ``tokens x vocab`` (largest: ``chunk x vocab``)."""
    chunk = 16
    fused = Policy(PolicyConfig("F", str(big_vocab_model), logprob_chunk=chunk, micro_batch_tokens=100_000))
    naive = Policy(PolicyConfig("N", str(big_vocab_model), fused_logprobs=False, micro_batch_tokens=100_000))
    assert fused.fused_head and not naive.fused_head
    texts = ["a much longer response " * 6, "short", "3+4=7 \\boxed{7}", "xyz " * 10]
    batch = fused.encode_texts(["Q"] * 4, texts, [True] * 4)
    V, tokens = 32768, sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True))
    assert tokens > 8 * chunk

    bound = max(chunk, 32) * V  # one chunk's logits, or the [V, hidden] head weight itself
    with _LargestTensor() as watch:
        lp_f, mask = fused.token_logprobs(batch)
    assert watch.largest <= bound
    with _LargestTensor() as watch:
        lp_n, _ = naive.token_logprobs(batch)
    assert watch.largest > 4 * bound  # what the naive path builds
    torch.testing.assert_close(lp_f, lp_n, rtol=0, atol=2e-5)

    naive.accumulate(batch, _loss_fn(lp_n, ADV, float(mask.sum())))
    with _LargestTensor() as watch:  # forward and backward
        fused.accumulate(batch, _loss_fn(lp_f, ADV, float(mask.sum())))
    assert watch.largest <= bound
    for a, b in zip(fused.model.parameters(), naive.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_chunked_head_matches_full_softmax_with_temperature():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    h = torch.randn(3, 7, 8)
    t = torch.randint(0, 50, (3, 7))
    full = (head(h) / 0.7).log_softmax(-1).gather(-1, t[..., None])[..., 0]
    torch.testing.assert_close(chunked_head_logprobs(h, head, t, chunk=4, temperature=0.7), full)


def test_models_that_transform_logits_after_the_head_fall_back_to_the_naive_path(tiny_pair, monkeypatch):
    """e.g. Gemma 2's final soft-capping: the self-check sees the mismatch and keeps full logits."""
    from transformers import LlamaForCausalLM

    orig = LlamaForCausalLM.forward

    def capped(self, *a, **kw):
        out = orig(self, *a, **kw)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0) * 3.0
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", capped)
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), fused_logprobs=True))  # asked for, refused by the self-check
    assert not pol.fused_head
