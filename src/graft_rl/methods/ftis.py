"""F-TIS, Filtered Truncated Importance Sampling (arXiv 2605.22537, beyond the paper), **from the
description, not the paper's equations**: only its abstract and summaries are readable here
(docs/fidelity.md, "Methods after the paper", lists every reading and the sentence it rests on).

"F-TIS combines Truncated Importance Sampling (TIS) with the filtering of negative advantage
off-policy samples via KL threshold into a unified GRPO loss"; "nodes only share generated tokens and
per-token log-probabilities". So it presumes one vocabulary: the run refuses a pair whose tokenizers
differ, in one line. Its parts:

- ``append_peers``: on every prompt the receiver trains on its own group and every peer's group, each
  with its source's GRPO advantages (the summary's advantage of "completions from a generator policy");
- the ``ftis`` loss (``peer_tokens``): a peer response stays in its sampler's token ids; each of its
  tokens is weighted by ``min(pi_old / mu, ftis_cap)``, and a response with a negative advantage whose
  KL(mu || pi_old) (k3, token mean) exceeds ``ftis_kl_threshold`` is filtered out
  (:func:`graft_rl.algo.ftis_token_weights`); the clipped token surrogate otherwise, as GRPO's;
- ``correction: tis``: the policy's own tokens get the same truncated weight against its own engine
  (the "pseudo-on-policy" gap between sampler and trainer the summary names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.methods.base import Method, register_method
from graft_rl.methods.config import check_range
from graft_rl.methods.exchange import ComposeContext, register_composition, rows_of
from graft_rl.methods.losses import LossContext, register_loss

__all__ = ["FTIS", "append_peers", "ftis_loss"]


@register_composition("append_peers", every_prompt=True)
def append_peers(own, peer, ctx: ComposeContext):
    """Own group, then every peer's group of the prompt, each with its source's advantages (a group of
    its own, placed by ``method.position``). A prompt the selection did not choose keeps its own group."""
    out = [(rows_of(own, ctx.gi, False, ctx.own_advantages(own)), False)]
    if peer is None or not ctx.selected:
        return out
    for g in ctx.peers.values() or [peer]:
        out.append((rows_of(g, ctx.gi + len(out), True, ctx.own_advantages(g)), True))
    return out


@dataclass
class FtisParams:
    ftis_cap: float = 2.0  # C: a peer token's weight is min(pi_old / mu, C) (a reading: TIS's C)
    ftis_kl_threshold: float = 0.1  # tau: a negative-advantage peer response with KL(mu||pi_old) > tau is dropped


def _check_ftis(cfg) -> None:
    check_range(cfg, {"ftis_cap": (0.0, math.inf, False), "ftis_kl_threshold": (0.0, math.inf, True)})


@register_loss("ftis", weighted=False, corrects=True, peer_tokens=True, Params=FtisParams, check=_check_ftis)
def ftis_loss(lp, old, mask, ctx: LossContext):
    """F-TIS's GRPO loss: the clipped token surrogate, token mean, each peer token weighted by its
    filtered truncated importance weight, each own token by the correction's weight (``tis``)."""
    c = ctx.cfg
    w = torch.ones_like(mask) if ctx.correction is None else ctx.correction[:, : mask.shape[1]].to(mask.dtype)
    peer = ctx.is_peer.bool()
    stats: dict = {}
    trained = torch.ones_like(mask)  # a filtered peer response is not trained: neither clipped nor counted
    if bool(peer.any()):
        if ctx.mu is None:
            raise RuntimeError("loss 'ftis': peer rows without their sampler's log-probs (top_p < 1?)")
        pw, kl, kept = algo.ftis_token_weights(
            old[peer], ctx.mu[peer], mask[peer], ctx.adv[peer], c.ftis_cap, c.ftis_kl_threshold
        )
        w = w.clone()
        w[peer] = pw.to(w.dtype)
        trained[peer] = kept.to(mask.dtype)[:, None].expand_as(mask[peer])
        # summed (``_total``) and maxed (``_peak``) over the step's passes: ftis_filtered, ftis_peer_responses, ftis_kl_max
        stats["ftis_filtered_total"] = float((~kept).sum())
        stats["ftis_peer_responses_total"] = float(peer.sum())
        stats["ftis_kl_max_peak"] = float(kl.max())
    loss, st = algo.policy_loss(lp, old, ctx.adv, mask, w, c.eps_low, c.eps_high)
    st.update(stats)
    st["clipped"] = algo.clipped_token_mask(lp, old, ctx.adv, mask, w, c.eps_low, c.eps_high)
    st["trained"] = trained
    return loss, st


@register_method("ftis")
class FTIS(Method):
    """Filtered truncated importance sampling over peers' sampled tokens (one vocabulary)."""

    preset = {
        **Method.preset,
        "selection": "all",
        "composition": "append_peers",
        "weighting": "none",
        "loss": "ftis",
        "correction": "tis",
    }
    source = "F-TIS (arXiv 2605.22537): from the description (abstract, summaries), not the paper's equations"
