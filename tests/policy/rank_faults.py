"""One rank of the fault test (run by tests/policy/test_push_ranks.py under torchrun, gloo, CPU, with the
fake vLLM of ``fake_vllm.py``; issue 62): a sharded vLLM policy whose rank 1 meets a fault during a push,
in each place a push can fail on one rank only, and then, with the group's timeout set short, in the
middle of a step's other collectives (the KL reference's forward; an update, whose statistics are reduced
after it). Writes, per fault, what
each rank raised and how long it took, to ``OUT.rank<r>.json``.

MODE (argument 3): "" full fine-tuning; "lora" LoRA adapters (merged pushes)."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm  # noqa: E402

from graft_rl.policy import PolicyConfig  # noqa: E402
from graft_rl.policy.fsdp import ShardedPolicy  # noqa: E402

#: The group's timeout (seconds): what bounds a fault inside a collective itself. A fault the push
#: check agrees on ends both ranks in under 0.1 s (the test's own ``seconds``, AMD EPYC); 8 s leaves room for a loaded machine's setup.
TIMEOUT = 8


class Injected(RuntimeError):
    pass


def _engine_fault(llm, at: int):
    """Rank 1's engine loader fails at its ``at``-th tensor."""
    real = llm.collective_rpc

    def rpc(method, args=(), kwargs=None):
        if method == "reload_weights":

            def failing(stream):
                for i, item in enumerate(stream):
                    if i == at:
                        raise Injected(f"the engine's loader failed at {item[0]}")
                    yield item

            kwargs = {**kwargs, "weights_iterator": failing(kwargs["weights_iterator"])}
        return real(method, args=args, kwargs=kwargs)

    return rpc


def _stream_fault(weights_fn, at: int):
    """Rank 1's stream fails after its ``at``-th tensor was gathered (a cast, a merge or a digest)."""

    def stream(*a):
        for i, item in enumerate(weights_fn(*a)):
            if i == at:
                raise Injected(f"the stream failed after gathering {item[0]}")
            yield item

    return stream


def _check_fault(llm):
    """Rank 1's engine holds a zeroed tensor after the push: its check fails, rank 0's passes."""
    real = llm.collective_rpc

    def rpc(method, args=(), kwargs=None):
        out = real(method, args=args, kwargs=kwargs)
        if method == "reload_weights":
            with torch.no_grad():
                next(iter(llm.engine_model.parameters())).zero_()
        return out

    return rpc


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "seconds": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"raised": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}


def _move(pol):
    with torch.no_grad():
        for p in pol.model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    pol.weights_version += 1


def run(model: str, out: str, mode: str = "") -> None:
    fake_vllm.install()  # here, not at import: the test reads TIMEOUT in its own process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    kw = {"lora": {"r": 4, "alpha": 8}} if mode == "lora" else {}
    pol = ShardedPolicy(PolicyConfig("A", model, lr=1e-2, world_size=2, backend="vllm", **kw))
    b = pol.backend
    llm, weights_fn = b.llm, b.weights_fn
    seen = {}
    faults = {
        "engine": lambda: setattr(llm, "collective_rpc", _engine_fault(llm, 3)),
        "stream": lambda: setattr(b, "weights_fn", _stream_fault(weights_fn, 2)),
        "check": lambda: setattr(llm, "collective_rpc", _check_fault(llm)),
    }
    real_rpc = llm.collective_rpc
    for name, inject in faults.items():
        _move(pol)
        if rank == 1:
            inject()
        seen[name] = _attempt(pol.sync_rollout_weights)
        llm.collective_rpc, b.weights_fn = real_rpc, weights_fn
        seen[f"{name}, then a full push"] = _attempt(pol.sync_rollout_weights)
    # a fault inside a step's other collectives: rank 1 leaves the KL reference's forward (full fine-tuning)
    # or an update (LoRA) between two collectives and stays alive; rank 0 waits in the next until the timeout
    if mode == "":
        pol.init_reference()
        batch = pol.encode_texts(["Q", "Q"], ["1+1=2", "no"], [True, True])
        if rank == 1:
            layer = pol.reference.model.layers[1]
            layer.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(Injected("the reference's layer 1")))
        seen["inside a collective"] = _attempt(lambda: pol.reference_logprobs(batch))
    else:  # rank 1's loss fails between the forward's all-gathers and the backward's reduce-scatters
        batch = pol.encode_texts(["Q", "Q"], ["1+1=2", "no"], [True, True])

        def loss(lp, mask, rows):
            if rank == 1:
                raise Injected("the loss on rank 1")
            return -(lp * mask).sum() / mask.sum(), {}

        seen["inside a collective"] = _attempt(lambda: pol.update(batch, loss))
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(seen))
    time.sleep(1 if rank == 0 else TIMEOUT + 5)  # rank 1 alive past rank 0's timeout; the group is broken


if __name__ == "__main__":
    run(*sys.argv[1:4])
