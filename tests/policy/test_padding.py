"""Micro-batches formed by length (issue 22): every row once, within the token budget, far less
padding than arrival order on a math-RL length mix, and the same update as today's path."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl.policy import Policy, PolicyConfig
from graft_rl.policy.logprobs import PASS_OVERHEAD, length_micro_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from padding import arrival_order_micro_batches  # noqa: E402  (the rule before issue 22, as the benchmark runs it)


def computed(lengths, passes):
    return sum(max(lengths[i] for i in p) * len(p) for p in passes)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=80), st.integers(1, 4000))
def test_every_row_once_and_each_pass_within_budget(lengths, budget):
    passes = length_micro_batches(lengths, budget)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    for p in passes:
        assert len(p) == 1 or max(lengths[i] for i in p) * len(p) <= budget
    if max(lengths) * len(lengths) <= budget:  # one pass, arrival order: as before
        assert passes == [list(range(len(lengths)))]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=80), st.integers(600, 4000))
def test_passes_are_length_classes_and_cost_no_more_than_arrival_order(lengths, budget):
    """Each pass is a run of the length order (longest first), and computed tokens plus the passes'
    fixed cost never exceed the arrival-order rule's (the split is optimal)."""
    passes = length_micro_batches(lengths, budget)
    arrival = arrival_order_micro_batches(lengths, budget)
    fixed = PASS_OVERHEAD * budget
    assert computed(lengths, passes) + fixed * len(passes) <= computed(lengths, arrival) + fixed * len(arrival) + 1e-9
    for longer, shorter in zip(passes, passes[1:], strict=False):
        assert min(lengths[i] for i in longer) >= max(lengths[i] for i in shorter)


def test_useful_fraction_on_a_math_rl_length_mix():
    rng = random.Random(0)
    lengths = [rng.randint(80, 300) + min(4096, int(rng.lognormvariate(6.4, 0.9))) for _ in range(1024)]
    useful = sum(lengths)
    assert useful / computed(lengths, length_micro_batches(lengths, 32768)) > 0.9
    assert useful / computed(lengths, arrival_order_micro_batches(lengths, 32768)) < 0.6


def test_update_and_scores_equal_the_arrival_order_path(tiny_pair, monkeypatch):
    """Same old log-probs, loss, gradient norm and weights (to float summation order) as today's path."""
    texts = ["a" * k for k in (3, 40, 7, 25, 1, 33, 12, 18)]
    results = []
    for rule in ("length", "arrival"):
        pol = Policy(PolicyConfig("A", str(tiny_pair[0]), lr=1e-3, micro_batch_tokens=120))
        if rule == "arrival":
            monkeypatch.setattr(
                pol,
                "_micro_batches",
                lambda b, pol=pol: arrival_order_micro_batches(b.lengths(), pol.micro_batch_tokens),
            )
        batch = pol.encode_texts(["Q"] * len(texts), texts, [True] * len(texts))
        assert len(pol._micro_batches(batch)) > 1
        old, mask = pol.token_logprobs(batch)
        adv, total = torch.linspace(-1, 1, len(texts)), float(mask.sum())

        def loss(lp, m, rows, old=old, adv=adv, total=total):
            return -((lp - old[rows, : lp.shape[1]]).exp() * adv[rows, None] * m).sum() / total, {}

        out = pol.update(batch, loss)
        results.append((old, out, [p.detach().clone() for p in pol.model.parameters()]))
    (a_old, a, a_w), (b_old, b, b_w) = results
    torch.testing.assert_close(a_old, b_old, rtol=0, atol=1e-5)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # weights to 1e-6 but for the odd element where Adam divides float noise by a near-zero gradient
    # (still within Adam's lr-per-step bound)
    diffs = torch.cat([(x - y).abs().flatten() for x, y in zip(a_w, b_w, strict=True)])
    assert (diffs > 1e-6).float().mean() < 1e-3 and diffs.max() <= 2 * 1e-3
