"""The receiver's update and its step statistics (SPEC §1.14, docs/metrics.md): every number is a sum,
count or maximum reduced one way, so no metric depends on how a step's tokens were cut into forward
passes; a skipped update keeps the gap it measured.

The policy here is a parameter of log-probs (``ParamPolicy``): what ``receiver_update`` needs of a
policy, no model, so each rule is checked on constructed numbers in milliseconds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_rl import algo
from graft_rl.engine.update import receiver_update, step_metrics
from graft_rl.methods import MethodConfig, build_objective
from graft_rl.methods.objectives import RowTensors
from graft_rl.policy import TokenBatch
from graft_rl.policy.training import OptimiserStep
from graft_rl.stats import StepStats


class ParamPolicy:
    """Log-probs ``[M, T]`` as a parameter; ``cuts[u]``: the pass sizes of update ``u`` (rows in order)."""

    def __init__(self, lp: torch.Tensor, cuts: list[list[int]], lr: float = 0.0):
        self.lp = torch.nn.Parameter(lp.clone())
        self.cuts, self.update = cuts, 0
        self.optimizer = torch.optim.SGD([self.lp], lr=lr)
        self.model = torch.nn.Module()
        self.config = SimpleNamespace(gradient_checkpointing=False, grad_clip=math.inf)
        self.loss_scale, self.weights_version = 1.0, 0

    def optimiser_step(self) -> OptimiserStep:
        return OptimiserStep(self)

    def passes(self, batch: TokenBatch) -> list[list[int]]:
        sizes = self.cuts[self.update] if self.update < len(self.cuts) else [len(batch)]
        self.update += 1
        assert sum(sizes) == len(batch)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]

    def pass_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        rows = [p[0] for p in batch.prompt_ids]  # each row's prompt is its index
        return self.lp[rows, : batch.max_response_len] * batch.response_mask()

    def reduce_stats(self, stats: StepStats) -> StepStats:
        return stats

    def _reduce_sums(self, values):
        return values

    def _clip_grad_norm(self) -> float:
        return float(self.lp.grad.norm()) if self.lp.grad is not None else 0.0


def _batch(lengths: list[int]) -> TokenBatch:
    return TokenBatch([[i] for i in range(len(lengths))], [[7] * n for n in lengths])


def _rows(lengths, old, adv, is_peer=None, mu=None, weight=None, current=None) -> RowTensors:
    m = len(lengths)
    mask = _batch(lengths).response_mask()
    peer = is_peer or [False] * m
    return RowTensors(
        old,
        mask,
        adv,
        weight or [1.0] * m,
        peer,
        [True] * m,
        [False] * m,
        [-1.0] * m,
        old_is_current=current,
        mu=mu,
        has_mu=None if mu is None else [not p for p in peer],
    )


def test_the_clip_fraction_is_clipped_over_trained_tokens_of_the_whole_step():
    """Two updates, cut into 1 and 3 passes: the step's clip fraction is every clipped token over every
    trained token (Table 9), not a mean of per-update fractions weighted by their pass counts."""
    lengths = [5, 5, 4, 4, 3, 3]
    lp = torch.full((6, 5), -1.0)
    old = lp.clone()
    old[0, :4] = -1.5  # ratio e^0.5 = 1.65 > 1.28: four of update 1's 10 tokens clipped (advantage > 0)
    old[2, :1] = -1.5  # one of update 2's 14 tokens clipped
    adv = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    t = _rows(lengths, old, adv)
    obj = build_objective(MethodConfig(name="grpo"))
    stats = receiver_update(ParamPolicy(lp, [[2], [1, 2, 1]]), obj, _batch(lengths), t, [[0, 1], [2, 3, 4, 5]], 1)
    metrics = step_metrics(stats, with_kl=False)
    assert stats.sums["clipped_tokens_self"] == 5 and stats.sums["tokens_self"] == 24
    assert metrics["clip_frac_self"] == 5 / 24  # 0.208; 0.3.0 code divided each update by its passes: 0.30
    assert metrics["minibatches"] == 2 and metrics["skipped_updates"] == 0


def _random_case(seed: int, m: int, T: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (m,), generator=g).tolist()
    lp = -torch.rand(m, T, generator=g) * 3 - 0.05
    old = lp + torch.randn(m, T, generator=g) * 0.4
    mu = old + torch.randn(m, T, generator=g) * 0.3
    adv = (torch.randn(m, generator=g)).tolist()
    is_peer = (torch.rand(m, generator=g) < 0.3).tolist()
    weight = [float(w) for w in torch.rand(m, generator=g)]
    return lengths, lp, old, mu, adv, is_peer, weight


def _cuts(sizes: list[int], draw) -> list[list[int]]:
    out = []
    for n in sizes:
        parts, left = [], n
        while left:
            k = draw(st.integers(1, left))
            parts.append(k)
            left -= k
        out.append(parts)
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["graft", "gspo", "hacpo"]), st.data())
def test_prop_step_statistics_do_not_depend_on_the_pass_cut(seed, loss, data):
    """Any cut of the same minibatches into passes: counts exactly equal, float sums equal to rounding,
    maxima equal (the weights do not move here: lr 0, so only the cut differs)."""
    m, T = 8, 6
    lengths, lp, old, mu, adv, is_peer, weight = _random_case(seed, m, T)
    keys = {"name": "graft", "correction": "icepop", "kl_coef": 0.0}
    if loss != "graft":
        keys.update(loss=loss, weighting="none") if loss == "hacpo" else keys.update(loss=loss)
    if loss == "hacpo":
        keys.update(name="hacpo", correction="icepop")
    obj = build_objective(MethodConfig(**keys))
    order = [[0, 1, 2], [3, 4, 5, 6, 7]]
    t = _rows(lengths, old, adv, is_peer, mu, weight)
    whole = receiver_update(ParamPolicy(lp, [[3], [5]]), obj, _batch(lengths), t, order, 1)
    cut = receiver_update(ParamPolicy(lp, _cuts([3, 5], data.draw)), obj, _batch(lengths), t, order, 1)
    for k in ("clipped_tokens_self", "tokens_self", "clipped_tokens_peer", "tokens_peer", "mismatch_tokens"):
        assert cut.sums.get(k) == whole.sums.get(k), k
    for k in ("mismatch_out", "correction_masked", "updates", "minibatches"):
        assert cut.sums.get(k) == whole.sums.get(k), k
    for k, v in whole.sums.items():  # float32 losses and gradients, float64 gap sums: equal to rounding
        assert cut.sums[k] == pytest.approx(v, rel=1e-5, abs=1e-9), k
    assert cut.peaks == pytest.approx(whole.peaks, rel=1e-9)


def test_a_skipped_update_keeps_the_gap_of_every_pass():
    """The second pass's loss is not finite (a NaN advantage): the update is skipped, nothing of its loss
    is counted, but the gap of all its passes is, the failing one and those after it included."""
    lengths = [3, 3, 3, 3]
    lp = torch.full((4, 3), -1.0)
    mu = lp - 0.1
    t = _rows(lengths, lp.clone(), [1.0, float("nan"), 1.0, -1.0], mu=mu)
    obj = build_objective(MethodConfig(name="grpo", correction="tis"))
    pol = ParamPolicy(lp, [[1, 1, 2]], lr=0.1)
    stats = receiver_update(pol, obj, _batch(lengths), t, [[0, 1, 2, 3]], 1)
    metrics = step_metrics(stats, with_kl=False)
    assert metrics["skipped_updates"] == 1 and metrics["loss"] is None
    assert stats.sums["mismatch_tokens"] == 12  # every own token of every pass
    assert metrics["mismatch_abs"] == pytest.approx(0.1, rel=1e-5)
    assert "tokens_self" not in stats.sums  # the skipped update's loss counts nothing
    assert torch.equal(pol.lp.detach(), lp)  # and moved nothing


def test_stop_on_nonfinite_stops_after_the_skipped_update():
    lengths = [2, 2]
    lp = torch.full((2, 2), -1.0)
    t = _rows(lengths, lp.clone(), [float("nan"), 1.0])
    obj = build_objective(MethodConfig(name="grpo"))
    stats = receiver_update(ParamPolicy(lp, [[1], [1]]), obj, _batch(lengths), t, [[0], [1]], 1, True)
    assert stats.sums["minibatches"] == 1 and stats.sums["nonfinite_stop"] == 1


def test_kl_is_a_token_mean_over_the_step_not_a_mean_of_pass_means():
    """``kl_ref``: the sum of the k3 terms over the step's tokens over their count."""
    lengths = [4, 1]
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, 0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, 0.0, 0.0, 0.0]])
    t = _rows(lengths, lp.clone(), [1.0, 1.0])
    t.ref = ref
    obj = build_objective(MethodConfig(name="grpo", kl_coef=0.1))
    stats = receiver_update(ParamPolicy(lp, [[1, 1]]), obj, _batch(lengths), t, [[0, 1]], 1)
    k3 = math.e - 1 - 1  # the second row's one token: exp(1) - 1 - 1; the first row's four: 0
    assert step_metrics(stats, with_kl=True)["kl_ref"] == pytest.approx(k3 / 5)  # not (0 + k3) / 2


