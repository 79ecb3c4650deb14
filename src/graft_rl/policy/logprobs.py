"""A policy's log-probs of responses (:class:`PolicyLogprobs`, a part of
:class:`~graft_rl.policy.policy.Policy`): response-token log-probs in forward passes of rows of
similar length (:func:`length_micro_batches`), through the chunked LM head or chunked log-softmax,
with the hooks a sharded policy overrides (which passes this process runs, how results combine)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from graft_rl.policy.heads import logprob_head
from graft_rl.policy.types import TokenBatch
from graft_rl.stats import StepStats

__all__ = ["PASS_OVERHEAD", "PolicyLogprobs", "length_micro_batches", "token_logprobs_from_logits"]


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """``log softmax(logits)[target]`` for ``[B, L, V]`` logits and ``[B, L]`` targets, in float32.

    Computed ``chunk`` positions at a time as ``logit[target] - logsumexp(logits)``, so the
    full float32 ``[B, L, V]`` log-softmax never exists at once (Gemma's 262k vocabulary
    would need 18.5 GB for a 16 x 192 batch).
    """
    out = []
    for s in range(0, logits.shape[1], chunk):
        part = logits[:, s : s + chunk].float()
        tgt = targets[:, s : s + chunk]
        out.append(part.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - part.logsumexp(-1))
    return torch.cat(out, dim=1) if out else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


#: A forward/backward pass's fixed cost, in tokens' worth of compute, as a share of the pass budget:
#: kernel launches, reading the weights, FSDP's all-gather of each layer. A planning figure: on an
#: H200 a 3B model's 32k-token pass takes ~1 s, its all-gathers ~10-20 ms.
PASS_OVERHEAD = 1 / 64


def length_micro_batches(
    lengths: Sequence[int], budget: int, ranks: int = 1, overhead: float = PASS_OVERHEAD
) -> list[list[int]]:
    """Rows in forward passes of at most ``budget`` padded tokens per rank (rows x longest row),
    formed by length; with ``ranks`` > 1 each pass is dealt over the ranks (rows ``r, r + ranks, ...``
    of it to rank ``r``), which run it in lock step (FSDP's collectives).

    A pass pads every row to its longest, so passes are runs of the rows sorted by length (longest
    first, ties in arrival order): some optimal split is such a run (swapping a longer row of a
    shorter-max pass with a shorter row of a longer-max pass never costs more), and over runs the
    split minimising ``computed tokens + overhead x budget x passes`` is exact by dynamic
    programming. Each pass then holds rows of similar length: its padding is what one length class
    differs by, not what the batch's shortest and longest responses differ by (math RL responses run
    from tens of tokens to the 4,096 cap). A batch that fits one pass stays one pass in arrival
    order; a row longer than ``budget`` is a pass of its own. The loss does not depend on the order
    (every pass scores its rows by index); ``benchmarks/padding.py`` measures useful / computed tokens.
    """
    n = len(lengths)
    if n == 0:
        return []
    if max(lengths) * -(-n // ranks) <= budget:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -lengths[i])
    ln = [lengths[i] for i in order]
    fixed = overhead * budget
    best = [0.0] + [math.inf] * n  # best[j]: cost of the j longest rows in passes
    cut = [0] * (n + 1)
    for i in range(n):  # a pass starting at row i (its longest) takes rows i .. j-1
        rows = max(1, budget // ln[i]) * ranks
        base = best[i] + fixed
        for j in range(i + 1, min(n, i + rows) + 1):
            c = base + -(-(j - i) // ranks) * ranks * ln[i]  # every rank computes the pass's widest share
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j] : j])
        j = cut[j]
    return out[::-1]


class PolicyLogprobs:
    """Mixed into :class:`~graft_rl.policy.policy.Policy`, whose model, tokenizer, config,
    ``micro_batch_tokens``, ``fused_head``, ``logprob_temperature`` and ``compute_context`` it uses."""

    # ------------------------------------------------------------------ log-probs
    def _micro_batches(self, batch: TokenBatch) -> list[list[int]]:
        """Row lists of the forward passes over ``batch``: :func:`length_micro_batches` within
        ``micro_batch_tokens`` padded tokens per pass."""
        return length_micro_batches(batch.lengths(), self.micro_batch_tokens)

    def _forward(self, batch: TokenBatch, model=None, fused: bool | None = None) -> torch.Tensor:
        """Response-token log-probs ``[M, T]`` (float32) for a batch that fits one forward pass.

        ``fused`` (default: :attr:`fused_head`) scores through the chunked LM head
        (:mod:`graft_rl.policy.heads`); otherwise the logits of the response positions are built.
        """
        model = self.model if model is None else model
        fused = self.fused_head if fused is None else fused
        device = self.config.device
        seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
        L = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id
        inp = torch.full((len(seqs), L), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: positions start at 0 for every row
            inp[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        inp, attn = inp.to(device), attn.to(device)
        # only positions from the earliest response start on predict response tokens: skip the
        # prompt-only positions' logits (with long prompts they dominate the [B, L, V] tensor)
        starts = [len(p) - 1 for p in batch.prompt_ids]
        first = min(starts)
        targets = inp[:, first + 1 :]
        with self.compute_context():
            if fused:  # hidden state k (position first + k) predicts token first + k + 1
                with logprob_head(model, targets, self.config.logprob_chunk, self.logprob_temperature):
                    lp_all = model(
                        input_ids=inp, attention_mask=attn, use_cache=False, logits_to_keep=L - first
                    ).logits[..., 0]
            else:
                if self._keeps_logits:
                    logits = model(input_ids=inp, attention_mask=attn, use_cache=False, logits_to_keep=L - first).logits
                else:
                    logits = model(input_ids=inp, attention_mask=attn, use_cache=False).logits[:, first:]
                if self.logprob_temperature != 1.0:
                    logits = logits / self.logprob_temperature
                # logits[:, k] is position first + k and predicts token first + k + 1
                lp_all = token_logprobs_from_logits(logits[:, :-1], targets, self.config.logprob_chunk)
        T = batch.max_response_len
        rel = torch.tensor(starts, device=device) - first
        idx = (rel[:, None] + torch.arange(T, device=device)[None, :]).clamp(max=max(L - 2 - first, 0))
        mask = batch.response_mask().to(device)
        return lp_all.gather(1, idx) * mask

    @torch.no_grad()
    def token_logprobs(self, batch: TokenBatch, model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every response's log-probs under this policy: ``(logprobs [M, T], mask [M, T])`` on CPU, float32.

        Micro-batched by ``micro_batch_tokens``; no gradient. ``model`` scores with another
        module sharing this tokenizer (the frozen reference of :meth:`init_reference`).
        """
        T = batch.max_response_len
        out = torch.zeros(len(batch), T)
        for rows in self.passes(batch):
            lp = self._forward(batch.select(rows or [0]), model).cpu()
            if rows is not None:
                out[rows, : lp.shape[1]] = lp
        return self._gather_rows(out), batch.response_mask()

    # hooks a sharded policy overrides (policy.fsdp): which micro-batches this process runs, and
    # how per-process results combine. One process: all micro-batches, nothing to combine.
    def passes(self, batch: TokenBatch) -> list[list[int] | None]:
        """Row lists of the forward passes (micro-batches) this process runs over ``batch``, in order;
        ``None``: a padding pass of a sharded rank with no row in it (run it all the same, result unused)."""
        return self._micro_batches(batch)

    def _gather_rows(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Combine the rows each process scored into the full ``[M, T]`` matrix."""
        return logprobs

    def _reduce_sums(self, values: list[float]) -> list[float]:
        """Sum per-process scalars over the processes of this policy."""
        return values

    def reduce_stats(self, stats: StepStats) -> StepStats:
        """A step's statistics over the processes of this policy (every rank calls): sums summed, maxima
        the largest."""
        return stats

    # the receiver's update (graft_rl.engine.update) runs its own loop over passes and these
    def pass_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Response log-probs ``[m, T]`` of one forward pass, with gradient (inside an :meth:`optimiser_step`)."""
        return self._forward(batch)

    #: each micro-batch's loss is multiplied by this before backward (FSDP averages over ranks)
    loss_scale = 1.0

    def text_logprobs(self, problems: Sequence[str], responses: Sequence[str], finished: Sequence[bool] | None = None):
        """Convenience: :meth:`encode_texts` then :meth:`token_logprobs`."""
        finished = [True] * len(responses) if finished is None else finished
        return self.token_logprobs(self.encode_texts(problems, responses, finished))
