"""What an exchange reports in each receiver's metric line (docs/metrics.md): how many prompts the
selection could and did take from each peer, the compatibility and admission of the peer rows
(Section 4.2; Table 9's inputs), and the per-family counts of the transfer testbed.
Nothing here changes a batch; the driver's :class:`~graft_rl.methods.exchange.Exchange` and the
receiver's worker call it."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from graft_rl import algo
from graft_rl.policy import RolloutGroup

if TYPE_CHECKING:
    from graft_rl.methods.batch import ReceiverBatch
    from graft_rl.methods.receiver import Weighed

__all__ = ["exchange_stats", "family_stats", "selection_stats", "swarm_stats"]


def selection_stats(
    receiver: str,
    k: Mapping[str, torch.Tensor],
    n: Mapping[str, int],
    chosen: Mapping[str, torch.Tensor],
    from_peer: Mapping[int, str],
) -> dict[str, float]:
    """``candidates_in``: prompts where the receiver's group failed and a peer's is mixed (GRAFT's
    complementary candidates, :func:`graft_rl.algo.complementary_mask`, counted per peer whatever the
    method's selection); ``exchanged_in``: prompts that took a peer's group; ``exchanged_from/<peer>``."""
    candidates = (
        sum(
            int(algo.complementary_mask(k_peer, k[receiver], n[peer]).sum())
            for peer, k_peer in k.items()
            if peer != receiver
        )
        if len(k) > 1
        else 0
    )
    stats = {"candidates_in": float(candidates), "exchanged_in": float(len(from_peer))}
    for peer in chosen:
        stats[f"exchanged_from/{peer}"] = float(sum(1 for p in from_peer.values() if p == peer))
    return stats


def swarm_stats(receiver: str, groups: Mapping[str, list[RolloutGroup]], batch_rows: list, found: dict) -> dict:
    """An unpaired exchange's counts (SAPO): ``candidates_in``, the external groups it could take (as the
    composition reports them in ``found``), ``exchanged_in``, the external groups in the batch, and
    ``exchanged_from/<peer>``; each external group counted once, by its source and prompt."""
    taken = {(r.source, r.prompt_id) for r in batch_rows if r.is_peer}
    stats = {"candidates_in": float(found.get("candidates_in", 0)), "exchanged_in": float(len(taken))}
    for peer in groups:
        if peer != receiver:
            stats[f"exchanged_from/{peer}"] = float(sum(1 for src, _ in taken if src == peer))
    return stats


def family_stats(batch: ReceiverBatch, family: Mapping[str, str], own: list[RolloutGroup]) -> dict:
    """Per prompt family (``subject``): own groups, own all-fail groups, prompts with peer data
    (grafted groups; SGT's auxiliary response), and grafted peer responses with those the gate
    admitted (weight > 0): counts, pooled by the report."""
    out: dict[str, float] = {}

    def add(key: str, fam: str, v: float = 1.0) -> None:
        out[f"{key}/{fam}"] = out.get(f"{key}/{fam}", 0.0) + v

    for g in own:
        fam = family[g.prompt_id]
        add("groups", fam)
        add("all_fail", fam, float(g.k == 0))
    for rows in batch.group_rows():
        if not any(batch.rows[i].is_peer for i in rows):  # no peer data for this prompt
            continue
        fam = family[batch.rows[rows[0]].prompt_id]
        add("grafted", fam)  # a grafted group, or SGT's auxiliary peer response
        peer = [batch.rows[i] for i in rows if batch.rows[i].is_peer and not batch.rows[i].is_aux]
        add("grafted_rows", fam, len(peer))
        add("admitted_rows", fam, sum(1 for r in peer if r.weight > 0))
    return out


def exchange_stats(batch: ReceiverBatch, w: Weighed) -> dict:
    """Compatibility and admission of the peer rows (Section 4.2; in source order)."""
    rows = batch.rows
    by_source = [
        i for src in dict.fromkeys(rows[i].source for i in w.peer_rows) for i in w.peer_rows if rows[i].source == src
    ]
    weights = [w.weights[i] for i in by_source]
    s_tok = [w.compat[i][0] for i in by_source]
    s_chr = [w.compat[i][1] for i in by_source]
    return {
        "admitted_frac": (sum(1 for x in weights if x > 0) / len(weights)) if weights else None,
        "peer_weight_mean": statistics.fmean(weights) if weights else None,
        "compat_token_median": statistics.median(s_tok) if s_tok else None,
        "compat_char_median": statistics.median(s_chr) if s_chr else None,
        "compat_token": [round(x, 5) for x in s_tok],
        "compat_char": [round(x, 5) for x in s_chr],
    }
