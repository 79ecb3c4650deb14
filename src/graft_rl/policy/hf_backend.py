"""The ``hf`` rollout backend: a KV-cached sampling loop over any transformers causal LM (CPU or GPU).

It samples from, and records the log-prob of each token under, the *sampling distribution*:
``log_softmax(top_p(top_k(logits / temperature)))``, renormalised after filtering. At
temperature 1, top-p 1, top-k 0 that is the model's own distribution, so scoring the
response again reproduces the generation log-probs (tested to 1e-4 in float32). Otherwise
the recorded log-probs are those of the tempered/truncated distribution, which is the
behaviour policy the compatibility score divides by (paper Section 4.2, :math:`\\pi_\\phi`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from graft_rl.policy.types import Sample, SamplingParams

__all__ = ["HFBackend", "sampling_logprobs", "GEN_MEMORY_BUDGET_BYTES", "kv_bytes_per_token", "auto_gen_batch_rows"]


#: Bytes of KV cache plus sampling logits one HF generate call may hold when ``gen_batch_size`` is
#: automatic (null): every row of a testbed step in one call, ~70 rows of SmolLM2-135M at 512 new tokens.
GEN_MEMORY_BUDGET_BYTES = 2 << 30


def kv_bytes_per_token(model) -> int | None:
    """KV-cache bytes one token takes in ``model`` (keys and values of every layer), or None if
    its config does not say (layers, key/value heads and head size under their usual names)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    elem = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * elem


