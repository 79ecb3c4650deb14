from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Two tiny heterogeneous models: (Llama-like, byte tokenizer, ChatML) and (GPT-2-like, BPE, plain)."""
    from graft_rl.policy.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))
