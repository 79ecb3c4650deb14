"""pi_old is scored beforehand only where the first update's own forward pass cannot supply it."""

from __future__ import annotations

import pytest
import torch
from passes import one_pass

from graft_rl import algo
from graft_rl.engine.config import MethodConfig
from graft_rl.engine.trainer import Trainer
from graft_rl.methods import build_objective
from graft_rl.methods.objectives import RowTensors
from graft_rl.policy import Policy


def _rows(old, mask, current=None):
    m = len(mask)
    return RowTensors(
        old,
        mask,
        [1.0, -1.0, 0.5][:m],
        [1.0] * m,
        [False] * m,
        [True] * m,
        [False] * m,
        [0.0] * m,
        old_is_current=current,
    )


@pytest.mark.parametrize("name", ["graft", "luffy", "hacpo"])
def test_old_from_the_current_pass_equals_pre_scored_old(name):
    """In the first update pi_old is the current policy: taking it from the forward pass (detached)
    gives exactly the loss and gradient of scoring it beforehand."""
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    objective = build_objective(MethodConfig(name=name))
    out = []
    for rows in (_rows(torch.zeros(3, 3), mask, [True] * 3), None):
        lp = (torch.randn(3, 3, generator=torch.Generator().manual_seed(1)) - 1).requires_grad_()
        rows = rows or _rows(lp.detach().clone(), mask)
        loss, _ = one_pass(objective, rows, [0, 1, 2], lp, step=1)
        loss.backward()
        out.append((loss.detach(), lp.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def _spy_scoring(monkeypatch):
    """The number of rows of every scoring pass (pi_old) the policies run."""
    calls: list[int] = []
    real = Policy.token_logprobs

    def spy(self, batch, model=None):
        calls.append(len(batch))
        return real(self, batch, model)

    monkeypatch.setattr(Policy, "token_logprobs", spy)
    return calls


@pytest.mark.slow
def test_one_update_per_step_scores_no_own_row_and_never_clips(make_cfg, fake_rewards, monkeypatch):
    """GRPO with minibatch = prompt batch: no separate pi_old pass at all, ratio exactly 1."""
    calls = _spy_scoring(monkeypatch)
    tr = Trainer(make_cfg({"name": "grpo"}, steps=2, minibatch=8), show_progress=False)
    lines = tr.run()
    tr.close()
    assert calls == []
    assert all(line["clip_frac_self"] == 0.0 and line["minibatches"] == 1 for line in lines)


@pytest.mark.slow
def test_graft_scores_peer_rows_and_rows_after_the_first_update(make_cfg, fake_rewards, monkeypatch):
    seen = {}
    real_order = algo.minibatch_order

    def spy_order(is_peer, size, position, gen):
        out = real_order(is_peer, size, position, gen)
        seen.setdefault("orders", []).append((is_peer.clone(), out))
        return out

    monkeypatch.setattr(algo, "minibatch_order", spy_order)
    calls = _spy_scoring(monkeypatch)
    tr = Trainer(make_cfg({"name": "graft"}, steps=1, minibatch=2), show_progress=False)
    tr.run()
    tr.close()
    n = 4
    expected = []
    for is_peer, order in seen["orders"]:  # per receiver: its peer rows, then the own rows after the first update
        peer_rows = int(is_peer.sum()) * n
        first_own = sum(n for g in order[0].tolist() if not is_peer[g])
        later_own = int((~is_peer).sum()) * n - first_own
        expected += [x for x in (peer_rows, later_own) if x]
    assert calls == expected and len(seen["orders"]) == 2
