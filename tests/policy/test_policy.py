"""Policy unit: formatting, generation log-probs, re-tokenised scoring, updates, checkpoints, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from graft_rl.algo import compatibility_score, mean_token_logprob, policy_loss
from graft_rl.policy import (
    Policy,
    PolicyConfig,
    PolicyError,
    PromptTooLongError,
    SamplingParams,
    TokenBatch,
    auto_micro_batch_tokens,
    sampling_logprobs,
    token_logprobs_from_logits,
)

PROMPTS = [("p1", "What is 2+3?"), ("p2", "Q: 6*7=?")]


@pytest.fixture(scope="module")
def pol_a(tiny_pair):
    return Policy(PolicyConfig("A", str(tiny_pair[0])))


@pytest.fixture(scope="module")
def pol_b(tiny_pair):
    return Policy(PolicyConfig("B", str(tiny_pair[1])))


def test_chat_template_and_plain_formatting(pol_a, pol_b):
    a = pol_a.format_prompt("What is 2+3?")
    assert pol_a.use_chat and a.startswith("<|im_start|>user\nWhat is 2+3?\nLet's think step by step")
    assert a.endswith("<|im_start|>assistant\n")
    b = pol_b.format_prompt("What is 2+3?")
    assert not pol_b.use_chat
    assert b == "What is 2+3?\nLet's think step by step and output the final answer within \\boxed{}.\n"


def test_generation_logprobs_round_trip_at_temperature_one(pol_a, pol_b):
    """Scoring a policy's own response reproduces its generation log-probs (fp32, T=1, top-p 1)."""
    for pol in (pol_a, pol_b):
        groups = pol.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=24), seed=3)
        assert [g.n for g in groups] == [4, 4] and all(g.policy == pol.name for g in groups)
        lp, mask = pol.token_logprobs(pol.encode_own(groups))
        gen = [x for g in groups for x in g.gen_logprobs]
        for i, row in enumerate(gen):
            assert mask[i].sum().item() == len(row)
            assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-4)


def test_generation_is_reproducible_from_seed(pol_a):
    g1 = pol_a.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10), seed=7)
    g2 = pol_a.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10), seed=7)
    g3 = pol_a.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10), seed=8)
    assert [g.token_ids for g in g1] == [g.token_ids for g in g2]
    assert [g.token_ids for g in g1] != [g.token_ids for g in g3]


def test_finished_rows_leave_the_decode_batch_without_changing_any_row(monkeypatch):
    """Compaction of finished rows (and their KV cache): greedy outputs equal the uncompacted ones,
    and sampled responses' generation log-probs equal a full forward pass's."""
    from graft_rl.data import load_dataset
    from graft_rl.testbed import PLAIN_TEMPLATE

    pol = Policy(
        PolicyConfig("T", "zoo:transfer-a", prompt_format="plain", plain_template=PLAIN_TEMPLATE, prompt_suffix=None)
    )
    prompts = [(p.id, p.problem) for p in load_dataset("transfer_heldout")[:12]]
    selects = []
    cache_cls = type(pol.model(torch.tensor([[1, 2]]), use_cache=True).past_key_values)
    real_select = cache_cls.batch_select_indices
    monkeypatch.setattr(
        cache_cls, "batch_select_indices", lambda self, idx: selects.append(len(idx)) or real_select(self, idx)
    )
    greedy = SamplingParams(n=2, max_new_tokens=40, top_k=1)
    out = {}
    for compact in (True, False):
        pol.backend.compact = compact
        out[compact] = pol.generate(prompts, greedy, seed=0)
    assert selects  # rows did leave the batch
    assert [g.token_ids for g in out[True]] == [g.token_ids for g in out[False]]
    for a, b in zip(out[True], out[False], strict=True):
        assert torch.allclose(torch.tensor(sum(a.gen_logprobs, [])), torch.tensor(sum(b.gen_logprobs, [])), atol=1e-5)
    pol.backend.compact = True
    groups = pol.generate(prompts, SamplingParams(n=4, max_new_tokens=40), seed=1)
    assert "stop" in {r for g in groups for r in g.finish_reasons}
    batch = pol.encode_own(groups)
    scored, mask = pol.token_logprobs(batch)
    gen = torch.zeros_like(scored)
    for i, lps in enumerate(lp for g in groups for lp in g.gen_logprobs):
        gen[i, : len(lps)] = torch.tensor(lps)
    assert torch.allclose(gen * mask, scored * mask, atol=1e-4)


