"""The engine-trainer gap and its corrections (graft_rl.methods.corrections), on constructed log-probs."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from passes import one_pass

from graft_rl.errors import ConfigError
from graft_rl.methods import MethodConfig, register_loss
from graft_rl.methods.corrections import gap
from graft_rl.methods.losses import LossContext
from graft_rl.methods.objectives import Objective, RowTensors
from graft_rl.methods.registry import CORRECTIONS, LOSSES


def _cfg(correction="none", **kw) -> MethodConfig:
    cfg = MethodConfig(name="graft", correction=correction, **kw)
    cfg.validate()
    return cfg


@st.composite
def log_probs(draw):
    """``(old, mu, mask)``: pi_old and engine log-probs ``[m, T]`` a few nats apart, and a mask."""
    m, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    vals = st.floats(-6.0, -0.01, allow_nan=False)
    old = torch.tensor(draw(st.lists(vals, min_size=m * T, max_size=m * T)), dtype=torch.float64).view(m, T)
    mu = torch.tensor(draw(st.lists(vals, min_size=m * T, max_size=m * T)), dtype=torch.float64).view(m, T)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=m * T, max_size=m * T))).view(m, T)
    return old, mu, mask


def _weight(name, old, mu, mask, **keys):
    cfg = _cfg(name, **keys)
    w, sums = gap(old, mu, mask, CORRECTIONS.get(name), cfg)
    return w, {**sums.sums, **{f"{k}_peak": v for k, v in sums.peaks.items()}}, cfg


@given(log_probs())
def test_prop_tis_weight_is_the_token_ratio_truncated_at_the_cap(x):
    old, mu, mask = x
    w, _, cfg = _weight("tis", old, mu, mask)
    rho = torch.exp(old - mu)
    want = torch.where(mask, torch.clamp(rho, max=cfg.tis_cap), torch.ones_like(rho))
    assert torch.allclose(w.double(), want, rtol=1e-5)


@given(log_probs())
def test_prop_tis_sequence_weight_is_one_truncated_product_per_response(x):
    old, mu, mask = x
    w, _, cfg = _weight("tis_sequence", old, mu, mask)
    prod = torch.exp(((old - mu) * mask).sum(1).clamp(max=20))
    want = torch.clamp(prod, max=cfg.tis_cap)[:, None].expand_as(old)
    assert torch.allclose(w.double()[mask], want[mask], rtol=1e-5)
    assert bool((w[~mask] == 1).all())


@given(log_probs())
def test_prop_icepop_keeps_the_ratio_inside_its_band_and_masks_the_rest(x):
    old, mu, mask = x
    w, totals, cfg = _weight("icepop", old, mu, mask)
    rho = torch.exp(old - mu)
    inside = (rho >= cfg.icepop_low) & (rho <= cfg.icepop_high)
    assert torch.allclose(w.double()[mask & inside], rho[mask & inside], rtol=1e-5)
    assert bool((w[mask & ~inside] == 0).all())
    assert totals["correction_masked"] == float((mask & ~inside).sum())
    # icepop's bounds are what mismatch_out counts against
    assert totals["mismatch_out"] == float((mask & ~inside).sum())


@given(log_probs())
def test_prop_mask_sequence_masks_a_response_whose_product_exceeds_the_cap(x):
    old, mu, mask = x
    w, _, cfg = _weight("mask_sequence", old, mu, mask)
    log_prod = ((old - mu) * mask).sum(1)
    for i in range(old.shape[0]):
        row = w[i][mask[i]].double()
        if not len(row):
            continue
        if log_prod[i] > math.log(cfg.mask_cap):
            assert bool((row == 0).all())
        else:
            assert torch.allclose(row, torch.exp(log_prod[i]).expand_as(row), rtol=1e-5)


@given(log_probs())
def test_prop_the_gap_is_k3_abs_and_max_over_the_masked_tokens(x):
    old, mu, mask = x
    w, totals, _ = _weight("none", old, mu, mask)
    assert w is None and "correction_weight" not in totals
    lr = (old - mu)[mask]
    assert totals["mismatch_tokens"] == float(mask.sum())
    k3 = torch.exp(lr) - 1 - lr
    assert totals["mismatch_k3"] == pytest.approx(float(k3.sum()), rel=1e-9, abs=1e-12)
    assert totals["mismatch_k3"] >= 0.0  # k3 >= 0 on every token
    assert totals["mismatch_abs"] == pytest.approx(float(lr.abs().sum()), rel=1e-9, abs=1e-12)
    assert totals.get("mismatch_abs_peak", 0.0) == pytest.approx(float(lr.abs().max()) if len(lr) else 0.0)


def test_no_gap_no_correction_weight_one():
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.9, 0.1]], dtype=torch.float64))
    mask = torch.ones(2, 2, dtype=torch.bool)
    for name in ("tis", "tis_sequence", "icepop", "mask_sequence"):
        w, totals, _ = _weight(name, lp, lp, mask)
        assert bool((w == 1).all()), name
        assert totals["mismatch_k3"] == 0.0 and totals["mismatch_out"] == 0.0
        assert totals["correction_masked"] == 0.0


def test_a_tiny_gap_is_measured_in_float64():
    """A 1e-7 nat gap: k3 is 5e-15 per token, not float32's rounding of exp(x) - 1 - x."""
    mu = torch.full((1, 4), -1.0)
    old = mu + 1e-7
    _, totals, _ = _weight("none", old, mu, torch.ones(1, 4, dtype=torch.bool))
    assert totals["mismatch_k3"] / 4 == pytest.approx(0.5e-14, rel=0.2)


