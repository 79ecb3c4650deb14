"""Every weight push is verified against the trainer's parameters (issue 39, SPEC §1.10), and what vLLM
keeps per process is handled (one engine at a time where one sleeps, woken before shutdown, rotary
cache cleared, the process group kept). The digest's rules are checked as properties; the backend
with the fake vLLM of ``fake_vllm.py`` (the CUDA build's behaviour where only a GPU would show it);
the real engine in ``test_vllm_backend.py`` (vLLM's CPU build) and ``scripts/gpu_check.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl.policy import pushcheck
from graft_rl.policy.types import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm as fv  # noqa: E402
from fake_vllm import FakeLLM  # noqa: E402
from push_faults import FAULTS  # noqa: E402

SP = SamplingParams(n=2, max_new_tokens=4)


@pytest.fixture
def fake_vllm(monkeypatch):
    return fv.install(monkeypatch)


# ---------------------------------------------------------------- the digest


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 7),
    cut=st.integers(0, 9),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_row_digests_compose_over_row_blocks_and_any_changed_value_shows(rows, cols, cut, dtype, seed):
    """Additive: the row digest of a tensor is its row blocks' digests concatenated (FSDP2 shards, fused
    qkv/gate_up); exact: changing any one value (one ulp in the engine's dtype) changes its row's digest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    cut = min(cut, rows)
    whole = pushcheck.row_digest(x, dtype)
    assert torch.equal(torch.cat([pushcheck.row_digest(x[:cut], dtype), pushcheck.row_digest(x[cut:], dtype)]), whole)
    i, j = seed % rows, (seed // 7) % cols
    y = x.to(dtype).clone()
    y[i, j] = torch.nextafter(y[i, j].float(), torch.tensor(float("inf"))).to(dtype)
    if y[i, j] == x.to(dtype)[i, j]:  # one ulp of the engine's dtype
        y[i, j] = (y[i, j].view(torch.int16 if dtype != torch.float32 else torch.int32) + 1).view(dtype)
    changed = pushcheck.row_digest(y)
    assert (changed != whole).nonzero().flatten().tolist() == [i]
    # by column (a transposed engine tensor): the rows of the transpose, additive over row blocks too
    cols = pushcheck.row_digest(x, dtype, columns=True)
    assert torch.equal(cols, pushcheck.row_digest(x.T.contiguous(), dtype))
    assert torch.equal(
        pushcheck.row_digest(x[:cut], dtype, columns=True) + pushcheck.row_digest(x[cut:], dtype, columns=True), cols
    )


def test_a_stale_bf16_value_is_caught_where_the_fp32_master_moved_below_half_an_ulp_elsewhere():
    master = torch.full((4, 3), 1.0)
    before = pushcheck.row_digest(master, torch.bfloat16)
    master[1, 2] += 1e-2  # crosses a bf16 step (0.0078 at 1.0)
    master[3, 0] += 1e-4  # does not: the engine's bf16 value is the same, and so is the digest
    assert (pushcheck.row_digest(master, torch.bfloat16) != before).nonzero().flatten().tolist() == [1]


class _Attn(torch.nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        if fused:
            self.qkv_proj = torch.nn.Linear(4, 8, bias=False)  # q 4 rows, k 2, v 2
        else:
            self.q_proj = torch.nn.Linear(4, 4, bias=False)
            self.k_proj = torch.nn.Linear(4, 2, bias=False)
            self.v_proj = torch.nn.Linear(4, 2, bias=False)


class _Net(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, fused: bool, vocab_rows: int = 5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_rows, 4)
        self.layers = torch.nn.ModuleList([_Attn(fused)])
        self.norm = torch.nn.LayerNorm(4)


def _fused_from(trainer: _Net) -> _Net:
    """An engine model as vLLM builds it: q/k/v fused along rows, vocabulary padded to 8 rows."""
    eng = _Net(True, vocab_rows=8)
    a = trainer.layers[0]
    with torch.no_grad():
        eng.layers[0].qkv_proj.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        eng.embed.weight[:5].copy_(trainer.embed.weight)
        eng.norm.load_state_dict(trainer.norm.state_dict())
    return eng


def test_fused_and_padded_engine_tensors_are_verified_from_their_parts_and_a_stale_part_is_named():
    torch.manual_seed(0)
    trainer = _Net(False)
    engine = _fused_from(trainer)
    sd = trainer.state_dict()
    layout = pushcheck.engine_layout(engine, list(sd))
    assert layout.parts["layers.0.qkv_proj.weight"] == [
        "layers.0.q_proj.weight",
        "layers.0.k_proj.weight",
        "layers.0.v_proj.weight",
    ]
    assert not layout.unplaced and all(layout.parts.values())
    digests = {n: pushcheck.row_digest(p) for n, p in engine.named_parameters()}
    ref = pushcheck.state_digest(sd, layout.trainer_dtypes())
    assert pushcheck.compare(layout, ref, digests) == []
    with torch.no_grad():
        trainer.layers[0].k_proj.weight[1, 0] += 1.0  # the trainer moved; the engine's k rows are stale
    ref = pushcheck.state_digest(trainer.state_dict(), layout.trainer_dtypes())
    assert pushcheck.compare(layout, ref, digests) == [
        "layers.0.qkv_proj.weight differs from the trainer's layers.0.k_proj.weight (1 of 2 rows)"
    ]


def test_a_trainer_tensor_the_engine_lacks_or_an_engine_tensor_nothing_reaches_is_found():
    trainer = _Net(False)
    engine = _fused_from(trainer)
    engine.extra = torch.nn.Parameter(torch.zeros(3))
    layout = pushcheck.engine_layout(engine, [*trainer.state_dict(), "lm_head.weight"])
    assert layout.unplaced == ["lm_head.weight"] and layout.parts["extra"] == []


# ---------------------------------------------------------------- the backend: every push verified


def _tiny_llama(tmp_path):
    from transformers import AutoModelForCausalLM

    from graft_rl.policy.tiny import build_tiny_model, char_tokenizer

    d = build_tiny_model(tmp_path / "llama", "llama", char_tokenizer(), hidden=32, heads=2, seed=0)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def _backend(model, **kw):
    from graft_rl.policy.vllm_backend import VLLMBackend

    FakeLLM.source = model
    return VLLMBackend(model, "model_dir", **kw)


def _update(model, scale=1e-2):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def test_a_push_without_one_decoder_layer_or_with_a_zeroed_tensor_is_refused_then_a_full_push_works(
    fake_vllm, tmp_path
):
    """Issues 39 and 62: also the tied alias ``lm_head.weight``, left out or zeroed on its way: the fake
    engine, as vLLM, holds the head in the embedding's storage and ignores the alias, so only the
    check at the engine's door (:func:`pushcheck.delivery`) sees either."""
    from graft_rl.policy.vllm_backend import VLLMEngineError

    model = _tiny_llama(tmp_path)
    b = _backend(model, sleep=True, name="A")
    assert b.layout.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    stream = b.weights_fn
    for fault, name in FAULTS.values():
        _update(model)
        b.weights_fn = lambda *a, fault=fault: fault(stream(*a))  # the fault enters after the trainer's digest
        with pytest.raises(VLLMEngineError, match=rf"policy 'A': .*after the push are not the trainer's: .*{name}"):
            b.sync_weights()
        with pytest.raises(VLLMEngineError, match="not the trainer's"):
            b.generate([[1, 2]], SP, 0)
        b.weights_fn = stream
        b.sync_weights()
        b.generate([[1, 2]], SP, 0)
    assert b.full_push and b.llm.calls[-1] == ("sleep", 2)


def test_a_lora_policys_merged_push_is_refused_without_its_alias_then_works(fake_vllm, tiny_pair):
    """Issue 62: a LoRA policy pushes merged weights under the model's own names, the tied alias among
    them; leaving it out, or zeroing it, is refused as for full fine-tuning."""
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    from graft_rl.policy import Policy, PolicyConfig
    from graft_rl.policy.vllm_backend import VLLMEngineError

    FakeLLM.source = None
    pol = Policy(PolicyConfig("A", str(tiny_pair[0]), backend="vllm", device="cpu", lora={"r": 4, "alpha": 8}))
    b = pol.backend
    assert b.layout.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    stream = b.weights_fn
    for key in ("the tied alias left out", "the tied alias zeroed"):
        fault, name = FAULTS[key]
        with torch.no_grad():  # an update moves the adapters: every adapted merged weight changes
            for p in pol.model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        b.weights_fn = lambda *a, fault=fault: fault(stream(*a))
        with pytest.raises(VLLMEngineError, match=name):
            b.sync_weights()
        b.weights_fn = stream
        b.sync_weights()
    pol.close()


def test_gpt2s_conv1d_weights_are_digested_by_column_where_the_engine_holds_them_transposed(tiny_pair):
    """Issue 62: vLLM's GPT-2 holds each ``Conv1D`` weight (``[in, out]``) as a linear layer's ``[out, in]``.
    The layout marks those engine tensors, whose column digests are the trainer's row digests; a
    transposed tensor whose engine shape is not the reverse has no place (refused at the engine's start)."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32)
    engine = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32)
    conv = pushcheck.transposed_names(trainer)
    assert "transformer.h.0.attn.c_attn.weight" in conv and "lm_head.weight" not in conv
    state = trainer.state_dict()
    same = pushcheck.engine_layout(engine, list(state), tied={"lm_head.weight"}, transposed=conv)
    assert not same.columns and not same.unplaced  # an engine that keeps Conv1D: rows as they are
    assert same.aliases == {"lm_head.weight": "transformer.wte.weight"}
    for name in conv:  # the engine of vLLM: linear layers, weights transposed
        module = engine.get_submodule(name.rpartition(".")[0])
        linear = torch.nn.Linear(module.weight.shape[0], module.weight.shape[1])
        with torch.no_grad():
            linear.weight.copy_(module.weight.T)
            linear.bias.copy_(module.bias)
        engine.set_submodule(name.rpartition(".")[0], linear)
    layout = pushcheck.engine_layout(engine, list(state), tied={"lm_head.weight"}, transposed=conv)
    assert layout.columns == set(conv) and not layout.unplaced
    got = {n: pushcheck.row_digest(p, columns=n in layout.columns) for n, p in engine.named_parameters()}
    ref = pushcheck.state_digest(state, layout.trainer_dtypes())
    assert pushcheck.compare(layout, ref, got) == []
    wrong = {n: tuple(s)[::-1] for n, s in conv.items()}  # a trainer shape the engine's does not reverse
    assert set(pushcheck.engine_layout(engine, list(state), tied={"lm_head.weight"}, transposed=wrong).unplaced) == {
        n for n, s in conv.items() if s[0] != s[1]
    }


def test_an_alias_the_engine_holds_in_no_parameters_storage_has_no_place():
    """A tied alias is placed by storage: a head whose weight is its own copy, not a parameter, is not
    taken for the embedding's."""
    trainer = _Net(False)
    engine = _fused_from(trainer)
    engine.lm_head = torch.nn.Module()
    engine.lm_head.weight = engine.embed.weight  # the head tied: the embedding's parameter
    layout = pushcheck.engine_layout(engine, [*trainer.state_dict(), "lm_head.weight"], tied={"lm_head.weight"})
    assert layout.aliases == {"lm_head.weight": "embed.weight"} and not layout.unplaced
    assert layout.trainer_dtypes()["lm_head.weight"] == torch.float32
    engine.lm_head = torch.nn.Module()
    engine.lm_head.weight = engine.embed.weight.detach().clone()  # a copy: where it lands is not digested
    layout = pushcheck.engine_layout(engine, [*trainer.state_dict(), "lm_head.weight"], tied={"lm_head.weight"})
    assert layout.unplaced == ["lm_head.weight"] and not layout.aliases


def test_a_push_after_a_level_two_sleep_is_verified_like_any_other(fake_vllm, tmp_path, monkeypatch):
    from graft_rl.policy.vllm_backend import VLLMEngineError

    model = _tiny_llama(tmp_path)
    b = _backend(model, sleep=True)
    b.sync_weights()
    b.generate([[1, 2]], SP, 0)  # level 2 from here: the engine's weights are discarded
    assert b.needs_push
    monkeypatch.setattr(FakeLLM, "unloaded", {"model.norm.weight"})
    with pytest.raises(VLLMEngineError, match=r"model.norm.weight differs"):
        b.sync_weights()
    assert not b.full_push  # level 1 again until a push verifies


def test_an_engine_that_does_not_load_what_the_trainer_holds_is_refused_as_built(fake_vllm, tmp_path):
    from graft_rl.policy.vllm_backend import VLLMEngineError

    model = _tiny_llama(tmp_path)
    FakeLLM.source = _tiny_llama(tmp_path / "other")  # a copy the engine changed (tied: lm_head is the embedding)
    with torch.no_grad():
        FakeLLM.source.lm_head.weight.mul_(2)
    from graft_rl.policy.vllm_backend import VLLMBackend

    with pytest.raises(
        VLLMEngineError,
        match=r"as loaded from the model directory are not the trainer's: model.embed_tokens.weight differs",
    ):
        VLLMBackend(model, "model_dir")


def test_a_quantised_engine_is_checked_for_coverage_and_never_sleeps_at_level_two(fake_vllm, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from graft_rl.policy.vllm_backend import VLLMEngineError

    real = FakeLLM.__init__

    def fp8(self, *a, **kw):
        real(self, *a, **kw)
        self.llm_engine.model_config = SimpleNamespace(quantization="fp8")

    monkeypatch.setattr(FakeLLM, "__init__", fp8)
    model = _tiny_llama(tmp_path)
    b = _backend(model, sleep=True)
    _update(model)
    b.sync_weights()  # values differ (quantised) but every tensor moved with the trainer
    b.generate([[1, 2]], SP, 0)
    assert not b.full_push and b.llm.calls[-1] == ("sleep", 1)
    _update(model)
    monkeypatch.setattr(FakeLLM, "unloaded", {"model.layers.0.self_attn.o_proj.weight"})
    with pytest.raises(VLLMEngineError, match=r"o_proj.weight did not change although the trainer's"):
        b.sync_weights()


# ---------------------------------------------------------------- what vLLM keeps per process


@pytest.fixture
def on_cuda(monkeypatch):
    """The backend's view of a CUDA machine (the fake engine needs no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_on_cuda_a_second_open_engine_is_refused_whichever_of_the_two_sleeps(fake_vllm, on_cuda):
    """Issue 39.2: a second engine that does not sleep beside a sleeping one (what the old refusal
    recommended) reuses the first one's rotary cache from its sleep pool: refused too."""
    from graft_rl.policy.vllm_backend import VLLMEngineError

    for first_sleeps, second_sleeps in ((True, False), (False, True)):
        first = _backend(torch.nn.Linear(2, 2), sleep=first_sleeps, name="A")
        with pytest.raises(VLLMEngineError, match=r"policy 'B': a second vLLM engine in this process while 'A'"):
            _backend(torch.nn.Linear(2, 2), sleep=second_sleeps, name="B")
        first.close()
        _backend(torch.nn.Linear(2, 2), sleep=second_sleeps, name="B").close()  # one after another: allowed


def test_a_sleeping_engine_is_woken_before_shutdown_and_the_rotary_cache_is_cleared(fake_vllm, on_cuda):
    """Issue 39.3: shutting down a sleeping engine frees (unmaps) memory that is not mapped, which breaks
    vLLM's allocator for the rest of the process; the rotary modules cached process-wide hold memory of
    the engine that closed."""
    from vllm.model_executor.layers import rotary_embedding

    b = _backend(torch.nn.Linear(2, 2), sleep=True)
    assert b.sleeping == {"weights", "kv_cache"}
    rotary_embedding._ROPE_DICT["key"] = object()
    llm = b.llm
    b.close()
    assert ("shutdown", frozenset()) in llm.calls  # awake when it was shut down
    assert rotary_embedding._ROPE_DICT == {}


def test_closing_an_engine_keeps_a_process_group_that_existed_before_it(fake_vllm, tmp_path):
    """Issue 39.4: vLLM's shutdown destroys torch.distributed's default group; a sharded policy's group
    (built before its engine) survives, one vLLM made for itself does not."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        b = _backend(torch.nn.Linear(2, 2))
        b.close()
        assert dist.is_initialized()
        t = torch.ones(1)
        dist.all_reduce(t)  # the group still works
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    b = _backend(torch.nn.Linear(2, 2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg2'}", rank=0, world_size=1)  # as vLLM does
    b.close()
    assert not dist.is_initialized()


def test_cuda_graph_memory_leaves_the_gpu_with_a_sleeping_engine(fake_vllm):
    b = _backend(torch.nn.Linear(2, 2), sleep=True)
    assert b.llm.kw["sleep_mode_offload_cudagraph"] is True
    assert "sleep_mode_offload_cudagraph" not in _backend(torch.nn.Linear(2, 2), sleep=False).llm.kw
    b.close()
    kept = _backend(torch.nn.Linear(2, 2), sleep=True, sleep_mode_offload_cudagraph=False)
    assert kept.llm.kw["sleep_mode_offload_cudagraph"] is False  # the user's choice stands


def test_the_engine_options_this_backend_needs_where_the_vllm_has_them(monkeypatch):
    """Issue 62: vLLM 0.34's extensible KV cache (a process-wide cap on torch's memory, while this process
    also trains) is turned off; on CPU an engine's KV cache is sized unless the user sized it (vLLM's CPU
    build otherwise takes a share of the machine less the whole process, which a second engine finds
    spent) and runs eagerly (no compile at each start); a vLLM without an option gets none of it; the user's
    choices stand. 0.32-0.34 are accepted."""
    import types

    from graft_rl.policy import vllm_backend as vb

    class EngineArgs:  # vLLM 0.34's fields
        def __init__(
            self,
            sleep_mode_offload_cudagraph=False,
            enable_extensible_kv_cache=None,
            kv_cache_memory_bytes=None,
            enforce_eager=False,
            compilation_config=None,
        ):
            pass

    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert vb._engine_kwargs(True, {}, "cuda") == {
        "sleep_mode_offload_cudagraph": True,
        "enable_extensible_kv_cache": False,
    }
    assert vb._engine_kwargs(False, {"enable_extensible_kv_cache": True}, "cuda") == {
        "enable_extensible_kv_cache": True
    }
    assert vb._engine_kwargs(False, {}, "cpu")["kv_cache_memory_bytes"] == vb.CPU_KV_CACHE_BYTES
    # on CPU an eager engine (no torch.compile at each start) unless the user chose compilation
    assert vb._engine_kwargs(False, {}, "cpu")["enforce_eager"] is True
    assert "enforce_eager" not in vb._engine_kwargs(True, {}, "cuda")
    assert "enforce_eager" not in vb._engine_kwargs(False, {"compilation_config": {"level": 3}}, "cpu")
    assert vb._engine_kwargs(False, {"enforce_eager": False}, "cpu")["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in vb._engine_kwargs(False, {"gpu_memory_utilization": 0.2}, "cpu")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert "kv_cache_memory_bytes" not in vb._engine_kwargs(False, {}, "cpu")

    class Old:  # vLLM 0.32: neither option
        def __init__(self, sleep_mode_offload_cudagraph=False):
            pass

    arg_utils.EngineArgs = Old
    assert vb._engine_kwargs(False, {}, "cuda") == {} and vb._engine_kwargs(False, {}, "cpu") == {}
    for ok in ("0.32.0", "0.33.1", "0.34.0+cpu"):
        vb._check_vllm_version(ok)
    for bad in ("0.31.2", "0.35.0"):
        with pytest.raises(ImportError, match=r"needs vLLM >=0.32,<0.35"):
            vb._check_vllm_version(bad)
