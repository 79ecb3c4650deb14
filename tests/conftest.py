from __future__ import annotations

import pytest

#: The fixtures of the run tests (tests/engine, tests/commands): tiny configs, fake rewards, Ray.
pytest_plugins = ["runs"]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Two tiny heterogeneous models: (Llama-like, byte tokenizer, ChatML) and (GPT-2-like, BPE, plain)."""
    from graft_rl.policy.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))
