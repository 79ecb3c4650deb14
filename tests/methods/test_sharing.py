"""The methods published after the paper (methods/sapo.py, methods/mutual.py, methods/ftis.py,
algo/sharing.py): each part's rule on constructed rewards and log-probs, without a model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from passes import one_pass
from runs import row_tensors

from graft_rl import algo
from graft_rl.errors import ConfigError
from graft_rl.methods import MethodConfig, build_method
from graft_rl.methods.objectives import Objective
from graft_rl.policy import RolloutGroup


def _group(policy: str, pid: str, rewards: list[float], tokens: int = 2) -> RolloutGroup:
    n = len(rewards)
    return RolloutGroup(
        pid,
        f"{pid}?",
        policy,
        [f"{policy}:{pid}:{i}" for i in range(n)],
        [list(range(1, tokens + 1))] * n,
        [[-0.5] * tokens] * n,
        ["stop"] * n,
        list(rewards),
    )


def _cfg(**kw) -> MethodConfig:
    cfg = MethodConfig(**kw)
    cfg.validate()
    return cfg


def _swarm(ks: dict[str, list[int]], n: int = 4) -> dict[str, list[RolloutGroup]]:
    """Each policy's groups of *its own* prompts (ids ``<policy>-q<i>``), ``k`` successes each."""
    return {p: [_group(p, f"{p}-q{q}", [1.0] * k + [0.0] * (n - k)) for q, k in enumerate(kk)] for p, kk in ks.items()}


# ---------------------------------------------------------------- SAPO
def _sapo_batch(groups, receiver: str, J: int, seed: int = 0, draw: str = "uniform"):
    cfg = _cfg(name="sapo", sapo_external=J, sapo_draw=draw)
    gen = torch.Generator().manual_seed(seed)
    return build_method(cfg).build(receiver, groups, set(groups), 4, gen, torch.Generator().manual_seed(seed + 1))


def test_a_sapo_training_set_holds_its_I_own_and_J_external_data_points_none_of_zero_advantage():
    """A constructed swarm step: each node's own prompts; the receiver keeps all I own groups and takes
    J external groups, each a question with all its answers and its own group-relative advantages."""
    groups = _swarm({"A": [0, 2, 4, 1], "B": [4, 0, 3, 1], "C": [2, 2, 0, 4], "D": [1, 3, 0, 0]})
    b = _sapo_batch(groups, "A", J=4)
    own = [r for r in b.rows if not r.is_peer]
    ext = [r for r in b.rows if r.is_peer]
    assert {r.prompt_id for r in own} == {g.prompt_id for g in groups["A"]}  # I = every own data point
    taken = {(r.source, r.prompt_id) for r in ext}
    assert len(taken) == 4  # J
    by_id = {(g.policy, g.prompt_id): g for p in "BCD" for g in groups[p]}
    for src, pid in taken:
        g = by_id[(src, pid)]
        assert 0 < g.k < g.n  # none with zero advantage (all answers right, or all wrong)
        rows = [r for r in ext if (r.source, r.prompt_id) == (src, pid)]
        assert [r.text for r in rows] == g.texts  # every answer of the data point, as text
        want = algo.grpo_advantages(torch.tensor([g.rewards], dtype=torch.float64), 1e-6)[0].tolist()
        assert [r.advantage for r in rows] == pytest.approx(want)  # group-relative over its own answers
    assert b.stats["exchanged_in"] == 4 and b.stats["candidates_in"] == 6
    assert sum(b.stats[f"exchanged_from/{p}"] for p in "BCD") == 4
    assert not any(b.group_is_peer)  # mixed with the own groups, not placed last


