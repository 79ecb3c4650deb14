"""SGT's auxiliary NLL (Appendix B) and the rule that a peer response cut at the receiver's budget
leaves the loss: the cut target is trained neither by the policy-gradient term nor by the NLL."""

from __future__ import annotations

import torch
from passes import one_pass

from graft_rl.methods import MethodConfig, build_objective
from graft_rl.methods.objectives import RowTensors


def _rows(aux_included: bool) -> RowTensors:
    # two own responses and one auxiliary target (a correct peer response)
    M, T = 3, 4
    return RowTensors(
        torch.full((M, T), -1.0),
        torch.ones(M, T),
        [1.0, -1.0, 0.0],
        [1.0] * M,
        [False, False, True],
        [True, True, aux_included],
        [False, False, True],
        [-1.0] * M,
    )


def _loss(t: RowTensors, lp: torch.Tensor) -> torch.Tensor:
    cfg = MethodConfig(name="sgt", sgt_coef=0.5)
    cfg.validate()
    loss, _ = one_pass(build_objective(cfg), t, [0, 1, 2], lp, step=1)
    return loss


def test_an_included_target_adds_its_weighted_token_mean_nll():
    lp = torch.full((3, 4), -1.0, requires_grad=True)
    with_aux, without = _loss(_rows(True), lp), _loss(_rows(False), lp)
    assert torch.isclose(with_aux - without, torch.tensor(0.5 * 1.0))  # sgt_coef x mean(-log p) = 0.5 x 1


def test_a_cut_target_leaves_the_nll_too():
    t = _rows(False)
    assert float(t.aux_mask([0, 1, 2]).sum()) == 0.0
    lp = torch.full((3, 4), -1.0, requires_grad=True)
    _loss(t, lp).backward()
    assert float(lp.grad[2].abs().sum()) == 0.0  # no gradient reaches the cut target's tokens
