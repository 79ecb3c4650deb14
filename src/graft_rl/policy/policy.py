"""A policy unit: one model + its tokenizer + optimizer (SPEC §4 layer 3).

It formats prompts its own way (chat template, or plain text for base models), generates
groups through a rollout backend, scores any (prompt, response text) pair under its *own*
tokenisation, takes minibatch optimiser steps with micro-batching, and saves/loads itself
in ``save_pretrained`` format (so transformers and vLLM load checkpoints directly).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graft_rl.data import PROMPT_SUFFIX, make_prompt
from graft_rl.policy import zoo
from graft_rl.policy.rollout import make_backend
from graft_rl.policy.types import RolloutGroup, SamplingParams, TokenBatch

__all__ = ["Policy", "PolicyConfig", "PolicyError", "PromptTooLongError", "auto_micro_batch_tokens", "token_logprobs_from_logits"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyError(ValueError):
    """A policy that cannot be built as configured; the message names the field or path."""


class PromptTooLongError(PolicyError):
    pass


@dataclass(frozen=True)
class PolicyConfig:
    """Everything that defines one policy. Optimiser defaults are the paper's Table 3."""

    name: str
    model: str  # a save_pretrained directory, or a GGUF file / directory with gguf_file
    gguf_file: str | None = None  # GGUF file name inside `model` (or None)
    tokenizer: str | None = None  # tokenizer directory if not beside the model
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"
    prompt_format: str = "auto"  # auto (chat if the tokenizer has a template) | chat | plain
    plain_template: str = "{prompt}\n"  # used by `plain`; {prompt} is the problem + suffix
    system_prompt: str | None = None
    prompt_suffix: str | None = PROMPT_SUFFIX
    max_prompt_tokens: int = 2048
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    # padded (sequences x length) tokens per forward pass; None = from the vocabulary size, so the
    # logits of one pass stay near LOGITS_BUDGET_BYTES (16384 for small vocabularies, ~1k for Gemma's 262k)
    micro_batch_tokens: int | None = None
    logprob_chunk: int = 512  # positions per log-softmax chunk (bounds memory with large vocabularies)
    gen_batch_size: int = 64
    # the KL reference (method.kl_coef > 0): None = the weights this policy starts from; a resumed
    # run points it at the original model so the reference stays the initial policy
    reference_model: str | None = None
    reference_gguf_file: str | None = None
    backend: str = "hf"  # hf | vllm
    vllm_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise PolicyError(f"policy {self.name!r}: dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.prompt_format not in ("auto", "chat", "plain"):
            raise PolicyError(f"policy {self.name!r}: prompt_format must be auto, chat or plain, got {self.prompt_format!r}")
        if "{prompt}" not in self.plain_template:
            raise PolicyError(f"policy {self.name!r}: plain_template must contain {{prompt}}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise PolicyError(f"policy {self.name!r}: micro_batch_tokens must be >= 1 (or null for automatic), got {self.micro_batch_tokens}")


#: Bytes of float32 logits one forward pass may produce when ``micro_batch_tokens`` is automatic.
LOGITS_BUDGET_BYTES = 1 << 30


def auto_micro_batch_tokens(vocab_size: int, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
    """Padded tokens per forward pass so that ``tokens x vocab`` float32 logits fit ``budget_bytes``.

    Clamped to [512, 16384]: e.g. 16384 for the testbed's 38-320 token vocabularies, 5461 for
    SmolLM2's 49k, 1024 for Gemma 3's 262k.
    """
    return max(512, min(16384, budget_bytes // (4 * max(vocab_size, 1))))


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


def _is_hub_id(name: str) -> bool:
    """``org/name`` (a Hugging Face hub id, fetched by transformers where a network allows it)."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not Path(name.split("/")[0]).exists()


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class Policy:
    """One trainable model with its tokenizer, optimiser and rollout backend."""

    def __init__(self, config: PolicyConfig):
        from transformers import AutoTokenizer

        _quiet_transformers()
        self.config = config
        self.name = config.name
        path, gguf = self._resolve(config.model, config.gguf_file)
        self.model_dir = path
        tok_path = Path(config.tokenizer) if config.tokenizer else path
        if not path.exists():  # a hub id: keep it a string for transformers
            path = config.model  # type: ignore[assignment]
            tok_path = config.tokenizer or config.model  # type: ignore[assignment]
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_path, gguf_file=gguf if not config.tokenizer else None)
        except Exception as exc:
            where = f"{tok_path}" + (f" (gguf_file={gguf})" if gguf and not config.tokenizer else "")
            raise PolicyError(f"policy {config.name!r}: no usable tokenizer at {where}: {type(exc).__name__}: {exc}") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if config.prompt_format == "chat" and not self.tokenizer.chat_template:
            raise PolicyError(f"policy {config.name!r}: prompt_format 'chat' but the tokenizer at {tok_path} has no chat template")
        self.model = self._load_model(path, gguf)
        self.model.to(config.device)
        self.model.eval()  # no dropout: log-probs must be deterministic functions of the weights
        self.use_chat = config.prompt_format == "chat" or (config.prompt_format == "auto" and bool(self.tokenizer.chat_template))
        self.eos_token_ids = self._eos_ids()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=tuple(config.betas),
            weight_decay=config.weight_decay,
        )
        head = self.model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else len(self.tokenizer)
        self.micro_batch_tokens = config.micro_batch_tokens or auto_micro_batch_tokens(vocab)
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.reference = None  # the frozen KL reference, once init_reference() ran
        self.backend = make_backend(config.backend, self)

    def _resolve(self, model: str, gguf: str | None) -> tuple[Path, str | None]:
        """``(directory, gguf file or None)`` of a model path, GGUF file, ``zoo:`` name or hub id."""
        try:
            path = Path(zoo.resolve(model)).expanduser()
        except FileNotFoundError as exc:
            raise PolicyError(f"policy {self.name!r}: {exc}") from None
        if not path.exists() and not _is_hub_id(model):
            raise PolicyError(f"policy {self.name!r}: model path {model!r} does not exist")
        if gguf is None and path.is_file() and path.suffix == ".gguf":
            path, gguf = path.parent, path.name
        return path, gguf

    def _load_model(self, path, gguf: str | None):
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=_DTYPES[self.config.dtype])
        except Exception as exc:
            raise PolicyError(f"policy {self.name!r}: cannot load model from {path}: {type(exc).__name__}: {exc}") from None
        if gguf:  # a dequantised GGUF model: drop the quantizer marker so save_pretrained works
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.is_quantized = False
        return model

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(gen_eos)
        if self.use_chat:
            im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
                ids.add(im_end)
        return sorted(i for i in ids if i is not None)

    # ------------------------------------------------------------------ prompts
    def format_prompt(self, problem: str) -> str:
        """The full text this model is conditioned on: chat template or plain template."""
        user = make_prompt(problem, self.config.prompt_suffix)
        if self.use_chat:
            msgs = ([{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []) + [
                {"role": "user", "content": user}
            ]
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.config.plain_template.replace("{prompt}", user)

    def prompt_token_ids(self, problem: str, prompt_id: str = "") -> list[int]:
        text = self.format_prompt(problem)
        ids = self.tokenizer(text, add_special_tokens=not self.use_chat).input_ids
        if len(ids) > self.config.max_prompt_tokens:
            raise PromptTooLongError(
                f"policy {self.name!r}: prompt {prompt_id or problem[:40]!r} has {len(ids)} tokens, "
                f"over max_prompt_tokens={self.config.max_prompt_tokens}"
            )
        return ids

    # ------------------------------------------------------------------ rollouts
    def generate(
        self, prompts: Sequence[tuple[str, str]], sampling: SamplingParams, seed: int = 0
    ) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for each ``(prompt_id, problem)``."""
        ids = [self.prompt_token_ids(p, pid) for pid, p in prompts]
        samples = self.backend.generate(ids, sampling, seed)
        groups = []
        for (pid, problem), group in zip(prompts, samples, strict=True):
            groups.append(
                RolloutGroup(
                    prompt_id=pid,
                    prompt=problem,
                    policy=self.name,
                    texts=[self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group],
                    token_ids=[s.token_ids for s in group],
                    gen_logprobs=[s.logprobs for s in group],
                    finish_reasons=[s.finish_reason for s in group],
                )
            )
        return groups

    # ------------------------------------------------------------------ tokenisation
    def encode_own(self, groups: Sequence[RolloutGroup]) -> TokenBatch:
        """This policy's own responses with their generated token ids (no re-tokenisation)."""
        prompts, responses = [], []
        for g in groups:
            if g.policy != self.name:
                raise PolicyError(f"policy {self.name!r}: encode_own got a group generated by {g.policy!r}")
            p = self.prompt_token_ids(g.prompt, g.prompt_id)
            prompts.extend([p] * g.n)
            responses.extend(g.token_ids)
        return TokenBatch(prompts, responses)

    def encode_texts(self, problems: Sequence[str], responses: Sequence[str], finished: Sequence[bool]) -> TokenBatch:
        """Re-tokenise response *texts* after this policy's own prompt formatting (SPEC §2).

        A response that stopped on its own gets this policy's EOS appended (the receiver
        learns to stop there too); a truncated one does not.
        """
        if not (len(problems) == len(responses) == len(finished)):
            raise PolicyError("encode_texts: problems, responses and finished differ in length")
        cache: dict[str, list[int]] = {}
        eos = self._chat_eos() if self.use_chat else self.tokenizer.eos_token_id
        prompt_ids, response_ids = [], []
        for prob, text, done in zip(problems, responses, finished, strict=True):
            if prob not in cache:
                cache[prob] = self.prompt_token_ids(prob)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompt_ids.append(cache[prob])
            response_ids.append(ids + [eos] if done else ids)
        return TokenBatch(prompt_ids, response_ids)

    def _chat_eos(self) -> int:
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end in self.eos_token_ids:
            return im_end
        return self.tokenizer.eos_token_id

    # ------------------------------------------------------------------ log-probs
    def _micro_batches(self, batch: TokenBatch) -> list[list[int]]:
        budget = self.micro_batch_tokens
        out, cur, cur_max = [], [], 0
        for i in range(len(batch)):
            length = len(batch.prompt_ids[i]) + len(batch.response_ids[i])
            new_max = max(cur_max, length)
            if cur and new_max * (len(cur) + 1) > budget:
                out.append(cur)
                cur, new_max = [], length
            cur.append(i)
            cur_max = new_max
        if cur:
            out.append(cur)
        return out

    def _forward(self, batch: TokenBatch, model=None) -> torch.Tensor:
        """Response-token log-probs ``[M, T]`` (float32) for a batch that fits one forward pass."""
        model = self.model if model is None else model
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
        if self._keeps_logits:
            logits = model(input_ids=inp, attention_mask=attn, use_cache=False, logits_to_keep=L - first).logits
        else:
            logits = model(input_ids=inp, attention_mask=attn, use_cache=False).logits[:, first:]
        # logits[:, k] is position first + k and predicts token first + k + 1
        lp_all = token_logprobs_from_logits(logits[:, :-1], inp[:, first + 1 :], self.config.logprob_chunk)
        T = batch.max_response_len
        rel = torch.tensor(starts, device=device) - first
        idx = (rel[:, None] + torch.arange(T, device=device)[None, :]).clamp(max=max(L - 2 - first, 0))
        mask = batch.response_mask().to(device)
        return lp_all.gather(1, idx) * mask

    @torch.no_grad()
    def token_logprobs(self, batch: TokenBatch, model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score every response under this policy: ``(logprobs [M, T], mask [M, T])`` on CPU, float32.

        Micro-batched by ``micro_batch_tokens``; no gradient. ``model`` scores with another
        module sharing this tokenizer (the frozen reference of :meth:`init_reference`).
        """
        T = batch.max_response_len
        out = torch.zeros(len(batch), T)
        for rows in self._micro_batches(batch):
            lp = self._forward(batch.select(rows), model).cpu()
            out[rows, : lp.shape[1]] = lp
        return out, batch.response_mask()

    def init_reference(self) -> None:
        """Load the frozen KL reference: ``config.reference_model`` if set (a resumed run's original
        model), else a copy of the weights as loaded (call before any update)."""
        import copy

        if self.reference is not None:
            return
        if self.config.reference_model:
            path, gguf = self._resolve(self.config.reference_model, self.config.reference_gguf_file)
            ref = self._load_model(path if path.exists() else self.config.reference_model, gguf).to(self.config.device)
        else:
            ref = copy.deepcopy(self.model)
        self.reference = ref.eval().requires_grad_(False)

    def reference_logprobs(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_logprobs` under the frozen reference (:meth:`init_reference` first)."""
        if self.reference is None:
            raise PolicyError(f"policy {self.name!r}: no reference model; call init_reference() before training")
        return self.token_logprobs(batch, self.reference)

    def score_texts(self, problems: Sequence[str], responses: Sequence[str], finished: Sequence[bool] | None = None):
        """Convenience: :meth:`encode_texts` then :meth:`token_logprobs`."""
        finished = [True] * len(responses) if finished is None else finished
        return self.token_logprobs(self.encode_texts(problems, responses, finished))

    # ------------------------------------------------------------------ optimisation
    def update(
        self,
        batch: TokenBatch,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, list[int]], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """One optimiser step on a minibatch, with gradient accumulation over micro-batches.

        ``loss_fn(logprobs [m, T_m], mask [m, T_m], rows)`` returns this micro-batch's
        *contribution* to the minibatch loss (the caller scales token-mean losses by
        ``micro tokens / minibatch tokens``) and a stats dict. A non-finite loss or gradient
        norm skips the step (``skipped = 1``) and leaves the weights untouched.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, stats_sum, n_micro, bad = 0.0, {}, 0, False
        for rows in self._micro_batches(batch):
            sub = batch.select(rows)
            lp = self._forward(sub)
            loss, stats = loss_fn(lp, sub.response_mask().to(lp.device), rows)
            if not torch.isfinite(loss):
                bad = True
                break
            loss.backward()
            total_loss += float(loss.detach())
            n_micro += 1
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)) if params else 0.0
        if bad or not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return {"loss": float("nan"), "grad_norm": grad_norm, "skipped": 1.0}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.sync_weights()
        out = {k: v / max(n_micro, 1) for k, v in stats_sum.items()}
        out.update(loss=total_loss, grad_norm=grad_norm, skipped=0.0)
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, out_dir: str | Path) -> Path:
        """``save_pretrained`` model + tokenizer, plus ``policy_state.pt`` (optimiser, RNG)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        tmp = out / "policy_state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, out / "policy_state.pt")
        return out

    def load_state(self, ckpt_dir: str | Path) -> None:
        """Restore optimiser and RNG from :meth:`save` (weights come from loading the directory)."""
        state = torch.load(Path(ckpt_dir) / "policy_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
