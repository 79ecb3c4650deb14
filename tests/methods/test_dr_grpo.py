"""Dr. GRPO (Liu et al., 2025), the method ``docs/contributing.md`` adds in one file: its advantage
is the group's reward minus its mean, not divided by the std."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl import algo
from graft_rl.methods import MethodConfig, build_exchange
from graft_rl.methods.dr_grpo import unnormalised_advantages
from graft_rl.policy import RolloutGroup


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=8), min_size=1, max_size=5).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    )
)
def test_advantages_are_centred_and_grpo_scaled_by_the_std(rows):
    """Dr. GRPO's rule: A = r - mean(r) per group (mean 0); GRPO's is the same divided by std + eps."""
    r = torch.tensor(rows, dtype=torch.float64)
    a = unnormalised_advantages(r)
    assert torch.allclose(a.sum(dim=1), torch.zeros(len(rows), dtype=torch.float64), atol=1e-12)
    std = r.std(dim=1, keepdim=True)
    assert torch.allclose(algo.grpo_advantages(r), a / (std + 1e-6), atol=1e-9)


def test_its_batches_are_own_groups_with_unnormalised_advantages():
    cfg = MethodConfig(name="dr_grpo")
    cfg.validate()
    groups = {
        p: [
            RolloutGroup(
                "q0",
                "0+0=?",
                p,
                ["a", "b", "c", "d"],
                [[1]] * 4,
                [[-1.0]] * 4,
                ["stop"] * 4,
                [1.0, 0.0, 0.0, 0.0] if p == "A" else [0.0] * 4,
            )
        ]
        for p in ("A", "B")
    }
    batch = build_exchange(cfg).build("A", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))
    assert [r.source for r in batch.rows] == ["A"] * 4  # no peer: B's group never enters
    assert [r.advantage for r in batch.rows] == [0.75, -0.25, -0.25, -0.25]


def test_it_trains_with_the_pattern_reward(tmp_path, tiny_pair):
    from graft_rl.engine.trainer import Trainer

    from .test_registry import _cfg, pattern_reward

    tr = Trainer(_cfg(tmp_path, tiny_pair, {"name": "dr_grpo"}), show_progress=False, reward_groups=pattern_reward)
    try:
        lines = tr.run()
    finally:
        tr.close()
    assert len(lines) == 4 and all(ln["loss"] is not None and ln["skipped_updates"] == 0 for ln in lines)
