"""A policy unit: one model + its tokenizer + optimizer (docs/design.md, layer 3).

It formats prompts its own way (chat template, or plain text for base models), generates
groups through a rollout backend, scores any (prompt, response text) pair under its *own*
tokenisation, takes minibatch optimiser steps with micro-batching, and saves/loads itself
in ``save_pretrained`` format (so transformers and vLLM load checkpoints directly).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from graft_rl.data import prompt_chat
from graft_rl.policy.config import (
    _DTYPES,
    PolicyConfig,
    auto_micro_batch_tokens,
    uses_fused_head,
)
from graft_rl.policy.loading import load_model, load_policy_model, load_tokenizer, resolve_model
from graft_rl.policy.logprobs import PolicyLogprobs
from graft_rl.policy.rollout import make_backend
from graft_rl.policy.tokens import PromptTooLongError
from graft_rl.policy.training import PolicyTraining
from graft_rl.policy.types import PolicyError, RolloutGroup, SamplingParams, TokenBatch
from graft_rl.policy.vllm_backend import shield_from_vllm_patches

__all__ = ["Policy", "disable_dropout"]


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout: ``nn.Dropout`` modules and the float ``*dropout*`` attributes that
    attention layers read in train mode (so train mode, needed by gradient checkpointing, computes
    exactly what eval mode does)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr, val in list(vars(module).items()):
            if "dropout" in attr and isinstance(val, float):
                setattr(module, attr, 0.0)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for attr in list(vars(cfg)):
            if ("dropout" in attr or attr.endswith("pdrop")) and isinstance(getattr(cfg, attr), float):
                setattr(cfg, attr, 0.0)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class Policy(PolicyLogprobs, PolicyTraining):
    """One trainable model with its tokenizer, optimiser and rollout backend."""

    def __init__(self, config: PolicyConfig, with_reference: bool = False):
        """``with_reference``: load the frozen KL reference too (:meth:`init_reference`), before the
        rollout engine is built (see :func:`~graft_rl.policy.rollout.shield_from_vllm_patches`)."""
        _quiet_transformers()
        self.config = config
        self.name = config.name
        path, gguf = resolve_model(config.name, config.model, config.gguf_file)
        self.model_dir = path
        tok_path = Path(config.tokenizer) if config.tokenizer else path
        if not path.exists():  # a hub id: keep it a string for transformers
            path = config.model  # type: ignore[assignment]
            tok_path = config.tokenizer or config.model  # type: ignore[assignment]
        try:
            self.tokenizer = load_tokenizer(tok_path, gguf if not config.tokenizer else None)
        except Exception as exc:
            where = f"{tok_path}" + (f" (gguf_file={gguf})" if gguf and not config.tokenizer else "")
            raise PolicyError(
                f"policy {config.name!r}: no usable tokenizer at {where}: {type(exc).__name__}: {exc}"
            ) from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if config.prompt_format == "chat" and not self.tokenizer.chat_template:
            raise PolicyError(
                f"policy {config.name!r}: prompt_format 'chat' but the tokenizer at {tok_path} has no chat template"
            )
        self.compute_dtype = _DTYPES[config.dtype]
        self.master_dtype = _DTYPES[config.master_dtype]
        # a LoRA policy (policies.N.lora, or a saved adapter): `lora` is the peft model around `model`,
        # `base` the frozen base's {model, gguf_file, digest} (policy.lora, policy.loading)
        loaded = load_policy_model(config, Path(path), gguf, self.compute_dtype, self.master_dtype)
        self.model, self.lora, self.base = loaded.model, loaded.lora, loaded.base
        self.model_dir = loaded.model_dir or self.model_dir
        if loaded.settings is not config.lora:
            self.config = replace(config, lora=loaded.settings)
        self.model.to(config.device)
        # no dropout anywhere: log-probs must be deterministic functions of the weights, in eval
        # mode and in the train mode that gradient checkpointing needs
        disable_dropout(self.model)
        self.model.eval()
        if config.gradient_checkpointing:
            if not getattr(self.model, "supports_gradient_checkpointing", False):
                raise PolicyError(
                    f"policy {config.name!r}: {type(self.model).__name__} does not support gradient_checkpointing"
                )
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.use_chat = config.prompt_format == "chat" or (
            config.prompt_format == "auto" and bool(self.tokenizer.chat_template)
        )
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
        self.weights_version, self._synced_version = 0, 0  # optimiser steps taken / pushed to the rollout engine
        # logits are divided by this before every log-softmax that scores or trains (docs/fidelity.md: the
        # rollout temperature, as verl does), so ratios and compatibility use the sampling distribution
        self.logprob_temperature = 1.0
        self._setup_parallel()
        self.fused_head = (
            uses_fused_head(config.fused_logprobs, vocab, self.micro_batch_tokens)
            and self._keeps_logits
            and self._fused_head_matches()
        )
        if with_reference:
            self.init_reference()
        self.backend = make_backend(config.backend, self)
        if config.backend == "vllm":  # the engine may have patched this process's transformers classes
            shield_from_vllm_patches(self.model, self.reference, getattr(self, "rollout_model", None))

    def _setup_parallel(self) -> None:
        """Hook for sharded subclasses (FSDP2): called after the model is built, before any forward."""
        if self.config.world_size > 1:
            raise PolicyError(
                f"policy {self.name!r}: world_size={self.config.world_size} needs execution: ray "
                "(each rank a Ray actor; see README 'Paper scale')"
            )

    def compute_context(self):
        """Autocast to the compute dtype when the master weights are float32 (mixed precision)."""
        return self.autocast_context()

    def autocast_context(self):
        """Autocast to the compute dtype when the master weights are float32; the ``hf`` rollout copy
        of a sharded policy (float32, unsharded) samples under it too."""
        if self.compute_dtype == self.master_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.config.device).type, dtype=self.compute_dtype)

    @torch.no_grad()
    def _fused_head_matches(self) -> bool:
        """Self-check of the chunked LM head on a fixed input: equal to the model's own logits?

        False for models that transform logits after the head (e.g. final soft-capping); those
        score through ``logits_to_keep`` and a chunked log-softmax instead.
        """
        head = self.model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.weight.shape[0] < 2:
            return False
        ids = torch.arange(1, 9).remainder(head.weight.shape[0])[None].to(self.config.device)
        batch = TokenBatch([ids[0, :3].tolist()], [ids[0, 3:].tolist()])
        naive = self._forward(batch, fused=False)
        fused = self._forward(batch, fused=True)
        tol = 1e-4 if self.compute_dtype == torch.float32 else 5e-2
        return bool(torch.allclose(naive, fused, atol=tol, rtol=0))

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
        chat = prompt_chat(problem, self.config.prompt_suffix)
        if self.use_chat:
            if self.config.system_prompt and chat[0]["role"] != "system":
                chat = [{"role": "system", "content": self.config.system_prompt}, *chat]
            return self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        # plain format (no system prompt, as before): a chat prompt's turns, one paragraph each
        return self.config.plain_template.replace("{prompt}", "\n\n".join(m["content"] for m in chat))

    def context_length(self) -> int | None:
        """The model's context in tokens (``max_position_embeddings`` / ``n_positions``), if it states one."""
        c = getattr(getattr(self, "model", None), "config", None)
        return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)

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
        self, prompts: Sequence[tuple[str, str]], sampling: SamplingParams, seed: int = 0, lag: int | None = None
    ) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for each ``(prompt_id, problem)``; ``lag``: a training generation's
        ``rollout.lag`` (from the weights of ``lag`` pushes earlier, :meth:`sampling_weights`); None for any
        other generation (validation, eval), which samples the current weights."""
        ids = [self.prompt_token_ids(p, pid) for pid, p in prompts]
        ctx = self.context_length()
        if ctx is not None and ids and max(map(len, ids)) + sampling.max_new_tokens > ctx:
            # a response never runs past the model's positions (a learned-position model would index out
            # of its table); the rows stop at the context with finish_reason "length", as in vLLM
            left = ctx - max(map(len, ids))
            if left < 1:
                raise PromptTooLongError(
                    f"policy {self.name!r}: a prompt has {max(map(len, ids))} tokens, "
                    f"over the model's {ctx}-token context"
                )
            sampling = replace(sampling, max_new_tokens=left)
        with self.sampling_weights(lag):  # one weight push per step, not one per minibatch update
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

    def encode_texts(
        self, problems: Sequence[str], responses: Sequence[str], finished: Sequence[bool], max_tokens: int | None = None
    ) -> TokenBatch:
        """Re-tokenise response *texts* after this policy's own prompt formatting (docs/fidelity.md, re-tokenisation).

        EOS: a response that stopped on its own gets *this* policy's EOS appended
        (:meth:`end_token_ids`: its chat end-of-turn token under a chat template, its first stop
        string if it has any and the text does not end in one already), because the source's stop token does not survive
        decoding to text, and without it a finished answer would read to the receiver as a cut-off
        prefix: the receiver learns to stop where the source stopped, as its own finished responses
        do. A truncated response gets none.

        Length: a response is cut to ``max_tokens`` (the receiver's own ``max_new_tokens``) and to
        what the model's context leaves after the prompt, tokens counted in *this* tokenizer (a
        peer's 4,096 tokens can be more here). A cut response has no EOS; :attr:`TokenBatch.cut`
        lists the cut rows (the trainer leaves them out of the loss).
        """
        if not (len(problems) == len(responses) == len(finished)):
            raise PolicyError("encode_texts: problems, responses and finished differ in length")
        cache: dict[str, list[int]] = {}
        end = self.end_token_ids()
        ctx = self.context_length()
        prompt_ids, response_ids, cut = [], [], []
        for row, (prob, text, done) in enumerate(zip(problems, responses, finished, strict=True)):
            if prob not in cache:
                cache[prob] = self.prompt_token_ids(prob)
            ends = done and not (
                self.config.stop and text.endswith(tuple(self.config.stop))
            )  # ends in a stop string already
            ids = self.tokenizer(text, add_special_tokens=False).input_ids + (end if ends else [])
            cap = min(max_tokens or len(ids), (ctx - len(cache[prob])) if ctx else len(ids))
            if len(ids) > cap:
                ids = ids[: max(cap, 0)]
                cut.append(row)
            prompt_ids.append(cache[prob])
            response_ids.append(ids)
        return TokenBatch(prompt_ids, response_ids, cut)

    def end_token_ids(self) -> list[int]:
        """What this policy ends its own responses with: its first ``stop`` string's tokens if it has
        any, else its chat end-of-turn token under a chat template, else its EOS."""
        if self.config.stop:
            return self.tokenizer(self.config.stop[0], add_special_tokens=False).input_ids
        return [self._chat_eos() if self.use_chat else self.tokenizer.eos_token_id]

    def _chat_eos(self) -> int:
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end in self.eos_token_ids:
            return im_end
        return self.tokenizer.eos_token_id

    def init_reference(self) -> None:
        """Load the frozen KL reference: ``config.reference_model`` if set (a resumed run's original
        model), else a copy of the weights as loaded (call before any update)."""
        import copy

        if self.reference is not None or self.lora is not None:  # LoRA: the base, adapter disabled
            return
        if self.config.reference_model:
            path, gguf = resolve_model(self.name, self.config.reference_model, self.config.reference_gguf_file)
            where = path if path.exists() else self.config.reference_model
            ref = load_model(self.name, where, gguf, self.master_dtype).to(self.config.device)
        else:
            ref = copy.deepcopy(self.model)
        self.reference = ref.eval().requires_grad_(False)

    def reference_logprobs(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_logprobs` under the frozen reference (:meth:`init_reference` first); a LoRA
        policy's reference is its own model with the adapter disabled (no second copy)."""
        if self.lora is not None:
            with self.lora.disable_adapter():
                return self.token_logprobs(batch)
        if self.reference is None:
            raise PolicyError(f"policy {self.name!r}: no reference model; call init_reference() before training")
        return self.token_logprobs(batch, self.reference)
