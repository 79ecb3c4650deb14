"""Methods from parts: each shipped part's equation (property tests), parts that combine freely,
combinations that cannot work refused in one line, and an engine that reads no method attribute."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl import algo
from graft_rl.engine.config import ConfigError
from graft_rl.methods import MethodConfig, build_exchange, build_method, build_objective
from graft_rl.methods.advantages import AdvantageContext
from graft_rl.methods.objectives import RowTensors
from graft_rl.methods.registry import ADVANTAGES, LOSSES, PART_KEYS
from graft_rl.policy import RolloutGroup

SRC = Path(__file__).resolve().parents[2] / "src" / "graft_rl"

rewards_2d = st.integers(1, 4).flatmap(
    lambda g: st.integers(2, 8).flatmap(
        lambda n: st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=n, max_size=n), min_size=g, max_size=g)
    )
)


# ---------------------------------------------------------------- advantages: their equations
@settings(max_examples=60, deadline=None)
@given(rewards_2d)
def test_rloo_is_the_reward_minus_the_mean_of_the_others(rows):
    """RLOO (Ahmadian et al., 2024, Eq. 7): a_i = r_i - 1/(n-1) sum_{j != i} r_j = n/(n-1) (r_i - mean r)."""
    r = torch.tensor(rows, dtype=torch.float64)
    a = algo.rloo_advantages(r)
    n = r.shape[1]
    for g in range(r.shape[0]):
        for i in range(n):
            others = [r[g, j] for j in range(n) if j != i]
            assert float(a[g, i]) == pytest.approx(float(r[g, i] - sum(others) / (n - 1)), abs=1e-12)
    assert torch.allclose(a, n / (n - 1) * (r - r.mean(1, keepdim=True)))
    assert torch.allclose(a.sum(1), torch.zeros(r.shape[0], dtype=torch.float64), atol=1e-12)  # zero-sum per group


@settings(max_examples=60, deadline=None)
@given(rewards_2d, st.floats(-3, 3))
def test_dr_grpo_subtracts_the_mean_and_is_shift_invariant(rows, shift):
    """Dr. GRPO (Liu et al., 2025, Eq. 3): a_i = r_i - mean(r); no std, so scaling rewards scales it."""
    r = torch.tensor(rows, dtype=torch.float64)
    a = algo.dr_grpo_advantages(r)
    assert torch.allclose(a, r - r.mean(1, keepdim=True))
    assert torch.allclose(algo.dr_grpo_advantages(r + shift), a)
    assert torch.allclose(algo.dr_grpo_advantages(2 * r), 2 * a)


@settings(max_examples=40, deadline=None)
@given(rewards_2d)
def test_the_registered_advantages_are_the_algo_equations(rows):
    r = torch.tensor(rows, dtype=torch.float64)
    ctx = AdvantageContext("A", MethodConfig(name="graft"))
    assert torch.equal(ADVANTAGES.get("grpo")(r, ctx), algo.grpo_advantages(r, 1e-6))
    assert torch.equal(ADVANTAGES.get("dr_grpo")(r, ctx), algo.dr_grpo_advantages(r))
    assert torch.equal(ADVANTAGES.get("rloo")(r, ctx), algo.rloo_advantages(r))


# ---------------------------------------------------------------- GSPO: its equation
seq = st.integers(1, 5).flatmap(
    lambda m: st.tuples(
        st.lists(st.lists(st.floats(-3, -0.01), min_size=4, max_size=4), min_size=m, max_size=m),
        st.lists(st.lists(st.floats(-0.05, 0.05), min_size=4, max_size=4), min_size=m, max_size=m),
        st.lists(st.floats(-2, 2), min_size=m, max_size=m),
        st.lists(st.integers(1, 4), min_size=m, max_size=m),
    )
)


@settings(max_examples=60, deadline=None)
@given(seq)
def test_gspo_is_the_sequence_mean_of_the_clipped_length_normalised_ratio(case):
    """GSPO (Zheng et al., 2025, Eqs. 5-7): s_i = exp(mean_t (log pi - log pi_old)),
    L = -1/M sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)."""
    old_rows, delta_rows, adv, lengths = case
    old = torch.tensor(old_rows, dtype=torch.float64)
    lp = old + torch.tensor(delta_rows, dtype=torch.float64)
    mask = torch.tensor([[1.0] * k + [0.0] * (4 - k) for k in lengths], dtype=torch.float64)
    a = torch.tensor(adv, dtype=torch.float64)
    loss, stats = algo.gspo_policy_loss(lp, old, a, mask)
    want, clipped = [], 0
    for i, k in enumerate(lengths):
        s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in range(k)) / k)
        want.append(-min(s * adv[i], min(max(s, 1 - 3e-4), 1 + 4e-4) * adv[i]))
        clipped += not (1 - 3e-4 <= s <= 1 + 4e-4)
    assert float(loss) == pytest.approx(sum(want) / len(want), abs=1e-9)
    assert float(stats["clip_frac"]) == pytest.approx(clipped / len(lengths))  # responses clipped, not tokens


def test_gspo_differs_from_the_sequence_ratio_ablation_in_aggregation_and_range():
    """The ``ratio: sequence`` ablation keeps GRAFT's token mean and 0.2/0.28 range; GSPO averages over
    responses and clips at 3e-4/4e-4. Same ratios, different losses."""
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    lp = old.clone()
    lp[0] += 0.01  # s = e^0.01: inside 1 +- 0.2, outside 1 + 4e-4
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    ablation, _ = algo.policy_loss(lp, old, adv, mask, None, 0.2, 0.28, "sequence")
    gspo, st = algo.gspo_policy_loss(lp, old, adv, mask)
    s = math.exp(0.01)
    assert float(ablation) == pytest.approx(-(4 * s * 1 + 1 * (-1)) / 5, rel=1e-5)  # token mean, unclipped
    assert float(gspo) == pytest.approx(-((1 + 4e-4) * 1 + 1 * (-1)) / 2, rel=1e-5)  # response mean, clipped
    assert float(st["clip_frac"]) == 0.5


def test_gspo_as_a_loss_part_trains_a_minibatch_and_weights_peer_responses():
    cfg = MethodConfig(name="graft", loss="gspo")
    cfg.validate()
    obj = build_objective(cfg)
    M, T = 3, 4
    t = RowTensors(
        torch.full((M, T), -1.0),
        torch.ones(M, T),
        [1.0, -1.0, 2.0],
        [1.0, 1.0, 0.0],
        [False, False, True],
        [True] * M,
        [False] * M,
        [-1.0] * M,
    )
    lp = torch.full((M, T), -1.0, requires_grad=True)
    loss, stats = obj.minibatch(t, [0, 1, 2], step=1)(lp, torch.ones(M, T), [0, 1, 2])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1.0 - 1.0 + 0.0) / 3)  # on-policy: s = 1; the gated peer counts 0
    assert lp.grad[2].abs().sum() == 0 and lp.grad[0].abs().sum() > 0  # weight 0: no gradient
    assert stats["tokens_peer"] == T and stats["tokens_self"] == 2 * T


# ---------------------------------------------------------------- parts combine
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


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            {"name": "graft", "advantage": "hacpo"},
            r"method.advantage 'hacpo' compares a receiver's group with a peer's",
        ),
        ({"name": "graft", "composition": "hacpo_pool", "advantage": "hacpo"}, r"reads each policy's capability"),
        ({"name": "graft", "composition": "aux_target"}, r"auxiliary targets and their loss come together"),
        ({"name": "sgt", "aux_loss": "none"}, r"auxiliary targets and their loss come together"),
        ({"name": "graft", "loss": "luffy"}, r"set method.weighting: none"),
        ({"name": "sgt", "pooled": True}, r"method.pooled: true is composition 'pool'"),
        ({"name": "graft", "loss": "nope"}, r"method.loss: 'nope' is not one of token_mean_clip, gspo"),
        ({"name": "graft", "gspo_clip_low": 0.1}, r"method.gspo_clip_low is not used by method 'graft'"),
        ({"name": "graft", "loss": "gspo", "gspo_clip_low": 1.5}, r"method.gspo_clip_low must be in \[0, 1\)"),
        ({"name": "grpo", "weighting": "none"}, r"method.weighting is not used by method 'grpo'"),
    ],
)
def test_combinations_that_cannot_work_are_refused_in_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as err:
        MethodConfig(**keys).validate()
    assert "\n" not in str(err.value)


def test_every_shipped_method_is_a_preset_of_registered_parts():
    from graft_rl.methods import method_class, method_names

    for name in method_names():
        cls = method_class(name)
        assert set(cls.preset) == set(PART_KEYS)
        for kind, registry in PART_KEYS.items():
            registry.get(cls.preset[kind])
    assert method_class("graft").preset == {
        "advantage": "grpo",
        "selection": "complementary",
        "composition": "replace",
        "weighting": "gate",
        "loss": "token_mean_clip",
        "aux_loss": "none",
    }


def test_a_swapped_part_reaches_the_receivers_objective():
    assert build_method(MethodConfig(name="graft", loss="gspo")).receiver().objective.loss is LOSSES.get("gspo")


def test_each_shipped_part_is_short():
    """Each part is at most 40 lines apart from its docstring (the equation is in graft_rl.algo)."""
    import ast
    import inspect

    for registry in PART_KEYS.values():
        for name in registry.names():
            obj = registry.get(name)
            if not obj.__module__.startswith("graft_rl."):
                continue
            node = ast.parse(inspect.getsource(obj).lstrip()).body[0]
            doc = ast.get_docstring(node) or ""
            body = len(inspect.getsource(obj).splitlines()) - (len(doc.splitlines()) if doc else 0)
            assert body <= 40, (registry.kind, name, body)


# ---------------------------------------------------------------- the engine reads no method attribute
def test_no_file_under_engine_or_policy_names_a_method_or_reads_its_attributes():
    from graft_rl.methods import method_names

    names = "|".join(method_names())
    attrs = ["keeps_cut", "is_aux", ".position", "loss_mask", "compatibility_score", "extras", "uses_peers"]
    for folder in ("engine", "policy"):
        for path in (SRC / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(rf"""["']({names})["']""", text), path
            for attr in attrs:
                assert attr not in text, (path, attr)


# ---------------------------------------------------------------- GRAFT with another part, as a user runs it
@pytest.mark.parametrize("override", ["method.advantage=rloo", "method.advantage=dr_grpo", "method.loss=gspo"])
def test_graft_trains_with_a_swapped_part_from_the_command_line(override, tmp_path, capsys):
    """``graft train configs/testbed/graft.yaml method.advantage=rloo`` (and the others) train."""
    import json

    from graft_rl.commands.cli import main

    root = Path(__file__).resolve().parents[2]
    small = ["prompt_batch=16", "minibatch=4", "n=4", "max_new_tokens=24", "checkpoint_every=100", "validation.data=[]"]
    args = [
        "train",
        str(root / "configs/testbed/graft.yaml"),
        override,
        "steps=2",
        f"run_dir={tmp_path / 'run'}",
        *small,
    ]
    assert main([*args, "--no-progress"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(ln["loss"] is not None for ln in lines)
    assert sum(ln["exchanged_in"] for ln in lines) > 0  # it grafts
    key, value = override.removeprefix("method.").split("=")
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"{key}: {value}" in saved


def test_a_method_written_against_the_old_hooks_is_refused_when_registered():
    from graft_rl.methods import Method, register_method

    with pytest.raises(ValueError, match=r"method 'old_style' overrides objective\(\): a method now names its parts"):

        @register_method("old_style")
        class OldStyle(Method):
            def objective(self):
                return None
