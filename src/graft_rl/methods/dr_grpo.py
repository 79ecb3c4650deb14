"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"), the
worked example of ``docs/contributing.md``: GRPO whose advantage is not divided by the group's
standard deviation, which up-weights prompts that are nearly always solved or nearly always failed.

graft-rl's loss is already a token mean over the whole minibatch (no per-response ``1/|o|``), so
the paper's second change, dropping the length normalisation, holds as it is; the remaining
difference is the normaliser, the minibatch's token count here vs a fixed constant in the paper.
"""

from __future__ import annotations

import torch

from graft_rl.methods.base import register_method
from graft_rl.methods.grpo import GRPO, OwnGroupsOnly

__all__ = ["DrGRPO", "unnormalised_advantages"]


def unnormalised_advantages(rewards: torch.Tensor) -> torch.Tensor:
    r"""Dr. GRPO's advantage :math:`\hat A_i = r_i - \operatorname{mean}(r)` per group (its Eq. 3).

    Args:
        rewards: ``[G, n]``.
    Returns:
        ``[G, n]``, in ``rewards``' dtype.

    Example:
        >>> unnormalised_advantages(torch.tensor([[1., 0., 0., 0.], [1., 1., 1., 1.]]))
        tensor([[ 0.7500, -0.2500, -0.2500, -0.2500],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    if rewards.dim() != 2:
        raise ValueError(f"unnormalised_advantages: rewards must be [G, n], got {tuple(rewards.shape)}")
    return rewards - rewards.mean(dim=1, keepdim=True)


class DrGRPOExchange(OwnGroupsOnly):
    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return unnormalised_advantages(rewards)


@register_method("dr_grpo")
class DrGRPO(GRPO):
    """GRPO with Dr. GRPO's unnormalised advantages (every GRPO key, dynamic sampling included, applies)."""

    def exchange(self):
        return DrGRPOExchange(self.cfg)