def test_truncated_responses_are_flagged(pol_b):
    groups = pol_b.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=3), seed=0)
    for g in groups:
        for ids, reason in zip(g.token_ids, g.finish_reasons, strict=True):
            assert reason in ("stop", "length")
            if reason == "length":
                assert len(ids) == 3 and pol_b.tokenizer.eos_token_id not in ids
        assert g.truncated == [r == "length" for r in g.finish_reasons]


def test_cross_tokenizer_scoring(pol_a, pol_b):
    texts = ["3+4=7. \\boxed{7}", "6*7=42, so \\boxed{42}", "\\frac{1}{2}"]
    problems = ["Q: 3+4=?", "Q: 6*7=?", "Q: half?"]
    batch_b = pol_b.encode_texts(problems, texts, [True, True, False])
    # B re-tokenises the text with its own BPE (fewer tokens than A's bytes) and adds EOS when finished
    for text, ids, done in zip(texts, batch_b.response_ids, [True, True, False], strict=True):
        own = pol_b.tokenizer(text, add_special_tokens=False).input_ids
        assert ids == (own + [pol_b.tokenizer.eos_token_id] if done else own)
    batch_a = pol_a.encode_texts(problems, texts, [True, True, False])
    assert batch_a.response_ids[2] == list(pol_a.tokenizer("\\frac{1}{2}", add_special_tokens=False).input_ids)
    assert len(batch_a.response_ids[0]) > len(batch_b.response_ids[0])
    lp_b, m_b = pol_b.token_logprobs(batch_b)
    lp_a, m_a = pol_a.token_logprobs(batch_a)
    s = compatibility_score(mean_token_logprob(lp_b, m_b), mean_token_logprob(lp_a, m_a))
    assert s.shape == (3,) and torch.isfinite(s).all() and (s > 0).all()
    # the receiver's prompt is its own formatting, not the source's
    assert batch_b.prompt_ids[0] == pol_b.prompt_token_ids("Q: 3+4=?")


def test_scoring_is_independent_of_micro_batching(tiny_pair, pol_b):
    small = Policy(PolicyConfig("B2", str(tiny_pair[1]), micro_batch_tokens=40, logprob_chunk=7))
    texts = ["a" * n for n in (1, 5, 17, 30)]
    lp1, m1 = pol_b.text_logprobs(["q"] * 4, texts)
    lp2, m2 = small.text_logprobs(["q"] * 4, texts)
    assert torch.equal(m1, m2) and torch.allclose(lp1, lp2, atol=1e-5)


@pytest.mark.parametrize("which", ["A", "B"])
def test_scoring_prompts_of_different_lengths_matches_full_forward(which, pol_a, pol_b):
    """Only response positions' logits are computed (logits_to_keep); the result equals the naive full pass."""
    pol = pol_a if which == "A" else pol_b
    problems = ["1+1=?", "a much longer question about 12*13+7 with words=?", "19-4=?"]
    batch = pol.encode_texts(problems, ["2. \\boxed{2}", "163", "5, so \\boxed{5}"], [True, False, True])
    assert len({len(p) for p in batch.prompt_ids}) == 3
    lp, mask = pol.token_logprobs(batch)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True)):
            ids = torch.tensor([p + r])
            ref = pol.model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            ref = ref[len(p) - 1 :]
            assert torch.allclose(lp[i, : len(r)], ref, atol=1e-5)
            assert mask[i, : len(r)].all() and not mask[i, len(r) :].any()


def test_automatic_micro_batch_budget_follows_the_vocabulary(pol_a):
    assert auto_micro_batch_tokens(38) == 16384
    assert auto_micro_batch_tokens(49152) == 5461
    assert auto_micro_batch_tokens(262144) == 1024
    assert auto_micro_batch_tokens(10**9) == 512
    assert pol_a.micro_batch_tokens == 16384
    # the chunked LM head by default only where a micro-batch's logits would be large
    from graft_rl.policy.config import uses_fused_head

    assert not pol_a.fused_head and not uses_fused_head(None, 259, 16384)
    assert uses_fused_head(None, 49152, 5461) and uses_fused_head(None, 262144, 1024)
    assert uses_fused_head(True, 38, 512) and not uses_fused_head(False, 262144, 1024)
    with pytest.raises(PolicyError, match="micro_batch_tokens"):
        PolicyConfig("X", "m", micro_batch_tokens=0)


