"""Faults a test injects into a weight push after the trainer's digest was taken (issues 39, 62): shared by
the fake engine's tests (``test_push_verification.py``) and vLLM's CPU build (``test_vllm_backend.py``,
``test_vllm_architectures.py``)."""

from __future__ import annotations

import torch

#: Faults injected into a push after the trainer's digest: (fault, what the refusal names).
FAULTS = {
    "a decoder layer left out": (
        lambda s: [(n, t) for n, t in s if not n.startswith("model.layers.1.")],
        "model.layers.1.",
    ),
    "a tensor zeroed": (
        lambda s: [(n, torch.zeros_like(t) if n.endswith("mlp.up_proj.weight") else t) for n, t in s],
        "up_proj",
    ),
    "the tied alias left out": (
        lambda s: [(n, t) for n, t in s if n != "lm_head.weight"],
        "lm_head.weight was not pushed",
    ),
    "the tied alias zeroed": (
        lambda s: [(n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in s],
        r"lm_head.weight as pushed differs from the trainer's \(\d+ of \d+ rows\)",
    ),
}
