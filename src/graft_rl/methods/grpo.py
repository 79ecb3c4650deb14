"""GRPO (Section 3): each policy trains on its own groups only; with ``dynamic_sampling``, DAPO's
filter keeps the groups whose rewards vary and refills the batch (Appendix B, "GRPO + dynamic
sampling")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_rl import algo
from graft_rl.errors import ConfigError, removed_names
from graft_rl.methods.base import Method, RolloutFilter, register_method

__all__ = ["GRPO"]


def _rewards_vary(group) -> bool:
    """DAPO's filter for one group (:func:`graft_rl.algo.dynamic_sampling_mask`)."""
    return bool(algo.dynamic_sampling_mask(torch.tensor([group.rewards], dtype=torch.float64))[0])


@register_method("grpo")
class GRPO(Method):
    """Group-relative policy optimisation on the policy's own rollouts: ``grpo`` advantage,
    ``token_mean_clip`` loss, no peer."""

    @dataclass
    class Params:
        dynamic_sampling: bool = False  # DAPO's dynamic sampling: keep groups with mixed rewards, refill
        # DAPO's filter_groups.max_num_gen_batches: generation batches per step, the first included; past
        # it the run stops with one line ("the data may be too hard"). <= 0: no limit, as in verl (whose
        # yaml default that is); 10 is what DAPO's README and run scripts use, and a run cannot loop forever
        max_num_gen_batches: int = 10
        # DAPO's gen_prompt_bsz / train_prompt_bsz (3 in its run scripts): each refill batch generates this
        # many times prompt_batch prompts. The step's first batch stays prompt_batch: the prompts every
        # policy shares (DAPO's first batch is 3x too)
        refill_factor: int = 3

    uses_peers = False
    source = "GRPO as the GRAFT paper runs it (Section 3); DAPO's dynamic sampling from its code (recipe/dapo)"

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.params["refill_factor"] < 1:
            raise ConfigError(f"method.refill_factor must be >= 1, got {cfg.params['refill_factor']}")

    def rollout_filter(self) -> RolloutFilter | None:
        p = self.cfg.params
        return (
            RolloutFilter(_rewards_vary, p["max_num_gen_batches"], p["refill_factor"])
            if p["dynamic_sampling"]
            else None
        )


__getattr__ = removed_names(
    __name__,
    {
        "OwnGroupsOnly": "removed in 0.1.0 (methods are presets of parts): a method without peers sets uses_peers = False, as GRPO does",
    },
)