def test_identical_prompts_in_one_call_get_independent_groups(pol_a, pol_b):
    """Issue 22: no two prompts of a call share a random stream (two copies of one prompt get different
    groups), and the call reproduces from its seed."""
    same = [("x1", "What is 2+3?"), ("x2", "What is 2+3?")]
    for pol in (pol_a, pol_b):
        g = pol.generate(same, SamplingParams(n=4, max_new_tokens=12), seed=11)
        assert g[0].token_ids != g[1].token_ids
        again = pol.generate(same, SamplingParams(n=4, max_new_tokens=12), seed=11)
        assert [x.token_ids for x in again] == [x.token_ids for x in g]


def test_automatic_generation_batch_follows_the_kv_cache(pol_a, pol_b, monkeypatch):
    """gen_batch_size null: rows per generate call from the model's KV-cache size and a memory budget."""
    from graft_rl.policy import hf_backend as rollout  # where the hf backend reads its budget

    for pol in (pol_a, pol_b):  # llama (num_key_value_heads, head_dim) and gpt2 (n_layer, n_head, n_embd)
        cfg = pol.model.config
        layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
        hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
        assert rollout.kv_bytes_per_token(pol.model) == 2 * layers * hidden * 4  # fp32, no grouped KV heads
        assert rollout.auto_gen_batch_rows(pol.model, 256, 48, 300) == 256  # a testbed step: all rows at once
        per_row = 100 * rollout.kv_bytes_per_token(pol.model) + 12 * 300
        assert rollout.auto_gen_batch_rows(pol.model, 256, 100, 300, budget=10 * per_row) == 10
        assert rollout.auto_gen_batch_rows(pol.model, 256, 100, 300, budget=1) == 1
    with pytest.raises(PolicyError, match="gen_batch_size"):
        PolicyConfig("X", "m", gen_batch_size=0)
    # the batch size changes how rows share the sampler's random stream, never the rows' count or order
    calls = []
    real = pol_a.backend._generate_batch
    monkeypatch.setattr(pol_a.backend, "_generate_batch", lambda rows, *a: calls.append(len(rows)) or real(rows, *a))
    monkeypatch.setattr(rollout, "GEN_MEMORY_BUDGET_BYTES", 1)
    groups = pol_a.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=4), seed=0)
    assert calls == [1] * 6 and [g.n for g in groups] == [3, 3]


def test_chunked_token_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=g)
    tgt = torch.randint(0, 50, (3, 11), generator=g)
    ref = logits.log_softmax(-1).gather(-1, tgt[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs_from_logits(logits, tgt, chunk=4), ref, atol=1e-6)


def test_sampling_logprobs_temperature_top_p_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(sampling_logprobs(logits).exp(), torch.tensor([[0.5, 0.3, 0.15, 0.05]]), atol=1e-6)
    p = sampling_logprobs(logits, top_p=0.8).exp()  # keeps {0.5, 0.3}: mass 0.8 reached
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = sampling_logprobs(logits, top_p=0.81).exp()
    assert (p[0, :3] > 0).all() and p[0, 3] == 0
    p = sampling_logprobs(logits, top_k=1).exp()
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    t = sampling_logprobs(logits, temperature=2.0).exp()
    ref = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).sqrt()
    assert torch.allclose(t, ref / ref.sum(), atol=1e-6)


def _token_mean_loss_fn(old, adv, mb_tokens):
    def fn(lp, mask, rows):
        T = lp.shape[1]
        loss, stats = policy_loss(lp, old[rows, :T].to(lp.device), adv[rows], mask)
        return loss * mask.sum() / mb_tokens, stats

    return fn