def auto_gen_batch_rows(model, rows: int, tokens: int, vocab: int, budget: int = GEN_MEMORY_BUDGET_BYTES) -> int:
    """Rows per generate call so that ``tokens`` (longest prompt + new tokens) of KV cache and three
    float32 ``vocab``-wide sampling buffers per row fit ``budget``; all ``rows`` if they fit, 64 if
    the model's KV size is unknown."""
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        return min(rows, 64)
    per_row = tokens * per_token + 3 * 4 * vocab
    return max(1, min(rows, budget // per_row))


def sampling_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Log-probs ``[B, V]`` of the sampling distribution: temperature, then top-k, then top-p, renormalised.

    Filtered tokens get ``-inf``. Top-p keeps the smallest set of most likely tokens whose
    mass reaches ``top_p`` (the most likely token is always kept).
    """
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.log_softmax(-1)


def _cache_of(res):
    cache = res.get("cache")
    return cache if cache is not None else res.get("past_key_values")


#: Tokens a stop string may span (the text of a row's last STOP_WINDOW tokens is searched).
STOP_WINDOW = 8


class HFBackend:
    """KV-cached ancestral sampling with a transformers model (the trainer's own module)."""

    def __init__(
        self,
        model,
        eos_token_ids: list[int],
        pad_token_id: int,
        batch_size: int | None = None,
        compute_context=None,
        stop: list[str] | None = None,
        decode=None,
    ):
        self.model = model
        # stop strings: matched on the decoded text of a row's last STOP_WINDOW tokens after each token
        self.stop = list(stop or [])
        if self.stop and decode is None:
            raise ValueError("HFBackend: stop strings need the tokenizer's decode")
        self.decode = decode
        self.compute_context = compute_context or contextlib.nullcontext  # autocast under mixed precision
        self.eos = torch.tensor(sorted(set(eos_token_ids)))
        self.pad = pad_token_id
        self.batch_size = batch_size  # rows per generate call; None: auto_gen_batch_rows per call
        self.compact = True  # finished rows leave the decode batch (see _generate_batch)
        head = model.get_output_embeddings()  # vocabulary width of the sampling buffers (auto batch size)
        self._vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
        # transformers >= 5.2x names the KV cache `cache`; earlier versions `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def sync_weights(self) -> None:  # samples from the live module
        pass

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int) -> list[list[Sample]]:
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(sampling.n)]
        if not rows:
            return [[] for _ in prompt_ids]
        size = self.batch_size or auto_gen_batch_rows(
            self.model, len(rows), max(map(len, rows)) + sampling.max_new_tokens, self._vocab, GEN_MEMORY_BUDGET_BYTES
        )
        out: list[Sample] = []
        with self.compute_context():
            for s in range(0, len(rows), size):
                out.extend(self._generate_batch(rows[s : s + size], sampling, gen, device))
        n = sampling.n
        return [out[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _generate_batch(self, rows, sp: SamplingParams, gen, device) -> list[Sample]:
        """Sample ``rows`` (left-padded together) up to EOS or ``max_new_tokens``.

        Finished rows leave the batch (and the KV cache) once they are a quarter of it, so the
        decode steps of a step's long tail run on the rows still generating; with ``compact``
        off, or a cache that cannot select rows, every row runs to the end.
        """
        was_training = self.model.training
        self.model.eval()
        B, L = len(rows), max(len(r) for r in rows)
        inp = torch.full((B, L), self.pad, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            inp[i, L - len(r) :] = torch.tensor(r)
            attn[i, L - len(r) :] = 1
        inp, attn = inp.to(device), attn.to(device)
        eos = self.eos.to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=inp, attention_mask=attn, position_ids=pos, use_cache=True)
        past, logits = _cache_of(res), res.logits[:, -1]
        live = torch.arange(B, device=device)  # batch row -> index in `rows`
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        stopped_at = [None] * B  # the token of each row that completed a stop string
        tok_m = torch.full((B, sp.max_new_tokens), self.pad, dtype=torch.long, device=device)
        lp_m = torch.zeros((B, sp.max_new_tokens), device=device)
        steps = 0
        for step in range(sp.max_new_tokens):
            lp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k)
            tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
            tok_lp = lp.gather(1, tok[:, None]).squeeze(1)
            tok = torch.where(finished, torch.full_like(tok, self.pad), tok)
            tok_m[live, step] = tok
            lp_m[live, step] = tok_lp.float()
            steps = step + 1
            finished = finished | torch.isin(tok, eos)
            if self.stop:
                hit = self._stopped(tok_m, live, step, finished)
                for j in hit.nonzero().flatten().tolist():
                    stopped_at[int(live[j])] = step
                finished = finished | hit
            if bool(finished.all()) or step == sp.max_new_tokens - 1:
                break
            if self.compact and 4 * int(finished.sum()) >= len(finished) and hasattr(past, "batch_select_indices"):
                keep = (~finished).nonzero().squeeze(1)
                past.batch_select_indices(keep)
                live, attn, pos, tok, finished = live[keep], attn[keep], pos[keep], tok[keep], finished[keep]
            attn = torch.cat([attn, torch.ones((len(live), 1), dtype=attn.dtype, device=device)], dim=1)
            pos = pos[:, -1:] + 1
            res = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=pos, use_cache=True, **{self._cache_kw: past}
            )
            past, logits = _cache_of(res), res.logits[:, -1]
        if was_training:
            self.model.train()
        tok_m = tok_m[:, :steps].cpu()
        lp_m = lp_m[:, :steps].cpu()
        eos_cpu = self.eos
        samples = []
        for i in range(B):
            ids = tok_m[i].tolist()
            hit = torch.isin(tok_m[i], eos_cpu).nonzero()
            end = int(hit[0]) + 1 if hit.numel() else None
            if stopped_at[i] is not None:  # a stop string, completed before any EOS (the row stopped there)
                end = stopped_at[i] + 1
            if end is not None:
                samples.append(Sample(ids[:end], lp_m[i, :end].tolist(), "stop"))
            else:
                samples.append(Sample(ids, lp_m[i].tolist(), "length"))
        return samples

    def _stopped(self, tok_m: torch.Tensor, live: torch.Tensor, step: int, finished: torch.Tensor) -> torch.Tensor:
        """Rows of the decode batch whose token at ``step`` completes a stop string: one is in the
        text of their last :data:`STOP_WINDOW` tokens (an earlier window with one would have stopped
        the row already). Only those tokens are copied and decoded."""
        out = torch.zeros_like(finished)
        window = tok_m[live, max(0, step + 1 - STOP_WINDOW) : step + 1].tolist()
        for j, ids in enumerate(window):
            if not bool(finished[j]) and any(x in self.decode(ids) for x in self.stop):
                out[j] = True
        return out