@settings(max_examples=60, deadline=None)
@given(
    ks=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=2, max_size=4),
    J=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_sapo_takes_min_J_informative_external_data_points_and_every_own_one(ks, J, seed):
    names = [f"P{i}" for i in range(len(ks))]
    groups = _swarm(dict(zip(names, ks, strict=True)))
    b = _sapo_batch(groups, names[0], J, seed)
    informative = sum(1 for p in names[1:] for g in groups[p] if 0 < g.k < g.n)
    taken = {(r.source, r.prompt_id) for r in b.rows if r.is_peer}
    assert len(taken) == min(J, informative)
    assert all(0 < next(g for g in groups[s] if g.prompt_id == q).k < 4 for s, q in taken)
    assert sum(1 for r in b.rows if not r.is_peer) == 4 * len(ks[0])
    again = _sapo_batch(groups, names[0], J, seed)  # the draw is the seed's
    assert [(r.source, r.prompt_id) for r in again.rows] == [(r.source, r.prompt_id) for r in b.rows]


def test_sapo_discards_a_group_of_equal_partial_rewards_whose_advantages_round_off_zero():
    # six answers all scored 0.1 (partial credit): their GRPO advantages are ~1e-11, not 0
    groups = {"A": [_group("A", "A-q0", [1, 0, 0, 0, 0, 0])], "B": [_group("B", "B-q0", [0.1] * 6)]}
    assert algo.grpo_advantages(torch.tensor([[0.1] * 6], dtype=torch.float64), 1e-6).abs().max() > 0
    b = _sapo_batch(groups, "A", J=1)
    assert not any(r.is_peer for r in b.rows) and b.stats["candidates_in"] == 0


def test_sapo_top_reward_is_genrls_draw_the_highest_totals_and_none_at_zero():
    groups = _swarm({"A": [0], "B": [4, 1, 0], "C": [3, 2, 0]})
    b = _sapo_batch(groups, "A", J=3, draw="top_reward")
    taken = [(r.source, r.prompt_id) for r in b.rows if r.is_peer and r.index == 0]
    assert taken == [("B", "B-q0"), ("C", "C-q0"), ("C", "C-q1")]  # 4, 3, 2 (an all-correct group included)


def test_sapo_refuses_a_negative_J_and_an_unknown_draw():
    with pytest.raises(ConfigError, match="sapo_external"):
        _cfg(name="sapo", sapo_external=-1)
    with pytest.raises(ConfigError, match="sapo_draw"):
        _cfg(name="sapo", sapo_draw="best")


def test_rollout_prompts_resolve_per_method_and_refuse_what_cannot_pair():
    assert _cfg(name="sapo").check_rollout("auto", 1.0) == "own"
    assert _cfg(name="graft").check_rollout("auto", 1.0) == "shared"
    assert _cfg(name="grpo").check_rollout("own", 1.0) == "own"  # no exchange: own streams are fine
    with pytest.raises(ConfigError, match="rollout.prompts own: method 'graft' exchanges groups of the same prompt"):
        _cfg(name="graft").check_rollout("own", 1.0)
    with pytest.raises(ConfigError, match="peers from records"):
        _cfg(name="sapo").check_rollout("auto", 1.0, stored_peers=True)


# ---------------------------------------------------------------- PRP and XGRPO
def test_prp_pools_every_peers_group_on_every_prompt_with_advantages_over_the_pool():
    groups = {
        "A": [_group("A", "q0", [0, 0, 0, 0]), _group("A", "q1", [1, 0, 0, 0])],
        "B": [_group("B", "q0", [1, 1, 0, 0]), _group("B", "q1", [1, 1, 1, 1])],
        "C": [_group("C", "q0", [1, 0, 0, 0]), _group("C", "q1", [0, 0, 0, 0])],
    }
    b = build_method(_cfg(name="prp")).build("A", groups, set(groups), 4, torch.Generator().manual_seed(0))
    for q in range(2):
        rows = [r for r in b.rows if r.prompt_id == f"q{q}"]
        assert [r.source for r in rows] == ["A"] * 4 + ["B"] * 4 + ["C"] * 4
        pool = torch.tensor([[float(x) for p in "ABC" for x in groups[p][q].rewards]], dtype=torch.float64)
        assert [r.advantage for r in rows] == pytest.approx(algo.grpo_advantages(pool, 1e-6)[0].tolist())
    assert b.group_is_peer == [True, True]
    # every peer's group entered both prompts: each is counted, not only the peer a prompt resolved to
    assert b.stats["exchanged_in"] == 2 and b.stats["exchanged_from/B"] == b.stats["exchanged_from/C"] == 2