def test_update_with_micro_batches_equals_one_big_batch(tiny_pair):
    texts = ["3+4=7. \\boxed{7}", "no", "6*7=42 \\boxed{42}", "x"]
    results = []
    for budget in (10_000, 60):
        torch.manual_seed(0)
        pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=1e-2, micro_batch_tokens=budget))
        batch = pol.encode_texts(["Q"] * 4, texts, [True] * 4)
        old, mask = pol.token_logprobs(batch)
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        stats = pol.update(batch, _token_mean_loss_fn(old, adv, mask.sum()))
        assert stats["skipped"] == 0 and math.isfinite(stats["grad_norm"])
        new, _ = pol.token_logprobs(batch)
        results.append((stats["loss"], new))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def test_update_moves_logprobs_in_the_advantage_direction(tiny_pair):
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=3e-3))
    batch = pol.encode_texts(["Q", "Q"], ["good \\boxed{1}", "bad \\boxed{2}"], [True, True])
    old, mask = pol.token_logprobs(batch)
    adv = torch.tensor([1.0, -1.0])
    for _ in range(3):
        pol.update(batch, _token_mean_loss_fn(old, adv, mask.sum()))
    new, _ = pol.token_logprobs(batch)
    d = mean_token_logprob(new, mask) - mean_token_logprob(old, mask)
    assert d[0] > 0 > d[1]


def test_nan_loss_skips_the_update(tiny_pair):
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=1e-2))
    before = [p.detach().clone() for p in pol.model.parameters()]
    batch = pol.encode_texts(["Q"], ["abc"], [True])
    stats = pol.update(batch, lambda lp, mask, rows: ((lp * float("nan")).sum(), {}))
    assert stats["skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, pol.model.parameters(), strict=True))


def test_save_and_load_round_trip(tiny_pair, tmp_path):
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=1e-2))
    batch = pol.encode_texts(["Q"], ["abc \\boxed{3}"], [True])
    old, mask = pol.token_logprobs(batch)
    pol.update(batch, _token_mean_loss_fn(old, torch.tensor([1.0]), mask.sum()))
    pol.save(tmp_path / "ckpt")
    again = Policy(PolicyConfig("A", str(tmp_path / "ckpt"), lr=1e-2))
    again.load_state(tmp_path / "ckpt")
    assert torch.allclose(pol.token_logprobs(batch)[0], again.token_logprobs(batch)[0], atol=1e-6)
    s1, s2 = pol.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    # the checkpoint is a plain transformers directory
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt") is not None


def test_missing_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(PolicyError, match=r"policy 'X': model path '.*nope' does not exist"):
        Policy(PolicyConfig("X", str(tmp_path / "nope")))


