"""The exchange strategies on synthetic rollouts (no model): what each receiver trains on."""

from __future__ import annotations

import pytest
import torch
from runs import EXPECTED_A_TO_B
from runs import k_groups as _groups

from graft_rl import algo
from graft_rl.engine.config import MethodConfig
from graft_rl.methods import build_exchange


def _build(**kw):
    cfg = MethodConfig(**kw)
    cfg.validate()
    ex = build_exchange(cfg)
    groups = {"A": _groups("A"), "B": _groups("B")}
    return ex.build("B", groups, {"A", "B"}, 4, torch.Generator().manual_seed(0))


def test_graft_batch_replaces_failed_groups_only():
    b = _build(name="graft")
    assert {r.prompt_id for r in b.rows if r.is_peer} == EXPECTED_A_TO_B
    assert len(b.rows) == 8 * 4 and sum(b.group_is_peer) == 2
    assert b.stats["candidates_in"] == 3 and b.stats["exchanged_in"] == 2
    assert all(r.src_mean_logprob == pytest.approx(-1.0) for r in b.rows)


def test_success_only_excludes_failed_peer_responses():
    b = _build(name="graft", success_only=True)
    peer = [r for r in b.rows if r.is_peer]
    assert all(r.include == (r.reward > 0) for r in peer)
    assert all(r.include for r in b.rows if not r.is_peer)
    # advantages still come from the full source group
    q5 = [r.advantage for r in peer if r.prompt_id == "q5"]
    assert q5 == pytest.approx(algo.grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))[0].tolist())


def test_pooled_groups_keep_own_group_and_pool_advantages():
    b = _build(name="graft", pooled=True)
    q2 = [r for r in b.rows if r.prompt_id == "q2"]
    assert len(q2) == 8 and sum(r.is_peer for r in q2) == 4
    a_own, a_src = algo.pooled_advantages(torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert [r.advantage for r in q2] == pytest.approx(a_own[0].tolist() + a_src[0].tolist())


def test_sgt_adds_one_correct_peer_response_as_auxiliary_target():
    b = _build(name="sgt")
    aux = [r for r in b.rows if r.is_aux]
    # SGT's rule: B fails and A has >= 1 success: q0, q2, q4 (A all-pass still counts), q5
    assert {r.prompt_id for r in aux} == {"q0", "q2", "q4", "q5"}
    assert all(r.reward == 1.0 and r.source == "A" for r in aux)
    assert sum(1 for r in b.rows if not r.is_aux) == 32  # own groups untouched


def test_random_prompts_are_count_matched():
    b = _build(name="graft", selection="random")
    assert b.stats["exchanged_in"] == 2


def test_hacpo_pools_every_prompt():
    b = _build(name="hacpo")
    assert sum(1 for r in b.rows if r.is_peer) == 32 and len(b.rows) == 64


def test_grpo_has_no_peer_rows():
    b = _build(name="grpo")
    assert not any(r.is_peer for r in b.rows) and len(b.rows) == 32
