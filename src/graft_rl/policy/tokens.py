"""A policy's prompt lengths from text sizes alone: how many tokens a text of ``b`` UTF-8 bytes can
become under a tokenizer (:func:`token_factor`) and a policy's template (:func:`prompt_bound`), so
that only prompts that could reach a limit are tokenised (:mod:`graft_rl.engine.prompts`)."""

from __future__ import annotations

from graft_rl.policy.types import PolicyError

__all__ = ["PromptTooLongError", "token_factor", "prompt_bound", "vocab_digest"]


class PromptTooLongError(PolicyError):
    pass


#: Normalisers after which a text's UTF-8 bytes grow at most threefold (NFC's bound; a replacement
#: by no more characters than it replaces; a prefix); others (NFKC, NFKD, NFD, BERT's) may grow more.
_BOUNDED_NORMALIZERS = {"NFC", "Lowercase", "Strip", "Prepend", "Replace"}


def token_factor(tokenizer) -> int | None:
    """``k`` such that a text of ``b`` UTF-8 bytes has at most ``k * b`` tokens (plus what a
    post-processor adds): every token of a byte-level, BPE, WordPiece, Unigram or WordLevel model
    covers at least one character or one byte of the normalised text, so ``k`` is 1 without a
    normaliser and 3 after one of :data:`_BOUNDED_NORMALIZERS`; None where no bound is known (a slow
    tokenizer, another normaliser)."""
    import json as _json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = _json.loads(backend.to_str()).get("normalizer")
    kinds = []
    stack = [spec]
    while stack:
        n = stack.pop()
        if not n:
            continue
        if n.get("type") == "Sequence":
            stack.extend(n.get("normalizers", []))
            continue
        if n.get("type") == "Replace":
            pattern = (n.get("pattern") or {}).get("String")
            if pattern is None or len(n.get("content", "")) > len(pattern):
                return None
        kinds.append(n.get("type"))
    if not kinds:
        return 1
    return 3 if set(kinds) <= _BOUNDED_NORMALIZERS else None


def prompt_bound(policy) -> dict:
    """What bounds a policy's prompt lengths from text sizes alone: a prompt of ``b`` UTF-8 bytes has
    at most ``factor * (overhead + b) + slack`` tokens (:func:`token_factor`; ``overhead``: the
    template's and suffix's bytes, measured), so only prompts whose bound reaches a limit need
    tokenising (:mod:`graft_rl.engine.prompts`). ``factor`` None: no such bound (a slow tokenizer, an
    expanding normaliser, a template that rewrites or escapes the problem); every prompt is tokenised."""
    sizes = []
    for text in ("graft sentinel 1", 'graft "sentinel" <2> & \\ é\n\t x'):  # escaping templates differ
        sizes.append(len(policy.format_prompt(text).encode()) - len(text.encode()))
    verbatim = sizes[0] == sizes[1]
    return {
        "overhead": max(sizes) + 1,  # + 1: a template that trims the problem keeps fewer bytes, never more
        "factor": token_factor(policy.tokenizer) if verbatim else None,
        "slack": 8,  # special tokens a post-processor adds, a prefix space
        "context": policy.context_length(),
        "max_prompt_tokens": policy.config.max_prompt_tokens,
    }


def vocab_digest(tokenizer) -> str:
    """SHA-256 of a tokenizer's vocabulary (every token and its id, added tokens included): two
    tokenizers with one digest map text pieces to the same ids, so a token id sampled by one policy
    means the same to the other (what a loss reading peers' token ids requires)."""
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