def test_gguf_without_tokenizer_is_one_clear_error(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(PolicyError, match=r"policy 'G': no usable tokenizer at .* \(gguf_file=model.gguf\)"):
        Policy(PolicyConfig("G", str(f)))


def test_prompt_longer_than_limit_is_one_clear_error(tiny_pair):
    pol = Policy(PolicyConfig("B", str(tiny_pair[1]), max_prompt_tokens=16))
    with pytest.raises(PromptTooLongError, match=r"prompt 'long-1' has \d+ tokens, over max_prompt_tokens=16"):
        pol.generate([("long-1", "word " * 50)], SamplingParams(n=1, max_new_tokens=2))


def test_chat_format_without_template_is_rejected(tiny_pair):
    with pytest.raises(PolicyError, match="has no chat template"):
        Policy(PolicyConfig("B", str(tiny_pair[1]), prompt_format="chat"))


def test_bad_config_values():
    with pytest.raises(PolicyError, match="dtype must be"):
        PolicyConfig("X", "m", dtype="int8")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_token_batch_mask():
    b = TokenBatch([[1], [1, 2]], [[5, 6, 7], [8]])
    assert b.response_mask().tolist() == [[1, 1, 1], [1, 0, 0]] and b.num_tokens() == 4


def test_bfloat16_policy_scores(tiny_pair):
    pol = Policy(PolicyConfig("A16", str(tiny_pair[0]), dtype="bfloat16"))
    lp, mask = pol.text_logprobs(["Q"], ["hello \\boxed{1}"])
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all() and mask.sum() > 0


def test_stop_strings_end_responses_like_eos_and_peer_texts_with_them(tiny_pair):
    """``stop``: a base model under a few-shot prompt would go on to the next example (and its boxed
    answer would be read as the response's); a stop string ends the response where its text appears,
    however it was tokenised (here "\n\n" is two tokens of the byte-level tokenizer)."""
    from graft_rl.policy import Policy, PolicyConfig, SamplingParams

    plain = dict(name="A", model=str(tiny_pair[0]), prompt_format="plain", plain_template="Q: {prompt}\nA:")
    base = Policy(PolicyConfig(**plain))
    sp = SamplingParams(n=32, max_new_tokens=40)
    free = base.generate([("q", "1+1=?")], sp, seed=3)[0]
    stop = "a"  # frequent enough for a random byte-level model
    assert sum(stop in t[:-1] for t in free.texts) > 0
    pol = Policy(PolicyConfig(**plain, stop=[stop]))
    got = pol.generate([("q", "1+1=?")], sp, seed=3)[0]
    for text, ids, fin in zip(got.texts, got.token_ids, got.finish_reasons, strict=True):
        assert stop not in text[:-1]  # nothing after the first stop string
        assert (fin == "stop") == (text.endswith(stop) or ids[-1] in pol.eos_token_ids)  # stopped there (or at EOS)
    assert sum(t.endswith(stop) for t in got.texts) > 0
    two = Policy(PolicyConfig(**plain, stop=["\n\n"]))
    assert len(two.tokenizer("\n\n", add_special_tokens=False).input_ids) == 2
    for text in two.generate([("q", "1+1=?")], SamplingParams(n=32, max_new_tokens=60), seed=5)[0].texts:
        assert "\n\n" not in text[:-2]
    # a finished peer text ends as this policy's own responses do: with its stop string, once
    end = two.tokenizer("\n\n", add_special_tokens=False).input_ids
    batch = two.encode_texts(["1+1=?", "1+1=?"], ["2", "2\n\n"], [True, True])
    assert batch.response_ids[0][-2:] == end and batch.response_ids[1] == batch.response_ids[0]


def test_a_stop_string_given_as_text_stays_whole():
    """YAML `stop: "\\n\\n"` or the override policies.0.stop=", " is one stop string, not a
    comma-split list of names (which would silently drop it); an empty string is an error."""
    from graft_rl.engine.config import ConfigError, load_config

    base = {"policies": [{"name": "A", "model": "x", "stop": "\n\n"}], "method": {"name": "grpo"}}
    assert load_config(base).policies[0].stop == ["\n\n"]
    assert load_config(base, ["policies.0.stop=a, b"]).policies[0].stop == ["a, b"]
    with pytest.raises(ConfigError, match="stop must be a list of non-empty strings"):
        load_config(base, ['policies.0.stop=[""]'])


def test_peer_responses_are_cut_at_the_receivers_max_new_tokens_and_lose_their_eos(tiny_pair):
    """A peer's text can be more tokens in the receiver's tokenizer than the receiver's own budget;
    it is cut there (counted in ``cut``), and a cut response is a truncated one: no EOS."""
    from graft_rl.policy import Policy, PolicyConfig

    pol = Policy(PolicyConfig(name="A", model=str(tiny_pair[0])))  # byte-level: one token per character
    eos = pol.end_token_ids()[0]
    texts = ["x" * 40 + " \\boxed{1}", "short \\boxed{2}", "y" * 40]
    full = pol.encode_texts(["Q"] * 3, texts, [True, True, False])
    assert full.cut == [] and full.response_ids[0][-1] == eos and full.response_ids[1][-1] == eos
    capped = pol.encode_texts(["Q"] * 3, texts, [True, True, False], max_tokens=20)
    assert capped.cut == [0, 2]
    assert [len(r) for r in capped.response_ids] == [20, len(full.response_ids[1]), 20]
    assert capped.response_ids[0] == full.response_ids[0][:20] and eos not in capped.response_ids[0]
    assert capped.response_ids[1] == full.response_ids[1]  # fits: unchanged, EOS kept


def test_peer_responses_never_run_past_the_receivers_context(tmp_path):
    from graft_rl.policy import Policy, PolicyConfig
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model

    model = build_tiny_model(tmp_path / "gpt2_48", "gpt2", bpe_tokenizer(), max_positions=48)
    pol = Policy(PolicyConfig(name="B", model=str(model)))
    batch = pol.encode_texts(["1+1=?"], ["two " * 60 + "\\boxed{2}"], [True], max_tokens=4096)
    assert batch.cut == [0] and batch.lengths()[0] == 48
    pol.token_logprobs(batch)  # a learned-position model indexes out of its table past 48