# --------------------------------------------------------------------------- losses take the weights
def _ctx(cfg, m, T, correction=None, is_peer=None):
    return LossContext(
        cfg,
        adv=torch.tensor([1.0, -1.0][:m]),
        weight=torch.ones(m),
        is_peer=torch.zeros(m, dtype=torch.bool) if is_peer is None else is_peer,
        src_mean=torch.full((m,), -1.0),
        correction=correction,
    )


def test_token_mean_clip_weighs_each_own_token_by_the_correction():
    """loss = -(1/sum|o|) sum_t c_t min(rho_t a, clip(rho_t) a): a masked token leaves the sum, not the
    denominator."""
    cfg = _cfg("icepop")
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.25, 0.6, 0.4]]))
    mask = torch.ones(2, 3)
    corr = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]])
    loss, _ = LOSSES.get("token_mean_clip")(lp, old, mask, _ctx(cfg, 2, 3, corr))
    rho = torch.exp(lp - old)
    a = torch.tensor([[1.0], [-1.0]])
    obj = torch.minimum(rho * a, rho.clamp(0.8, 1.28) * a)
    assert float(loss) == pytest.approx(float(-(obj * corr).sum() / 6), rel=1e-6)
    plain, _ = LOSSES.get("token_mean_clip")(lp, old, mask, _ctx(cfg, 2, 3, torch.ones(2, 3)))
    none, _ = LOSSES.get("token_mean_clip")(lp, old, mask, _ctx(cfg, 2, 3, None))
    assert float(plain) == float(none)


@pytest.mark.parametrize("loss_name", ["gspo", "hacpo"])
def test_a_response_level_loss_is_valued_at_each_responses_mean_correction(loss_name):
    """The value of a per-token weighted response term: its mean weight times its term (the weight's
    gradient rule is :func:`test_every_correcting_loss_gives_a_token_weighted_zero_no_gradient`)."""
    keys = {"gspo": {"loss": "gspo"}, "hacpo": {}}[loss_name]
    cfg = MethodConfig(name="hacpo" if loss_name == "hacpo" else "graft", correction="tis", **keys)
    cfg.validate()
    lp = torch.log(torch.tensor([[0.5, 0.4], [0.2, 0.6]]))
    old = lp.detach() + 1e-4
    mask = torch.ones(2, 2)
    loss_fn = LOSSES.get(loss_name)
    one, _ = loss_fn(lp, old, mask, _ctx(cfg, 2, 2, torch.ones(2, 2)))
    none, _ = loss_fn(lp, old, mask, _ctx(cfg, 2, 2, None))
    assert float(one) == pytest.approx(float(none), rel=1e-6)
    # row 0 weighted 0.5 on average, row 1 weighted 1: the mean over two responses (0.5 term0 + term1) / 2
    half, _ = loss_fn(lp, old, mask, _ctx(cfg, 2, 2, torch.tensor([[0.0, 1.0], [1.0, 1.0]])))
    terms = [
        loss_fn(lp[i : i + 1], old[i : i + 1], mask[i : i + 1], _ctx(cfg, 2, 2).rows(torch.tensor([i])))[0]
        for i in range(2)
    ]
    assert float(half) == pytest.approx(float(0.5 * terms[0] + terms[1]) / 2, rel=1e-5)


