"""Response-token log-probs without ``[tokens x vocab]`` logits (bounded memory; docs/design.md, layer 3).

A policy-gradient step needs ``log pi(o_t | q, o_<t)`` of the sampled tokens only. The naive
path builds the logits of every response position (``[B, L, V]``: 8 x 4096 x 152k in bf16 is
9.9 GB, twice that in float32) and keeps them for backward. Here the LM head is applied to
``chunk`` hidden states at a time, each chunk's ``logit[target] - logsumexp(logits)`` is kept,
and the chunk runs under activation checkpointing, so backward recomputes one chunk's logits
at a time: peak memory is ``chunk x V`` instead of ``B x L x V``.

The chunked head is installed *inside* the model's own forward (the LM head module's
``forward`` is swapped for the duration of one call), so it works unchanged under FSDP2, whose
parameter gathering is tied to the root module's forward. Models that transform the head's
output afterwards (e.g. Gemma 2's final logit soft-capping) are detected by a self-check when
the policy is built (``Policy._fused_head_matches``) and fall back to the ``logits_to_keep`` path (:meth:`graft_rl.policy.Policy._forward`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_head_logprobs", "logprob_head"]


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def chunked_head_logprobs(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, chunk: int = 1024, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(head(hidden) / T)[target]`` as float32 ``[B, P]``, ``chunk`` tokens at a time.

    Args:
        hidden: ``[B, P, H]`` final hidden states of the positions that predict ``targets``.
        head: the model's LM head (``[V, H]`` weight, optional bias).
        targets: ``[B, P]`` token ids.
        chunk: tokens (rows of ``B x P``) per LM-head call; the largest tensor built is ``chunk x V``.
        temperature: logits are divided by it (docs/fidelity.md: the sampling temperature, as verl does).

    Under autograd each chunk is checkpointed, so backward rebuilds one chunk's logits at a time.
    """
    B, P, H = hidden.shape
    flat_h = hidden.reshape(B * P, H)
    flat_t = targets.reshape(B * P)
    out = []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    for s in range(0, B * P, chunk):
        h, t = flat_h[s : s + chunk], flat_t[s : s + chunk]
        if grad:
            out.append(checkpoint(_chunk_logprobs, h, head.weight, head.bias, t, temperature, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(h, head.weight, head.bias, t, temperature))
    if not out:
        return hidden.new_zeros((B, P), dtype=torch.float32)
    return torch.cat(out).reshape(B, P)


@contextlib.contextmanager
def logprob_head(model, targets: torch.Tensor, chunk: int, temperature: float = 1.0):
    """Within the block, ``model(..., logits_to_keep=P + 1).logits`` is ``[B, P, 1]`` target log-probs.

    The LM head sees the last ``P + 1`` hidden states; positions ``0..P-1`` of them predict
    ``targets`` (``[B, P]``), the last one predicts nothing and is dropped.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"{type(model).__name__}: the LM head is {type(head).__name__}, not a Linear layer")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        P = targets.shape[1]
        # a fresh tensor, not a view: FSDP2 hooks the root's outputs for backward
        return chunked_head_logprobs(hidden[:, :P], head, targets, chunk, temperature)[..., None].clone()

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward
