"""Validation during training (graft_rl.engine.validation): samples, selection of best/."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_validation_samples_default_to_the_papers_8_and_train_says_what_it_uses(
    make_cfg, tiny_data, fake_rewards, capsys
):
    from graft_rl.engine.config import ValidationConfig
    from graft_rl.engine.trainer import Trainer

    assert ValidationConfig().samples == 8
    tr = Trainer(
        make_cfg({"name": "grpo"}, steps=1, run="val8", validation={"data": [str(tiny_data)], "every": 1, "limit": 2}),
        show_progress=False,
    )
    tr.run()
    out = " ".join(capsys.readouterr().out.split())
    assert "validation every 1 steps: 8 samples per problem at temperature 0.6" in out