@settings(max_examples=50, deadline=None)
@given(
    recv=st.lists(st.floats(-60, 0), min_size=1, max_size=6),
    delta=st.lists(st.floats(-30, 30), min_size=6, max_size=6),
    cap=st.floats(0.1, 10),
)
def test_prp_weight_is_the_truncated_sequence_density_ratio(recv, delta, cap):
    """w = min(exp(sum log pi_old - sum log mu), C): the weighting part on the ratio the receiver gives it."""
    r = torch.tensor(recv, dtype=torch.float64)
    s = r - torch.tensor(delta[: len(recv)], dtype=torch.float64)
    w = algo.truncated_sequence_ratio(r, s, cap)
    want = [min(math.exp(max(min(d, algo.MAX_LOG_RATIO), -algo.MAX_LOG_RATIO)), cap) for d in delta[: len(recv)]]
    assert w.tolist() == pytest.approx(want, rel=1e-9)
    cfg = _cfg(name="prp", prp_cap=cap)
    part = build_method(cfg).receiver().weighting
    assert part.score == "sequence_ratio"
    assert part(torch.exp((r - s).clamp(-20, 20)), cfg, None).tolist() == pytest.approx(
        algo.truncated_sequence_ratio(r, s, cap).tolist(), rel=1e-6
    )


def test_the_receiver_gives_prp_weighting_the_sequence_ratio_of_each_peer_response():
    groups = {"A": [_group("A", "q0", [0, 0], tokens=3)], "B": [_group("B", "q0", [1, 0], tokens=3)]}
    method = build_method(_cfg(name="prp", prp_cap=2.0))
    b = method.build("A", groups, {"A", "B"}, 2, torch.Generator().manual_seed(0))
    mask = torch.ones(len(b.rows), 3)
    recv_lp = {2: -0.1, 3: -1.0}  # the receiver's per-token log-probs of B's two responses
    old = torch.zeros(len(b.rows), 3)
    receiver = method.receiver()
    for i in receiver.peer_rows(b):
        old[i] = recv_lp[i]
    w = receiver.weigh(b, old, mask, [], torch.Generator())
    src_sum = 3 * -0.5
    assert w.weights[2] == pytest.approx(min(math.exp(3 * -0.1 - src_sum), 2.0))  # 2.0: truncated
    assert w.weights[3] == pytest.approx(math.exp(3 * -1.0 - src_sum))
    assert w.weights[:2] == [1.0, 1.0]


@settings(max_examples=50, deadline=None)
@given(ks=st.lists(st.integers(0, 4), min_size=2, max_size=4))
def test_xgrpo_trains_its_own_responses_with_baselines_over_its_and_its_peers_rewards(ks):
    names = [f"P{i}" for i in range(len(ks))]
    groups = {p: [_group(p, "q0", [1.0] * k + [0.0] * (4 - k))] for p, k in zip(names, ks, strict=True)}
    b = build_method(_cfg(name="xgrpo")).build("P0", groups, set(names), 4, torch.Generator().manual_seed(0))
    assert all(not r.is_peer and r.source == "P0" for r in b.rows)  # the actor's support is its own
    pool = torch.tensor([[float(x) for p in names for x in groups[p][0].rewards]], dtype=torch.float64)
    assert [r.advantage for r in b.rows] == pytest.approx(algo.grpo_advantages(pool, 1e-6)[0, :4].tolist())
    assert len(b.moved) == 4 * (len(ks) - 1)  # each peer reward that shaped the baseline is recorded
    assert {m["moved"] for m in b.moved} == {"reward"}
    assert all(b.stats[f"exchanged_from/{p}"] == 1 for p in names[1:])  # each peer's rewards, counted


