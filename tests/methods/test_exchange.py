"""The selection, composition and weighting parts (methods/exchange.py) with any advantage part:
source-computed advantages of the chosen estimator, pooled groups."""

from __future__ import annotations

import pytest
import torch

from graft_rl import algo
from graft_rl.methods import MethodConfig, build_exchange
from graft_rl.policy import RolloutGroup


def _groups(policy: str, k: list[int], n: int = 4) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            f"q{q}",
            f"{q}+{q}=?",
            policy,
            [f"{policy}{i}" for i in range(n)],
            [[1, 2]] * n,
            [[-1.0, -1.0]] * n,
            ["stop"] * n,
            [1.0] * kq + [0.0] * (n - kq),
        )
        for q, kq in enumerate(k)
    ]


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_graft_with_any_advantage_grafts_with_the_sources_advantages_of_that_estimator(advantage):
    cfg = MethodConfig(name="graft", advantage=advantage, balance=False)  # one direction has candidates
    cfg.validate()
    groups = {"A": _groups("A", [2, 0, 1, 4]), "B": _groups("B", [0, 0, 4, 1])}
    b = build_exchange(cfg).build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))
    est = {
        "grpo": lambda r: algo.grpo_advantages(r, 1e-6),
        "dr_grpo": algo.dr_grpo_advantages,
        "rloo": algo.rloo_advantages,
    }
    grafted = [r for r in b.rows if r.is_peer]
    assert {r.prompt_id for r in grafted} == {"q0"}  # B failed q0, A's group is mixed
    want = est[advantage](torch.tensor([groups["A"][0].rewards], dtype=torch.float64))[0].tolist()
    assert [r.advantage for r in grafted] == pytest.approx(want)  # source-computed, by the chosen estimator
    own = [r for r in b.rows if r.prompt_id == "q2"]
    want_own = est[advantage](torch.tensor([groups["B"][2].rewards], dtype=torch.float64))[0].tolist()
    assert [r.advantage for r in own] == pytest.approx(want_own)


def test_a_pooled_composition_uses_the_chosen_advantage_over_the_pool():
    cfg = MethodConfig(name="graft", pooled=True, advantage="rloo", balance=False)
    cfg.validate()
    groups = {"A": _groups("A", [2]), "B": _groups("B", [0])}
    b = build_exchange(cfg).build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))
    pooled = torch.tensor([groups["B"][0].rewards + groups["A"][0].rewards], dtype=torch.float64)
    assert [r.advantage for r in b.rows] == pytest.approx(algo.rloo_advantages(pooled)[0].tolist())
