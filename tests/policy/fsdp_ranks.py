"""One rank of the FSDP2 parity test (run by tests/policy/test_fsdp.py under torchrun, gloo, CPU).

Builds a ShardedPolicy over the process group, scores a batch, takes two minibatch updates
(micro-batched, rows split over ranks), generates, saves a checkpoint, reloads the optimiser
shard, and writes what it saw to OUT (rank 0) for the test to compare with one process.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from graft_rl.algo import policy_loss, reference_kl
from graft_rl.policy import PolicyConfig, SamplingParams
from graft_rl.policy.fsdp import ShardedPolicy

TEXTS = ["3+4=7. \\boxed{7}", "no idea", "6*7=42 so \\boxed{42}", "x y z", "a", "12 \\boxed{12}"]
ADV = [1.0, -1.0, 0.5, -0.5, 0.25, -0.25]
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}  # the LoRA variant's adapters (argument 5: lora)


def loss_fn(old, adv, total_tokens):
    def fn(lp, mask, rows):
        loss, st = policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], mask)
        return loss * (float(mask.sum()) / total_tokens), {"tokens": float(mask.sum())}

    return fn


# sharded: rank 0 samples p1 and p3 (the same text: independent groups), rank 1 p2
GEN_PROMPTS = [("p1", "What is 2+3?"), ("p2", "Q: 6*7=?"), ("p3", "What is 2+3?")]


def exercise(pol) -> dict:
    """Score, two minibatch updates, score again, generate: what the test compares across layouts."""
    pol.init_reference()  # the KL reference (HACPO presets): the policy as built
    batch = pol.encode_texts(["Q"] * len(TEXTS), TEXTS, [True] * len(TEXTS))
    old, mask = pol.token_logprobs(batch)
    adv = torch.tensor(ADV)
    stats = [pol.update(batch, loss_fn(old, adv, float(mask.sum()))) for _ in range(2)]
    new, _ = pol.token_logprobs(batch)
    ref, _ = pol.reference_logprobs(batch)
    groups = pol.generate(GEN_PROMPTS, SamplingParams(n=3, max_new_tokens=6), seed=5)
    return {
        "old": old.tolist(),
        "new": new.tolist(),
        "ref": ref.tolist(),
        "stats": stats,
        "texts": [g.texts for g in groups],
        "digest": pol.param_digest(),
        "fused": pol.fused_head,
    }


def reference_first(pol) -> dict:
    """A receiver's first step with KL and no peer rows: the KL reference's forward (the adapter
    disabled) is the policy's first forward, then one update whose loss has the KL term."""
    pol.init_reference()
    batch = pol.encode_texts(["Q"] * len(TEXTS), TEXTS, [True] * len(TEXTS))
    ref, _ = pol.reference_logprobs(batch)
    old, mask = pol.token_logprobs(batch)
    adv, total = torch.tensor(ADV), float(mask.sum())

    def fn(lp, m, rows):
        loss, _ = policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], m)
        kl = reference_kl(lp, ref[rows, : lp.shape[1]].to(lp), m)
        return (loss + 0.01 * kl) * (float(m.sum()) / total), {"tokens": float(m.sum())}

    adapters = [p for n, p in pol.model.named_parameters() if ".lora_" in n]
    before = [float(p.detach().to_local().double().abs().sum()) for p in adapters]
    stats = pol.update(batch, fn)
    after = [float(p.detach().to_local().double().abs().sum()) for p in adapters]
    return {"stats": stats, "adapters_before": before, "adapters_after": after, "digest": pol.param_digest()}


