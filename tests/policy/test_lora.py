"""LoRA policies (policy.lora): only adapters train, the merged weights equal the adapter's forward, the
KL reference is the base, adapter checkpoints resume exactly and refuse another base, bad settings."""

from __future__ import annotations

import json

import pytest
import torch

from graft_rl.algo import policy_loss
from graft_rl.policy import Policy, PolicyConfig, PolicyError, SamplingParams

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

from graft_rl.policy.lora import LoraSettings, MergedState, is_adapter_dir, merged_weight  # noqa: E402

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
TEXTS = ["3+4=7. \\boxed{7}", "no", "6*7=42 \\boxed{42}", "x"]


def _loss(old, adv, tokens):
    def fn(lp, mask, rows):
        loss, stats = policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], mask)
        return loss * mask.sum() / tokens, stats

    return fn


def _train(pol, steps: int = 2):
    batch = pol.encode_texts(["Q"] * len(TEXTS), TEXTS, [True] * len(TEXTS))
    old, mask = pol.token_logprobs(batch)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for _ in range(steps):
        stats = pol.update(batch, _loss(old, adv, mask.sum()))
        assert stats["skipped"] == 0
    return batch


@pytest.fixture(params=[0, 1], ids=["llama-chat", "gpt2-plain"])
def model_path(request, tiny_pair):
    return str(tiny_pair[request.param])


def test_an_update_changes_only_adapter_parameters(model_path):
    pol = Policy(PolicyConfig("A", model_path, lr=1e-2, lora=LORA))
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
    trainable = {n for n, p in pol.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in pol.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in pol.model.named_parameters() if n in trainable
    }
    batch = _train(pol)
    changed = {n for n, p in pol.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and changed <= trainable
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)
    # lora_B starts at zero: the policy starts as its base, and the KL reference stays the base
    base = Policy(PolicyConfig("A", model_path))
    ref, mask = pol.reference_logprobs(batch)
    assert torch.allclose(ref, base.token_logprobs(batch)[0], atol=1e-5)
    assert not torch.allclose(pol.token_logprobs(batch)[0] * mask, ref * mask, atol=1e-4)


def test_adapters_are_float32_masters_over_a_base_frozen_in_the_compute_dtype(tiny_pair):
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), dtype="bfloat16", lr=1e-2, lora=LORA))
    dtypes = {n: p.dtype for n, p in pol.model.named_parameters()}
    assert all(dt == torch.float32 for n, dt in dtypes.items() if ".lora_" in n)
    assert all(dt == torch.bfloat16 for n, dt in dtypes.items() if ".lora_" not in n)
    _train(pol, steps=1)
    state = pol.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_the_merged_weights_equal_the_adapters_forward(model_path, tmp_path):
    """What a vLLM engine is pushed (own names, W + (alpha/r) B A) loads into a plain model that scores
    as the adapted policy does; the merge leaves the trainer's weights untouched."""
    from transformers import AutoModelForCausalLM

    pol = Policy(PolicyConfig("A", model_path, lr=1e-2, lora=LORA))
    batch = _train(pol)
    raw = {n: t.clone() for n, t in pol.model.state_dict().items()}
    merged = pol.rollout_state()
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())
    missing = plain.load_state_dict({n: merged[n] for n in merged}, strict=True)
    assert not missing.missing_keys
    assert all(torch.equal(raw[n], t) for n, t in pol.model.state_dict().items())
    lp, mask = pol.token_logprobs(batch)
    want, _ = pol.token_logprobs(batch, plain.eval())
    assert torch.allclose(lp * mask, want * mask, atol=1e-5)
    assert pol.tied_names() <= set(merged)


def test_merged_weight_is_computed_in_float32_and_cast():
    w = torch.randn(6, 5).bfloat16()
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    got = merged_weight(w, a, b, 0.5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w.float() + 0.5 * (b @ a)).bfloat16())
    assert torch.equal(merged_weight(w.T.contiguous(), a, b, 0.5, transpose=True), got.T)


def test_the_hf_backend_samples_from_base_plus_adapter(tiny_pair):
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=5e-2, lora=LORA))
    _train(pol, steps=3)
    groups = pol.generate([("p1", "What is 2+3?")], SamplingParams(n=4, max_new_tokens=16), seed=3)
    lp, mask = pol.token_logprobs(pol.encode_own(groups))
    for i, row in enumerate(x for g in groups for x in g.gen_logprobs):
        assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-4)