def _correcting_losses() -> list[str]:
    return [n for n in LOSSES.names() if LOSSES.get(n).corrects and not n.startswith("_")]


def test_every_shipped_correcting_loss_is_checked_below():
    assert set(_correcting_losses()) >= {"token_mean_clip", "gspo", "luffy", "hacpo", "ftis"}


@pytest.mark.parametrize("loss_name", _correcting_losses())
def test_every_correcting_loss_gives_a_token_weighted_zero_no_gradient(loss_name):
    """Each loss declaring ``corrects=True`` multiplies each token's term by that token's own weight (verl's
    ``pg_losses * rollout_is_weights``): a token weighted 0 (IcePop outside its band, a masked sequence)
    gets exactly zero gradient, and the others still get one. Before 0.3.1 GSPO and HACPO scaled each
    response by its mean weight, which gave a masked token its response's gradient."""
    method = {"hacpo": "hacpo", "ftis": "ftis", "luffy": "luffy"}.get(loss_name, "graft")
    keys = {"loss": loss_name} if method == "graft" else {}
    if method == "graft" and loss_name == "gspo":
        keys["weighting"] = "none"
    cfg = MethodConfig(name=method, correction="icepop", **keys)
    cfg.validate()
    obj = Objective(cfg)
    g = torch.Generator().manual_seed(3)
    T = 4
    lp0 = -torch.rand(3, T, generator=g) - 0.5
    old = lp0 + 1e-5 * torch.randn(3, T, generator=g)  # inside even GSPO's 3e-4 clip range
    t = RowTensors(
        old,
        torch.ones(3, T),
        [1.0, -0.7, 0.5],
        [1.0] * 3,
        [False, False, True],
        [True] * 3,
        [False] * 3,
        [-1.0] * 3,
        mu=old - 0.01,
        has_mu=[True, True, True],
    )
    weights = torch.ones(3, T)
    weights[0, 1] = 0.0  # an own token the correction masks out
    weights[1, 2] = 0.0
    lp = lp0.clone().requires_grad_()
    norm = obj.normalisers(t, [0, 1, 2])
    loss, _ = obj.contribution(lp, old, t, torch.tensor([0, 1, 2]), norm, weights, step=1, update_index=1)
    loss.backward()
    assert lp.grad[0, 1] == 0.0 and lp.grad[1, 2] == 0.0, lp.grad
    assert bool((lp.grad[0, [0, 2, 3]] != 0).all()) and bool((lp.grad[1, [0, 1, 3]] != 0).all()), lp.grad


def test_luffy_corrects_own_tokens_only():
    cfg = MethodConfig(name="luffy", correction="tis")
    cfg.validate()
    lp = torch.log(torch.tensor([[0.5, 0.4], [0.2, 0.6]]))
    old = lp.detach()
    mask = torch.ones(2, 2)
    peer = torch.tensor([False, True])
    base, _ = LOSSES.get("luffy")(lp, old, mask, _ctx(cfg, 2, 2, None, peer))
    corr = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # the own row masked out, the peer row's weight 1
    masked, _ = LOSSES.get("luffy")(lp, old, mask, _ctx(cfg, 2, 2, corr, peer))
    # own row: rho = 1, a = 1 -> its two tokens contribute -(1 + 1) / 4 to the base loss
    assert float(masked) == pytest.approx(float(base) + 0.5, rel=1e-6)


