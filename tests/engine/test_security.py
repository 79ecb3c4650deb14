"""Nothing a run reads back can run code (issue 40, item 5; docs/reliability.md, "Security"): a
checkpoint's state loads with ``weights_only=True``, a pickled reward loads only from this process's
private folder, and a config cannot name a pickle."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from graft_rl.commands.cli import main
from graft_rl.engine.rundir import write_manifest
from graft_rl.engine.trainer import Trainer
from graft_rl.rewards import RewardError, resolve_reward


class _Payload:
    """What a crafted ``policy_state.pt`` carries: unpickling it calls ``os.makedirs(marker)``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_a_crafted_checkpoint_is_refused_in_one_line_and_runs_nothing(make_cfg, fake_rewards, tmp_path, capsys):
    cfg = make_cfg(steps=2, run="crafted", checkpoint_every=2)
    Trainer(cfg, show_progress=False).run()
    ckpt = Path(cfg.run_dir) / "checkpoints" / "step_000002"
    state_file = ckpt / "A" / "policy_state.pt"
    state = torch.load(state_file, weights_only=True)  # what graft-rl writes loads as plain values
    marker = tmp_path / "payload_ran"
    torch.save({**state, "extra": _Payload(marker)}, state_file)
    write_manifest(ckpt, 2, (Path(cfg.run_dir) / "run_id").read_text().strip())  # checksums match
    rc = main(["train", "--resume", str(cfg.run_dir), "--no-progress", "steps=3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not marker.exists()
    assert err.count("\n") == 0 and "policy_state.pt: refused" in err and "could run code" in err


def test_the_policy_state_graft_rl_writes_holds_only_plain_values(make_cfg, fake_rewards):
    from graft_rl.policy.training import load_state_file

    cfg = make_cfg(steps=1, run="plain_state")
    Trainer(cfg, show_progress=False).run()
    state = load_state_file(Path(cfg.run_dir) / "checkpoints" / "step_000001" / "B" / "policy_state.pt")
    assert set(state) == {"optimizer", "torch_rng", "weights_version"} and isinstance(state["weights_version"], int)


def test_a_config_cannot_name_a_pickled_reward(tmp_path):
    import cloudpickle

    target = tmp_path / "r.pkl"
    target.write_bytes(cloudpickle.dumps(lambda responses, problems: [1.0] * len(responses)))
    with pytest.raises(RewardError, match=r"a pickled callable is not a reward a config can name"):
        resolve_reward(f"pickle:{target}")


def _pickled_target():
    offset = 1.0

    def shaped(responses, problems):
        return [offset] * len(responses)

    return resolve_reward(shaped)._worker_target()


def test_a_pickled_reward_is_written_to_a_private_folder_named_by_its_content():
    from graft_rl.rewards.custom import PICKLE_PREFIX, load_target

    path = Path(_pickled_target().removeprefix(PICKLE_PREFIX))
    st = path.parent.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert path.parent.name.startswith("graft_rl_rewards_") and path.parent.name != f"graft_rl_rewards_{os.getuid()}"
    assert load_target(f"{PICKLE_PREFIX}{path}")(["a"], [{}]) == [1.0]


@pytest.mark.parametrize("tamper", ["folder open to others", "content swapped"])
def test_a_pickle_outside_a_private_folder_or_swapped_is_refused(tmp_path, tamper, monkeypatch):
    import cloudpickle

    from graft_rl.rewards import custom
    from graft_rl.rewards.custom import PICKLE_PREFIX, load_target

    marker = tmp_path / "ran"
    evil = cloudpickle.dumps(_Payload(marker))
    if tamper == "folder open to others":
        import hashlib

        folder = tmp_path / "shared"
        folder.mkdir(mode=0o755)
        folder.chmod(0o755)
        path = folder / f"{hashlib.sha256(evil).hexdigest()[:24]}.pkl"
        path.write_bytes(evil)
        message = "not a private folder"
    else:
        path = Path(_pickled_target().removeprefix(PICKLE_PREFIX))
        path.write_bytes(evil)  # another process of this user swapped it: its name no longer matches
        monkeypatch.setattr(custom, "_CACHE", {})  # as a verifier worker that had not loaded it yet
        message = "sha256 differs from its name"
    with pytest.raises(PermissionError, match=message):
        load_target(f"{PICKLE_PREFIX}{path}")
    assert not marker.exists()
