"""The receiver's side of a method, on the receiver's worker (Section 4.2): which rows enter the loss,
the compatibility score and weight of each peer response, the minibatch order, and the loss.

The worker (``graft_rl.engine.worker``) encodes a :class:`~graft_rl.methods.exchange.ReceiverBatch` under
its policy and scores pi_old of the rows that need it; everything a method decides is here, through its parts:
the composition's ``keeps_cut``, the loss's ``loss_mask``, the weighting, the position of peer groups
(``method.position``), and the :class:`~graft_rl.methods.objectives.Objective`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch

from graft_rl import algo
from graft_rl.methods.batch import ReceiverBatch
from graft_rl.methods.config import MethodConfig
from graft_rl.methods.objectives import Objective, RowTensors
from graft_rl.methods.registry import COMPOSITIONS, WEIGHTINGS

__all__ = ["Receiver", "Weighed"]


@dataclass
class Weighed:
    """A receiver batch as its receiver sees it before any update: the loss mask, pi_old where computed,
    the peer rows (their compatibility ``(s_token, s_char)`` in ``compat``), each row's weight and
    whether it is in the loss."""

    mask: torch.Tensor
    old: torch.Tensor
    peer_rows: list[int]
    compat: dict[int, tuple[float, float]]
    weights: list[float]
    included: list[bool]


class Receiver:
    """A method's receiver-side parts, built from its config on the receiver's worker."""

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg
        self.composition = COMPOSITIONS.get(cfg.part_name("composition"))
        self.weighting = WEIGHTINGS.get(cfg.part_name("weighting"))
        self.objective = Objective(cfg)

    @property
    def keeps_peer_tokens(self) -> bool:
        """Peer rows stay in their source's token ids, with its per-token log-probs (the loss's
        ``peer_tokens``: one shared vocabulary, F-TIS); otherwise their text is re-tokenised."""
        return self.objective.loss.peer_tokens

    def token_mask(self, response_ids: list[list[int]], mask: torch.Tensor, eos_token_ids) -> torch.Tensor:
        """The response-token mask with the tokens the loss leaves out removed (its ``loss_mask``: HACPO's
        final EOS); ``mask`` is edited in place and returned."""
        if self.objective.loss.loss_mask is not None:
            self.objective.loss.loss_mask(response_ids, mask, eos_token_ids)
        return mask

    @staticmethod
    def peer_rows(batch: ReceiverBatch) -> list[int]:
        """Rows whose compatibility is scored: peer responses in the policy-gradient term (Section 4.2)."""
        return [i for i, r in enumerate(batch.rows) if r.is_peer and not r.is_aux]

    def weigh(self, batch: ReceiverBatch, old: torch.Tensor, mask: torch.Tensor, cut: list[int], gen) -> Weighed:
        """Weight the batch's peer rows (Section 4.2) from ``old``, pi_old, which holds the receiver's
        log-probs of every :meth:`peer_rows` row; ``cut``: peer rows longer than the receiver's budget, which
        leave the loss unless the composition keeps them. Draws from ``gen`` as the weighting part does."""
        weights = [r.weight for r in batch.rows]
        included = [r.include for r in batch.rows]
        for i in [] if self.composition.keeps_cut else cut:  # a peer response longer than this policy's
            included[i] = False  # budget: it could never have produced it, and the answer may be cut
        peer_rows = self.peer_rows(batch)
        recv_sum = (old * mask).sum(1)
        recv_mean = algo.mean_token_logprob(old, mask)
        compat: dict[int, tuple[float, float]] = {}
        for src in dict.fromkeys(batch.rows[i].source for i in peer_rows):
            rows = [i for i in peer_rows if batch.rows[i].source == src]
            src_mean = torch.tensor([batch.rows[i].src_mean_logprob for i in rows])
            s_tok = algo.compatibility_score(recv_mean[rows], src_mean)
            chars = torch.tensor([max(len(batch.rows[i].text), 1) for i in rows], dtype=torch.float32)
            src_sum = torch.tensor([batch.rows[i].src_logprob_sum for i in rows])
            s_chr = algo.per_char_compatibility_score(recv_sum[rows], src_sum, chars)
            if self.weighting.score == "sequence_ratio":  # an importance weight of the whole text (PRP)
                score = torch.exp(
                    (recv_sum[rows].double() - src_sum.double()).clamp(-algo.MAX_LOG_RATIO, algo.MAX_LOG_RATIO)
                )
            else:
                score = s_tok if self.cfg.compatibility == "token_mean" else s_chr
            w = self.weighting(score, self.cfg, gen)
            for i, wi, st, sc in zip(rows, w.tolist(), s_tok.tolist(), s_chr.tolist(), strict=True):
                weights[i] = wi
                compat[i] = (st, sc)
        return Weighed(mask, old, peer_rows, compat, weights, included)

    def records(self, batch: ReceiverBatch, w: Weighed) -> list[dict]:
        """One exchange record per peer row (``RUN_DIR/exchange``)."""
        return [
            {
                "prompt_id": r.prompt_id,
                "source": r.source,
                "group_index": r.index,
                "reward": r.reward,
                "advantage": r.advantage,
                "weight": w.weights[i],
                "compat_token": w.compat.get(i, (None, None))[0],
                "compat_char": w.compat.get(i, (None, None))[1],
                "included": w.included[i],
                "auxiliary": r.is_aux,
                "moved": "response",
            }
            for i, r in enumerate(batch.rows)
            if r.is_peer
        ]

    def order(self, batch: ReceiverBatch, minibatch: int, gen: torch.Generator) -> list[list[int]]:
        """The step's minibatches as row indices: prompt groups, peer groups placed by ``method.position``
        (peer-last by default, Section 4.2)."""
        group_rows = batch.group_rows()
        position = cast(Literal["last", "first", "uniform"], self.cfg.position)
        order = algo.minibatch_order(torch.tensor(batch.group_is_peer), minibatch, position, gen)
        return [[r for gi in mb.tolist() for r in group_rows[gi]] for mb in order]

    def later_rows(self, batch: ReceiverBatch, w: Weighed, first: list[int]) -> list[int]:
        """Rows whose pi_old is scored after weighing, still before the first update: in the loss, not in
        the first minibatch (``first``), and not scored already (peer rows were, for their compatibility)."""
        known, first_ = set(w.peer_rows), set(first)
        return [
            i for i, r in enumerate(batch.rows) if i not in first_ and i not in known and w.included[i] and not r.is_aux
        ]

    def tensors(
        self,
        batch: ReceiverBatch,
        w: Weighed,
        ref: torch.Tensor | None,
        first: list[int],
        response_ids: list[list[int]] | None = None,
        engine_logprobs: bool = True,
    ) -> RowTensors:
        """The per-row tensors the objective reads; rows of the first minibatch without pi_old take it
        from the update's own forward pass. ``engine_logprobs``: the own rows' engine log-probs (mu) are of
        the distribution the trainer computes (no top-p / top-k truncation at sampling), so their gap to
        pi_old is measured and corrected; ``response_ids``: the rows' tokens, which mu must match one to one."""
        rows = batch.rows
        known, first_ = set(w.peer_rows), set(first)
        extras = {
            key: [r.extras.get(key, 1.0) for r in rows] for key in dict.fromkeys(k for r in rows for k in r.extras)
        }
        mu, has_mu = None, None
        if engine_logprobs:
            mu, has_mu = torch.zeros(w.mask.shape), torch.zeros(len(rows), dtype=torch.bool)
            peer_tokens = self.keeps_peer_tokens
            for i, r in enumerate(rows):
                if (r.is_peer and not peer_tokens) or r.gen_logprobs is None:
                    continue
                n = len(r.gen_logprobs)
                tokens = n if response_ids is None else len(response_ids[i])
                # an own response: one log-prob per sampled token; a peer's may be cut at this receiver's budget
                if n != tokens and not (r.is_peer and n > tokens):
                    raise ValueError(
                        f"row {i} ({r.source}, prompt {r.prompt_id!r}): {n} engine log-probs for "
                        f"{tokens} tokens; a sampled response's log-probs are one per sampled token"
                    )
                n = min(tokens, mu.shape[1])
                mu[i, :n] = torch.tensor(r.gen_logprobs[:n], dtype=torch.float32)
                has_mu[i] = True
        return RowTensors(
            w.old,
            w.mask,
            [r.advantage for r in rows],
            w.weights,
            [r.is_peer for r in rows],
            w.included,
            [r.is_aux for r in rows],
            [r.src_mean_logprob for r in rows],
            ref,
            old_is_current=[i in first_ and i not in known for i in range(len(rows))],
            extras=extras,
            mu=mu,
            has_mu=has_mu,
        )