def lagged(pol, ckpt: str) -> dict:
    """``rollout.lag: 1`` on two ranks: a generation after an update samples the weights before it (each
    rank's shards swapped in and its rollout copy synced from them), the live shards come back, and a
    checkpoint holds each rank's shards of the history."""
    sp = SamplingParams(n=3, max_new_tokens=6)
    before = pol.generate(GEN_PROMPTS, sp, seed=5, lag=1)
    batch = pol.encode_texts(["Q"] * len(TEXTS), TEXTS, [True] * len(TEXTS))
    old, mask = pol.token_logprobs(batch)
    pol.update(batch, loss_fn(old, torch.tensor(ADV), float(mask.sum())))
    updated = pol.param_digest()
    stale = pol.generate(GEN_PROMPTS, sp, seed=5, lag=1)
    after_lagged = pol.param_digest()
    live = pol.generate(GEN_PROMPTS, sp, seed=5)
    pol.save(ckpt)
    entries = len(pol.lag.history)
    pol.lag = None
    pol.load_state(ckpt)
    return {
        "before": [g.texts for g in before],
        "stale": [g.texts for g in stale],
        "live": [g.texts for g in live],
        "live weights kept": updated == after_lagged,
        "entries": entries,
        "entries reloaded": len(pol.lag.history),
    }


def receiver_step(pol) -> dict:
    """A receiver's update as a run takes it (:func:`graft_rl.engine.update.receiver_update`): own and peer
    rows, pi_old from the first update's passes and scored beforehand, an engine that differs a little
    (``mu``) under IcePop, the KL, two minibatches. Its step statistics: what no cut of the rows into
    passes or ranks may change (SPEC §1.14)."""
    from graft_rl.engine.update import receiver_update
    from graft_rl.methods import MethodConfig, build_objective
    from graft_rl.methods.objectives import RowTensors

    pol.init_reference()
    batch = pol.encode_texts(["Q"] * len(TEXTS), TEXTS, [True] * len(TEXTS))
    old, mask = pol.token_logprobs(batch)
    ref, _ = pol.reference_logprobs(batch)
    g = torch.Generator().manual_seed(0)
    mu = old + 0.6 * torch.randn(old.shape, generator=g)  # some tokens outside IcePop's band
    is_peer = [False, False, True, False, True, False]
    order = [[0, 1, 2], [3, 4, 5]]
    stored = old.clone()
    stored[3:] += 0.4  # rows of the second update (advantages < 0): a pi_old whose ratio 0.67 is clipped
    m = len(TEXTS)
    t = RowTensors(
        stored,
        mask,
        ADV,
        [1.0, 1.0, 0.9, 1.0, 0.0, 1.0],
        is_peer,
        [True] * m,
        [False] * m,
        [-1.0] * m,
        ref=ref,
        old_is_current=[i in order[0] and not is_peer[i] for i in range(m)],
        mu=mu,
        has_mu=[not p for p in is_peer],
    )
    objective = build_objective(MethodConfig(name="graft", correction="icepop", kl_coef=0.01))
    stats = receiver_update(pol, objective, batch, t, order, step=1)
    return {"sums": stats.sums, "peaks": stats.peaks}


def run(model: str, out: str, dtype: str, ckpt: str, lora: str = "") -> dict:
    """``lora``: "" (full fine-tuning), "lora" (adapters), "lora_reference_first" (:func:`reference_first`:
    bf16 compute, the plain head, no gradient checkpointing), "lag" / "lora_lag" (:func:`lagged`) or
    "receiver" (:func:`receiver_step`)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    first = lora == "lora_reference_first"
    pol = ShardedPolicy(
        PolicyConfig(
            "A",
            model,
            lr=1e-3,
            dtype=dtype,
            micro_batch_tokens=60,
            world_size=2,
            gradient_checkpointing=not first,
            fused_logprobs=not first,
            lora=LORA if lora.startswith("lora") else None,
        )
    )
    if lora == "receiver":
        result = receiver_step(pol)
    elif lora.endswith("lag"):
        result = lagged(pol, ckpt)
    elif first:
        result = reference_first(pol)
    else:
        result = exercise(pol)
        pol.save(ckpt)
        pol.load_state(ckpt)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    run(*sys.argv[1:6])
