"""A fake vLLM that behaves as the CUDA build does where graft-rl depends on it (issues 32, 39), for
the cases only a GPU would show. Built from vLLM 0.32/0.33's source:

- the V2 model runner draws an unseeded request's seed from numpy's global RNG, which every engine
  resets to the model seed at start (``v1/worker/gpu/sample/states.py``, ``gpu_worker.py``), and
  never reads torch's generator; parallel sampling seeds child ``i`` with ``seed + i``;
- ``reload_weights`` copies each streamed tensor into the live parameter of the same name; a
  parameter that receives nothing keeps its values (``model_loader/reload/layerwise.py``);
- level-2 sleep discards the weights (here: overwritten with garbage, as unmapped memory reads);
  level 1 backs them up; the sleep allocator is one per process (``usage``);
- the engine core's shutdown calls ``torch.distributed.destroy_process_group()``
  (``cleanup_dist_env_and_memory``) and frees the pools whatever they hold: shutting down a sleeping
  engine is recorded (the CUDA allocator's ``my_free`` would unmap unmapped memory);
- ``_ROPE_DICT``: the rotary modules cached for the whole process;
- ``Worker.sleep`` reads the *device-wide* free memory before and after freeing its pools and asserts
  it did not drop ("Memory usage increased after sleeping.", ``v1/worker/gpu_worker.py``): with
  ``FakeLLM.device`` set (a :class:`FakeDevice`, one file per GPU shared by every process), each engine
  maps ``gpu_memory_utilization`` of it (a quarter weights, the rest KV cache), frees it all in sleep and
  maps each woken tag's part again, and its sleep measures the device as vLLM's does.

``install(monkeypatch)`` puts it in ``sys.modules``; ``install()`` without one does so for good
(a rank process of a multi-process test).
"""

from __future__ import annotations

import copy
import fcntl
import os
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import torch


class InprocClient:
    def __init__(self, llm):
        self.llm = llm

    def shutdown(self):
        self.llm.calls.append(("shutdown", frozenset(self.llm.asleep)))
        FakeLLM.usage = 0  # the pools are freed
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # as vLLM's cleanup_dist_env_and_memory does


class MPClient:
    pass


class SyncMPClient(MPClient):
    def __init__(self, llm):
        pass


