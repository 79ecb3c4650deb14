"""Shared by the run tests (tests/engine, tests/commands): tiny configs and data, deterministic fake
rewards, a local Ray; loaded by tests/conftest.py as a plugin."""

from __future__ import annotations

import json

import pytest

from graft_rl.engine.config import load_config
from graft_rl.engine.rollouts import Rollouts
from graft_rl.policy import RolloutGroup

# success counts per policy per prompt (n = 4): reward(policy, q, i) = 1 if i < K[policy][q]
K = {
    "A": [1, 0, 2, 0, 4, 3, 0, 0],
    "B": [0, 1, 0, 0, 0, 0, 4, 2],
    "C": [0, 0, 3, 0, 0, 1, 0, 3],
}
# GRAFT between A and B: candidates A->B {q0, q2, q5}, B->A {q1, q7}; m = 2;
# balanced A->B keeps the two largest k_A: {q2 (2), q5 (3)}; B->A keeps {q1, q7}.
EXPECTED_A_TO_B = {"q2", "q5"}
EXPECTED_B_TO_A = {"q1", "q7"}


def fake_verify(self, groups):
    """Deterministic rewards by (policy, prompt, response index), bypassing the verifier."""
    for g in groups:
        q = int(g.prompt_id[1:])
        k = K.get(g.policy, K["A"])[q]
        g.rewards = [1.0 if i < k else 0.0 for i in range(g.n)]
    return {"verify_timeouts": 0, "verify_errors": 0}


@pytest.fixture
def fake_rewards(monkeypatch):

    monkeypatch.setattr(Rollouts, "verify_groups", fake_verify)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "arith.jsonl"
    p.write_text(
        "".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    return p


@pytest.fixture(scope="session")
def tiny_trio(tmp_path_factory, tiny_pair):
    from graft_rl.policy.tiny import build_tiny_model, char_tokenizer

    c = build_tiny_model(tmp_path_factory.mktemp("trio") / "c", "gpt2", char_tokenizer(chat_template=None), seed=7)
    return (*tiny_pair, c)


def cfg_maker(root, tiny_pair, tiny_data):
    """``make(method, steps, run, policies, **keys)``: a config of the two tiny models on the tiny data, in ``root/run``."""

    def make(method: dict | None = None, steps: int = 2, run: str = "run", policies=None, **kw):
        data = {
            "run_dir": str(root / run),
            "steps": steps,
            "prompt_batch": 8,
            "minibatch": 2,
            "n": 4,
            "max_new_tokens": 8,
            "checkpoint_every": 1,
            "data": {"train": str(tiny_data)},
            "method": method or {"name": "graft"},
            "policies": policies
            or [
                {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
                {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3},
            ],
        }
        data.update(kw)
        return load_config(data)

    return make


@pytest.fixture
def make_cfg(tmp_path, tiny_pair, tiny_data):
    return cfg_maker(tmp_path, tiny_pair, tiny_data)


@pytest.fixture(scope="module")
def ray_local():
    """A local 2-CPU Ray cluster for the tests of one module (skipped where Ray is not installed)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def quick_eval_args(run_dir, data) -> list[str]:
    """`graft eval` of a run on ``data`` at the smallest settings: 1 sample, 1 run, 4 new tokens."""
    return ["eval", str(run_dir), "--benchmarks", str(data), "--samples", "1", "--runs", "1", "--max-new-tokens", "4"]


def k_groups(policy: str, n: int = 4) -> list[RolloutGroup]:
    """Synthetic groups of ``policy`` with :data:`K`'s success counts (no model): the exchange's inputs."""
    out = []
    for q, k in enumerate(K[policy]):
        out.append(
            RolloutGroup(
                f"q{q}",
                f"{q}+{q}=?",
                policy,
                [f"{policy}{q}-{i}" for i in range(n)],
                [[1, 2]] * n,
                [[-0.5, -1.5]] * n,
                ["stop"] * n,
                [1.0 if i < k else 0.0 for i in range(n)],
            )
        )
    return out


def checked_method(**kw):
    """A :class:`MethodConfig` of ``kw``, validated as a config file's is."""
    from graft_rl.engine.config import MethodConfig

    cfg = MethodConfig(**kw)
    cfg.validate()
    return cfg


def row_tensors(is_peer: list[bool], T: int = 3):
    """The receiver's tensors for rows of ``T`` tokens (old and reference log-probs -1, the source's
    mean -1.1, HACPO's kappa 1): an objective's input without a model."""
    import torch

    from graft_rl.methods.objectives import RowTensors

    M = len(is_peer)
    return RowTensors(
        torch.full((M, T), -1.0),
        torch.ones(M, T),
        [1.0] * M,
        [1.0] * M,
        is_peer,
        [True] * M,
        [False] * M,
        [-1.1] * M,
        ref=torch.full((M, T), -1.0),
        extras={"kappa": [1.0] * M},
    )
