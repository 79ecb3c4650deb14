"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"): GRPO
whose advantage is not divided by the group's standard deviation, which up-weights prompts that are
nearly always solved or nearly always failed. The method is GRPO with one part swapped: ``grpo`` with
``method.advantage: dr_grpo`` trains the same.

graft-rl's loss is already a token mean over the whole minibatch (no per-response ``1/|o|``), so
the paper's second change, dropping the length normalisation, holds as it is; the remaining
difference is the normaliser, the minibatch's token count here vs a fixed constant in the paper.
"""

from __future__ import annotations

from graft_rl.algo import dr_grpo_advantages as unnormalised_advantages
from graft_rl.errors import removed_names
from graft_rl.methods.base import register_method
from graft_rl.methods.grpo import GRPO

__all__ = ["DrGRPO", "unnormalised_advantages"]


@register_method("dr_grpo")
class DrGRPO(GRPO):
    """GRPO with Dr. GRPO's unnormalised advantages (every GRPO key, dynamic sampling included, applies)."""

    preset = {**GRPO.preset, "advantage": "dr_grpo"}
    source = "Dr. GRPO (Liu et al., 2025, Eq. 3): paper text"


__getattr__ = removed_names(
    __name__,
    {
        "DrGRPOExchange": 'removed in 0.1.0 (methods are presets of parts): preset = {**GRPO.preset, "advantage": "dr_grpo"}',
    },
)
