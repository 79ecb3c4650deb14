from __future__ import annotations

import pytest

#: The fixtures of the run tests (tests/engine, tests/commands): tiny configs, fake rewards, Ray.
pytest_plugins = ["runs"]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Two tiny heterogeneous models: (Llama-like, byte tokenizer, ChatML) and (GPT-2-like, BPE, plain)."""
    from graft_rl.policy.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(autouse=True)
def _no_fake_vllm_left_behind():
    """A test that installs the fake vLLM (tests/policy/fake_vllm.py) in this process takes it out again:
    a stub left in ``sys.modules`` makes every later ``find_spec("vllm")`` raise, and ``importorskip``
    run tests meant for the real engine."""
    import sys

    yield
    left = sys.modules.get("vllm", False)
    if left is not False and (left is None or getattr(left, "__spec__", None) is None):
        del sys.modules["vllm"]
        for name in [m for m in sys.modules if m.startswith("vllm.")]:
            del sys.modules[name]
        pytest.fail("a fake 'vllm' module was left in sys.modules (use fake_vllm.install(monkeypatch))")
