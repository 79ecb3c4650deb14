"""Checkpoints and exact resume (SPEC §5, §6; issue 14; SPEC §4 layer 5).

:class:`Checkpointing` is a part of :class:`~graft_rl.trainer.Trainer`: ``checkpoints/step_N``
holds every policy's weights (``save_pretrained``), optimiser and RNG state and the trainer's own
state (step, success history, the config), written under a temporary name and renamed; resume
takes the newest complete checkpoint (skipping damaged ones, saying so), refuses a config change
that alters results, and drops what the interrupted run wrote after the checkpoint, which the
resumed run recomputes identically. With Ray, every policy's actors write their part at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from graft_rl.config import ConfigError, to_dict
from graft_rl.rundir import (
    HARMLESS_KEYS,
    checkpoint_problem,
    config_changes,
    read_log,
    remove_dir,
    replace_dir,
    rewrite_log,
    write_manifest,
)

__all__ = ["Checkpointing", "CheckpointError"]


class CheckpointError(OSError):
    """A checkpoint could not be written (disk full, read-only directory, ...); the message says which."""


class Checkpointing:
    """Checkpoint writing, choosing and restoring; mixed into the trainer, whose ``cfg``, ``run_dir``,
    ``policies``, ``store``, ``success_history``, ``start_step`` and ``_submit``/``_result``/``_call`` it uses."""

    def save_checkpoint(self, step: int) -> Path:
        """Write ``checkpoints/step_N`` under a temporary name, rename it, then prune old ones."""
        root = self.run_dir / "checkpoints"
        final = root / f"step_{step:06d}"
        tmp = root / f".step_{step:06d}.tmp"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            pending = [self._submit(name, "save", str(tmp / name)) for name in self.policies]  # at once under Ray
            for handle in pending:
                self._result(handle)
            state = {"step": step, "success_history": {k: list(v) for k, v in self.success_history.items()},
                     "config": to_dict(self.cfg)}
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            write_manifest(tmp)  # every file's sha256: resume trusts a checkpoint only if they still match
            replace_dir(tmp, final)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and not _is_write_error(exc):
                raise
            raise CheckpointError(f"cannot write checkpoint {final}: {_first_line(exc)}") from None
        kept = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in kept[: -self.cfg.keep_checkpoints]:
            remove_dir(old)  # renamed away first: never a half-deleted step_N
        return final

    def _latest_checkpoint(self, announce: bool = False) -> Path | None:
        """The newest checkpoint whose files match their checksums and are readable (damaged ones are
        skipped, saying so); None if there is none. Checkpoints that are all damaged raise
        :class:`CheckpointError` when ``announce`` (resume): nothing is deleted or retrained then."""
        root = self.run_dir / "checkpoints"
        steps = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True) if root.is_dir() else []
        names = [pc.name for pc in self.cfg.policies]
        problems = []
        for ckpt in steps:
            problem = checkpoint_problem(ckpt, names)
            if problem is None:
                return ckpt
            problems.append(f"{ckpt.name}: {problem}")
            if announce:
                print(f"graft train: checkpoint {ckpt.name} is damaged ({problem}); trying the one before it")
        if steps and announce:
            raise CheckpointError(f"{root}: every checkpoint is damaged ({'; '.join(problems)}); nothing was deleted. "
                                  f"Restore a copy of one, or start a new run in another run_dir")
        return None

    def _check_config(self, ckpt: Path) -> None:
        """Refuse to resume with a config whose results would differ from the checkpointed run's."""
        saved = json.loads((ckpt / "trainer_state.json").read_text()).get("config")
        if saved is None:
            return  # a checkpoint from before configs were recorded in it
        changes = config_changes(saved, to_dict(self.cfg))
        if changes:
            key, before, now = changes[0]
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise ConfigError(
                f"{self.run_dir}: config key {key} changed since checkpoint {ckpt.name} ({before!r} -> {now!r}){more}; "
                f"a resumed run may change only {', '.join(HARMLESS_KEYS[1:])}"
            )

    def _restart_from_scratch(self) -> None:
        """A run with no checkpoint: drop its logs, records, validation and best, as a fresh run would."""
        for log in (self.run_dir / "metrics.jsonl", self.run_dir / "validation.jsonl"):
            log.unlink(missing_ok=True)
        self.store.truncate_after(0)
        remove_dir(self.run_dir / "best")

    def _restore(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        step = int(state["step"])
        for handle in [self._submit(name, "load_state", str(ckpt / name)) for name in self.policies]:
            self._result(handle)
        for k, v in state["success_history"].items():
            if k in self.success_history:
                self.success_history[k].extend(v)
        self.start_step = step + 1
        # drop what the interrupted run wrote after the checkpoint: it is recomputed identically
        for log in (self.run_dir / "metrics.jsonl", self.run_dir / "validation.jsonl"):
            records, torn = read_log(log)
            if torn:
                print(f"graft train: {log.name}: dropped a torn last line (the machine stopped mid-write)")
            if log.exists():
                rewrite_log(log, [r for r in records if r["step"] <= step])
        self.store.truncate_after(step)



def _is_write_error(exc: BaseException) -> bool:
    """torch.save reports a full disk as a RuntimeError from its zip writer."""
    text = str(exc)
    return any(k in text for k in ("PytorchStreamWriter", "enforce fail", "No space left", "file write failed"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