# ---------------------------------------------------------------- F-TIS
@settings(max_examples=80, deadline=None)
@given(
    old=st.lists(st.floats(-8, 0), min_size=6, max_size=6),
    mu=st.lists(st.floats(-8, 0), min_size=6, max_size=6),
    adv=st.lists(st.floats(-2, 2), min_size=2, max_size=2),
    cap=st.floats(0.5, 5),
    tau=st.floats(0, 2),
)
def test_ftis_weights_truncate_and_filter_negative_advantage_samples_past_the_kl_threshold(old, mu, adv, cap, tau):
    o = torch.tensor(old, dtype=torch.float64).view(2, 3)
    m = torch.tensor(mu, dtype=torch.float64).view(2, 3)
    a = torch.tensor(adv, dtype=torch.float64)
    w, kl, kept = algo.ftis_token_weights(o, m, torch.ones(2, 3, dtype=torch.float64), a, cap, tau)
    for j in range(2):
        rho = [math.exp(x - y) for x, y in zip(old[3 * j : 3 * j + 3], mu[3 * j : 3 * j + 3], strict=True)]
        k3 = sum(r - 1 - math.log(r) for r in rho) / 3
        assert float(kl[j]) == pytest.approx(k3, rel=1e-9, abs=1e-12)
        keep = adv[j] >= 0 or k3 <= tau
        if adv[j] < 0 and abs(k3 - tau) <= 1e-12:  # on the threshold within rounding: either side is right
            keep = bool(kept[j])
        assert bool(kept[j]) == keep
        want = [min(r, cap) if keep else 0.0 for r in rho]
        assert w[j].tolist() == pytest.approx(want, rel=1e-9)


def test_the_ftis_loss_weighs_peer_tokens_by_their_filtered_truncated_ratio_and_own_tokens_by_the_correction():
    cfg = _cfg(name="ftis")
    obj = Objective(cfg)
    assert obj.loss.peer_tokens and obj.correction.name == "tis"
    t = row_tensors([False, True, True])
    t.mu = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -0.5, -1.0], [-0.2, -0.2, -0.2]])
    t.has_mu = torch.tensor([True, True, True])
    t.adv = torch.tensor([1.0, 1.0, -1.0])
    lp = torch.full((3, 3), -1.0, requires_grad=True)
    loss, stats = one_pass(obj, t, [0, 1, 2], lp)
    peer_w, _, kept = algo.ftis_token_weights(
        torch.full((2, 3), -1.0), t.mu[1:], torch.ones(2, 3), t.adv[1:], cfg.ftis_cap, cfg.ftis_kl_threshold
    )
    assert kept.tolist() == [True, False]  # row 2: negative advantage, KL(mu || pi_old) = e^-0.8 - 1 + 0.8 > 0.1
    w = torch.cat([torch.ones(1, 3), peer_w])  # own row: mu == pi_old, TIS weight 1
    want, _ = algo.policy_loss(lp, torch.full((3, 3), -1.0), t.adv, torch.ones(3, 3), w, cfg.eps_low, cfg.eps_high)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert stats["ftis_filtered"] == 1.0 and stats["ftis_peer_responses"] == 2.0
    assert stats["mismatch_tokens"] == 3.0  # the gap is of the own row's tokens only
    # the filtered response is not trained: its tokens are neither clipped nor counted in clip_frac_peer
    assert stats["tokens_peer"] == 3.0 and stats["tokens_self"] == 3.0


def test_ftis_is_refused_with_top_p_sampling_and_with_replayed_peers():
    with pytest.raises(ConfigError, match="top_p"):
        _cfg(name="ftis").check_rollout("auto", 0.9)
    with pytest.raises(ConfigError, match="replayed from records"):
        _cfg(name="ftis").check_rollout("auto", 1.0, stored_peers=True)
