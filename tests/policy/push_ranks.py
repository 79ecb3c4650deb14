"""One rank of the push test (run by tests/policy/test_push_ranks.py under torchrun, gloo, CPU, with
the fake vLLM of ``fake_vllm.py``): a sharded vLLM policy under ``rollout_on_rank0`` whose pushes are
verified collectively; the KL reference resharded
after its forward; ``close()`` keeping the FSDP group. Writes what it saw to ``OUT.rank<r>.json``,
with every all-gather (``full_tensor``: dtype, elements) each push made.

MODE (argument 3): "" float32 full fine-tuning; "bf16" a bfloat16 engine; "lora" LoRA adapters, bf16."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm  # noqa: E402

fake_vllm.install()

from graft_rl.policy import PolicyConfig, SamplingParams  # noqa: E402
from graft_rl.policy.fsdp import ShardedPolicy  # noqa: E402


def _is_sharded(module) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in module.parameters())


def _count_gathers(pol) -> list:
    """Each push's all-gathers, ``[[dtype, numel], ...]`` per push."""
    from torch.distributed.tensor import DTensor

    pushes: list = []
    pushing = [False]
    real_full, real_sync = DTensor.full_tensor, pol.backend.sync_weights

    def full_tensor(self, *a, **k):
        if pushing[0]:
            pushes[-1].append([str(self.dtype), self.numel()])
        return real_full(self, *a, **k)

    def sync_weights():
        pushes.append([])
        pushing[0] = True
        try:
            real_sync()
        finally:
            pushing[0] = False

    DTensor.full_tensor = full_tensor
    pol.backend.sync_weights = sync_weights
    return pushes


def run(model: str, out: str, mode: str = "") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kw = {"dtype": "bfloat16"} if mode in ("bf16", "lora") else {}
    if mode == "lora":
        kw["lora"] = {"r": 4, "alpha": 8}
    pol = ShardedPolicy(PolicyConfig("A", model, lr=1e-2, world_size=2, backend="vllm", rollout_on_rank0=True, **kw))
    pushes = _count_gathers(pol)
    seen = {"backend": type(pol.backend).__name__, "engines": len(fake_vllm.FakeLLM.built)}
    pol.init_reference()
    batch = pol.encode_texts(["Q", "Q"], ["1+1=2", "no"], [True, True])
    pol.reference_logprobs(batch)
    seen["reference resharded"] = pol.reference is None or _is_sharded(pol.reference)  # LoRA: none
    texts = []
    for step in range(2):
        lp, mask = pol.token_logprobs(batch)
        pol.update(batch, lambda lp, mask, rows: (-(lp * mask).sum() / mask.sum(), {}))
        groups = pol.generate([("p1", "1+1=?"), ("p2", "2+2=?")], SamplingParams(n=2, max_new_tokens=4), seed=step)
        texts.append([g.texts for g in groups])
    seen["texts"] = texts
    seen["reloads"] = [c for c in pol.backend.llm.calls if c[0] == "reload"]
    seen["gathers"] = pushes
    seen["tensors"] = {n: [str(t.dtype), t.numel()] for n, t in pol.model.state_dict().items()}
    pol.close()
    seen["group kept"] = dist.is_initialized()
    seen["scores after close"] = pol.token_logprobs(batch)[0].tolist()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()  # both ranks done with every collective before gloo tears down (else an abort at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(*sys.argv[1:4])