def test_an_adapter_checkpoint_resumes_exactly(model_path, tmp_path):
    pol = Policy(PolicyConfig("A", model_path, lr=1e-2, lora=LORA))
    batch = _train(pol)
    out = pol.save(tmp_path / "ckpt")
    assert is_adapter_dir(out) and (out / "adapter_model.safetensors").is_file()
    assert not any(out.glob("model*.safetensors"))
    saved = json.loads((out / "graft_policy.json").read_text())
    assert saved["lora"]["r"] == 4 and len(saved["lora_base"]["digest"]) == 64
    again = Policy(PolicyConfig("A", str(out), lr=1e-2))  # the base comes from graft_policy.json
    again.load_state(out)
    assert again.config.lora == pol.config.lora and again.base == pol.base
    assert torch.equal(pol.token_logprobs(batch)[0], again.token_logprobs(batch)[0])
    _train(pol, steps=1)
    _train(again, steps=1)
    for (n, p), q in zip(pol.model.named_parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_saved_adapter_loads_with_plain_peft_on_its_base(model_path, tmp_path):
    """best/<policy> of a LoRA run is a standard peft adapter: PeftModel.from_pretrained on the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pol = Policy(PolicyConfig("A", model_path, lr=1e-2, lora=LORA))
    batch = _train(pol)
    out = pol.save(tmp_path / "best" / "A")
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), str(out)).eval()
    lp, mask = pol.token_logprobs(batch)
    got, _ = pol.token_logprobs(batch, plain.get_base_model())
    assert torch.allclose(lp * mask, got * mask, atol=1e-6)


def test_an_adapter_on_another_base_is_refused_in_one_line(tiny_pair, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_pair[0], base)
    pol = Policy(PolicyConfig("A", str(base), lr=1e-2, lora=LORA))
    out = pol.save(tmp_path / "ckpt")
    other = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    other.save_pretrained(base)
    with pytest.raises(PolicyError, match="trained on another base") as exc:
        Policy(PolicyConfig("A", str(out)))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "lora, match",
    [
        ({"r": 4, "dropout": 0.1}, "dropout must be 0"),
        ({"r": 0}, "r must be an integer"),
        ({"r": 4, "alpha": -1}, "alpha must be"),
        ({"r": 4, "target_modules": "attention"}, "target_modules"),
        ({"r": 4, "rank": 2}, "unknown key 'rank'"),
    ],
)
def test_bad_lora_settings_are_one_line(lora, match):
    with pytest.raises(PolicyError, match=match) as exc:
        PolicyConfig("A", "m", lora=lora)
    assert "\n" not in str(exc.value) and "policy 'A'" in str(exc.value)


def test_settings_from_a_mapping():
    s = LoraSettings.of({"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    assert s == LoraSettings(8, 16, ["q_proj", "v_proj"]) and s.scale == 2.0
    assert PolicyConfig("A", "m").lora is None


def test_merged_state_names_are_the_models_own(tiny_pair):
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lora={"r": 2, "alpha": 2, "target_modules": ["q_proj"]}))
    merged = MergedState(pol.model)
    assert all(".lora_" not in n and "base_layer" not in n for n in merged)
    assert len(merged) == len([n for n in pol.model.state_dict() if ".lora_" not in n])


def test_the_push_reference_digests_each_merged_tensor_as_its_own(tiny_pair):
    """Merged tensors are made as read and freed; one made later at a freed one's address (same shape)
    is not an alias of it: every digest is that tensor's own."""
    from graft_rl.policy.pushcheck import row_digest, state_digest

    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=1e-2, lora=LORA))
    _train(pol)
    merged = pol.rollout_state()
    dtypes = {n: torch.float32 for n in merged}
    got = state_digest(merged, dtypes)
    for n in merged:
        assert torch.equal(got[n], row_digest(merged[n])), n


def test_a_list_of_target_modules_comes_from_a_config_file_and_an_override(tiny_pair):
    from graft_rl.engine.config import load_config

    pol = {"name": "A", "model": str(tiny_pair[0]), "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"]}}
    cfg = load_config({"data": {"train": "gsm8k_train"}, "method": {"name": "grpo"}, "policies": [pol]})
    assert cfg.policies[0].lora.target_modules == ["q_proj", "v_proj"]
    cfg = load_config(
        {"data": {"train": "gsm8k_train"}, "method": {"name": "grpo"}, "policies": [pol]},
        ["policies.0.lora.target_modules=[o_proj]"],
    )
    assert cfg.policies[0].lora.target_modules == ["o_proj"]


@pytest.mark.parametrize(
    "targets, match", [(["lm_head"], "is the LM head"), (["embed_tokens"], "only linear layers can be adapted")]
)
def test_an_lm_head_or_embedding_target_is_refused_in_one_line(tiny_pair, targets, match):
    with pytest.raises(PolicyError, match=match) as exc:
        Policy(PolicyConfig("A", str(tiny_pair[0]), lora={"r": 2, "target_modules": targets}))
    assert "\n" not in str(exc.value)


def test_lora_with_a_second_reference_model_is_refused():
    with pytest.raises(PolicyError, match="reference_model is not used with lora"):
        PolicyConfig("A", "m", lora=LORA, reference_model="other")


def test_an_adapter_loads_on_its_base_in_another_dtype_and_a_zoo_base_stays_a_name(tmp_path):
    pol = Policy(PolicyConfig("A", "zoo:lookup-a", lr=1e-2, lora=LORA))
    assert pol.base["model"] == "zoo:lookup-a"  # the package may move: the name, not its path
    out = pol.save(tmp_path / "ckpt")
    again = Policy(PolicyConfig("A", str(out), dtype="bfloat16"))  # graft eval --dtype bfloat16: same base
    assert again.base["digest"] == pol.base["digest"]
    assert next(p for n, p in again.model.named_parameters() if ".lora_" not in n).dtype == torch.bfloat16