class FakeDevice:
    """One GPU's used bytes as every process sees them (``torch.cuda.mem_get_info``): a file updated
    under its own lock, so several processes' engines map and free on the same device."""

    TOTAL = 1 << 40

    def __init__(self, path: str):
        self.path = path

    def add(self, n: int) -> None:
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            used = int(f.read() or 0) + n
            f.seek(0)
            f.truncate()
            f.write(str(used))

    def free(self) -> int:
        if not os.path.exists(self.path):
            return self.TOTAL
        with open(self.path) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            return self.TOTAL - int(f.read() or 0)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FakeLLM:
    """Holds an engine copy of the model's weights in its dtype; sleep, wake, reload and RPCs recorded."""

    source: torch.nn.Module | None = None  # the model "as loaded from disk" (else loaded from the directory)
    unloaded: set = set()  # names the next reloads skip (a push that misses them)
    core = InprocClient
    usage = 0  # bytes the sleep-mode allocator holds in this process
    built: list = []  # every engine built in this process (tests read their calls)
    device: FakeDevice | None = None  # the GPU shared with other processes' engines (module docstring)
    sleep_seconds = 0.02  # how long freeing the pools takes, between vLLM's two measurements

    def __init__(self, model, dtype="float32", enable_sleep_mode=False, **kw):
        self.kw, self.calls, self.asleep = {"dtype": dtype, "enable_sleep_mode": enable_sleep_mode, **kw}, [], set()
        np.random.seed(0)  # gpu_worker.py: every engine resets numpy to the model seed after warm-up
        src = FakeLLM.source
        if src is None:
            from transformers import AutoModelForCausalLM

            src = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.engine_model = copy.deepcopy(src).to(_DTYPES[dtype]).requires_grad_(False)
        self.model_runner = SimpleNamespace(get_model=lambda: self.engine_model)
        self.llm_engine = SimpleNamespace(engine_core=self.core(self), model_config=SimpleNamespace(quantization=None))
        if enable_sleep_mode:
            FakeLLM.usage += 1 << 30
        pool = int(kw.get("gpu_memory_utilization", 0.4) * FakeDevice.TOTAL)
        self.pools = {"weights": pool // 4, "kv_cache": pool - pool // 4}
        if self.device is not None:
            self.device.add(pool)
        FakeLLM.built.append(self)

    def collective_rpc(self, method, args=(), kwargs=None):
        if callable(method):
            return [method(self, *args)]
        assert method == "reload_weights"
        params = dict(self.engine_model.named_parameters())
        names = []
        with torch.no_grad():
            for name, t in kwargs["weights_iterator"]:
                names.append(name)
                if name in params and name not in self.unloaded:
                    params[name].copy_(t)
        self.calls.append(("reload", len(names)))
        return [None]

    def sleep(self, level):
        self.calls.append(("sleep", level))
        if self.device is not None:  # gpu_worker.py: free memory of the whole device, before and after
            before = self.device.free()
            self.device.add(-sum(self.pools[t] for t in self.pools if t not in self.asleep))
            time.sleep(self.sleep_seconds)
            assert self.device.free() - before >= 0, "Memory usage increased after sleeping."
        self.asleep = {"weights", "kv_cache"}
        if level == 2:  # discarded: what the memory holds when it is mapped again is not the weights
            with torch.no_grad():
                for p in self.engine_model.parameters():
                    p.fill_(7.0)

    def wake_up(self, tags):
        self.calls.append(("wake", tuple(tags)))
        if self.device is not None:
            self.device.add(sum(self.pools[t] for t in tags if t in self.asleep))
        self.asleep -= set(tags)

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.asleep, "generate on a sleeping engine"
        params = params if isinstance(params, list) else [params] * len(prompts)
        vocab = getattr(getattr(self.engine_model, "config", None), "vocab_size", 1000)
        outs = []
        for p in params:
            # V2 add_request: an unseeded request gets a seed from numpy's global RNG; parallel sampling
            # seeds child i with seed + i
            seed = p.seed if p.seed is not None else int(np.random.randint(-(2**62), 2**62))
            children = []
            for i in range(p.n):
                rng = np.random.default_rng((seed + i) % 2**63)
                ids = rng.integers(0, vocab, size=p.max_tokens).tolist()
                lps = [{t: SimpleNamespace(logprob=-1.0)} for t in ids]
                children.append(SimpleNamespace(token_ids=ids, logprobs=lps, finish_reason="length"))
            outs.append(SimpleNamespace(outputs=children))
        return outs


class FakeVSP:
    def __init__(self, n=1, seed=None, max_tokens=16, **kw):
        self.n, self.seed, self.max_tokens, self.kw = n, seed, max_tokens, kw


class EngineArgs:
    """The signature graft-rl reads to see whether this vLLM can offload CUDA-graph memory in sleep."""

    def __init__(self, model="", sleep_mode_offload_cudagraph=False, **kw):
        pass


def modules() -> dict[str, types.ModuleType]:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.33.0"
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeVSP
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    alloc = types.ModuleType("vllm.device_allocator")
    alloc.get_mem_allocator_instance = lambda: SimpleNamespace(get_current_usage=lambda: FakeLLM.usage)
    args = types.ModuleType("vllm.engine.arg_utils")
    args.EngineArgs = EngineArgs
    rotary = types.ModuleType("vllm.model_executor.layers.rotary_embedding")
    rotary._ROPE_DICT = {}
    layers = types.ModuleType("vllm.model_executor.layers")
    layers.rotary_embedding = rotary
    return {
        "vllm": vllm,
        "vllm.inputs": inputs,
        "vllm.device_allocator": alloc,
        "vllm.engine": types.ModuleType("vllm.engine"),
        "vllm.engine.arg_utils": args,
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.layers": layers,
        "vllm.model_executor.layers.rotary_embedding": rotary,
    }


def install(monkeypatch=None):
    mods = modules()
    for name, mod in mods.items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, mod)
        else:
            sys.modules[name] = mod
    state = {"usage": 0, "unloaded": set(), "core": InprocClient, "source": None, "built": [], "device": None}
    for k, v in state.items():
        if monkeypatch is not None:
            monkeypatch.setattr(FakeLLM, k, v)
        else:
            setattr(FakeLLM, k, v)
    return mods["vllm"]