def test_a_loss_parts_own_sums_and_maxima_are_logged_by_name():
    s = StepStats.total([StepStats({"ftis_filtered": 1.0}, {"ftis_kl_max": 0.2}), StepStats({"ftis_filtered": 2.0})])
    out = step_metrics(s, with_kl=False)
    assert out["ftis_filtered"] == 3.0 and out["ftis_kl_max"] == 0.2


def test_step_stats_total_is_exact_whatever_the_order():
    parts = [StepStats({"x": v}) for v in (1e16, 1.0, -1e16, 1.0)]
    assert StepStats.total(parts).sums["x"] == 2.0 == StepStats.total(parts[::-1]).sums["x"]


def test_the_first_updates_own_rows_take_pi_old_from_their_pass():
    """``old_is_current``: pi_old of those rows is the pass's own log-probs (ratio 1: nothing clipped),
    whatever the stored ``old`` says."""
    lengths = [2, 2]
    lp = torch.full((2, 2), -1.0)
    t = _rows(lengths, torch.full((2, 2), -9.0), [1.0, 1.0], current=[True, False])
    obj = build_objective(MethodConfig(name="grpo"))
    stats = receiver_update(ParamPolicy(lp, [[2]]), obj, _batch(lengths), t, [[0, 1]], 1)
    assert stats.sums["clipped_tokens_self"] == 2  # row 1 only: its stored pi_old -9 makes its ratio huge
    want = algo.clipped_token_mask(lp, torch.stack([lp[0], torch.full((2,), -9.0)]), torch.ones(2), torch.ones(2, 2))
    assert int(want.sum()) == 2