# --------------------------------------------------------------------------- refusals
def test_a_loss_that_takes_no_correction_is_refused_in_one_line():
    @register_loss("_no_correction_loss")
    def plain(lp, old, mask, ctx):
        return -(lp * mask).sum() / mask.sum(), {}

    try:
        with pytest.raises(ConfigError) as err:
            _cfg("tis", loss="_no_correction_loss")
        msg = str(err.value)
        assert "\n" not in msg and "_no_correction_loss" in msg and "corrects=True" in msg
        _cfg("none", loss="_no_correction_loss")  # no correction: fine
    finally:
        LOSSES._entries.pop("_no_correction_loss", None)


def test_a_correction_with_top_p_sampling_is_refused_in_one_line(make_cfg):
    with pytest.raises(ConfigError) as err:
        make_cfg({"name": "graft", "correction": "tis"}, top_p=0.9)
    assert "\n" not in str(err.value) and "top_p" in str(err.value) and "kept mass" in str(err.value)
    make_cfg({"name": "graft"}, top_p=0.9)  # measuring nothing, correcting nothing: allowed


def test_correction_keys_are_bounded():
    with pytest.raises(ConfigError, match="tis_cap"):
        _cfg("tis", tis_cap=0.5)
    with pytest.raises(ConfigError, match="icepop_high"):
        _cfg("icepop", icepop_high=0.9)
    with pytest.raises(ConfigError, match="not used"):
        _cfg("none", tis_cap=3.0)


# --------------------------------------------------------------------------- the objective measures
def test_the_objective_measures_the_gap_on_own_tokens_from_the_pass_that_gives_pi_old():
    """Row 0 (own, first update): pi_old is the forward pass's own log-probs, so its gap is lp - mu;
    row 1 is a peer's (no mu); row 2 is own and has pi_old from before the update."""
    cfg = _cfg("tis")
    obj = Objective(cfg)
    T = 3
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old = torch.zeros(3, T)
    old[2, 0] = -0.7
    mu = torch.zeros(3, T)
    mu[0, :2] = torch.tensor([-1.2, -0.3])
    mu[2, 0] = -0.5
    t = RowTensors(
        old,
        mask,
        [1.0, 1.0, -1.0],
        [1.0, 1.0, 1.0],
        [False, True, False],
        [True] * 3,
        [False] * 3,
        [-1.0] * 3,
        old_is_current=[True, False, False],
        mu=mu,
        has_mu=[True, False, True],
    )
    lp = torch.log(torch.tensor([[0.3, 0.7, 0.5], [0.2, 0.2, 0.2], [0.4, 0.5, 0.5]])).requires_grad_()
    _, stats = one_pass(obj, t, [0, 1, 2], lp)
    lr = torch.tensor([math.log(0.3) + 1.2, math.log(0.7) + 0.3, -0.7 + 0.5], dtype=torch.float64)
    assert stats["mismatch_tokens"] == 3.0
    assert stats["mismatch_abs"] == pytest.approx(float(lr.abs().sum()), rel=1e-5)
    assert stats["mismatch_k3"] == pytest.approx(float((torch.exp(lr) - 1 - lr).sum()), rel=1e-4)
    assert stats["correction_weight"] == pytest.approx(float(torch.exp(lr).clamp(max=2.0).sum()), rel=1e-5)


def test_no_engine_log_probs_no_gap():
    """top-p sampling (``engine_logprobs=False``: no mu): nothing measured, nothing corrected."""
    cfg = _cfg("none")
    t = RowTensors(torch.zeros(1, 2), torch.ones(1, 2), [1.0], [1.0], [False], [True], [False], [-1.0])
    _, stats = one_pass(Objective(cfg), t, [0], torch.full((1, 2), -0.5, requires_grad=True))
    assert not any(k.startswith(("mismatch", "correction")) for k in stats)
