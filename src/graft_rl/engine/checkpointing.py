"""Checkpoints and exact resume (docs/design.md, layer 5; docs/reliability.md).

:class:`Checkpoints` is the trainer's collaborator for step 6 and resume: ``checkpoints/step_N``
holds every policy's weights (``save_pretrained``), optimiser and RNG state and the trainer's own
state (step, success history, the config), written under a temporary name and renamed; resume
takes the newest complete checkpoint (skipping damaged ones, saying so), refuses a config change
that alters results, and drops what the interrupted run wrote after the checkpoint, which the
resumed run recomputes identically. With Ray, every policy's actors write their part at once.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from graft_rl.engine.config import ConfigError, load_config, to_dict
from graft_rl.engine.provenance import CHANGE_KINDS, CHANGES, changes
from graft_rl.engine.rundir import (
    HARMLESS_KEYS,
    RunDirError,
    checkpoint_problem,
    config_changes,
    read_log,
    remove_dir,
    replace_dir,
    rewrite_log,
    run_identity,
    write_manifest,
    write_text_atomic,
)
from graft_rl.engine.store import RecordStore
from graft_rl.errors import MissingSourceError

if TYPE_CHECKING:
    from graft_rl.engine.handles import WorkerHandle

__all__ = [
    "Checkpoints",
    "CheckpointError",
    "COMMITTED",
    "is_write_error",
    "write_error_text",
    "cpu_threads",
    "gone_source",
]

#: ``best/.committed``: the best weights as of the newest checkpoint (see :meth:`Checkpoints.commit_best`).
COMMITTED = ".committed"


class CheckpointError(OSError):
    """A checkpoint could not be written (disk full, read-only directory, ...); the message says which."""


def cpu_threads(cfg) -> dict[str, int]:
    """The torch threads each CPU policy computes with (``execution: local``: ``torch_threads``, else this
    process's count; ``ray``: ``ray.torch_threads``, else ``ray.num_cpus``). Sums over another number of
    threads round differently, so a run resumed with other counts is not the uninterrupted run."""
    import torch

    if cfg.execution == "ray":
        n = cfg.ray.torch_threads or max(1, int(cfg.ray.num_cpus))
    else:
        n = cfg.torch_threads or torch.get_num_threads()
    return {pc.name: int(n) for pc in cfg.policies if not pc.device.startswith("cuda")}


def _check_threads(saved: dict | None, now: dict[str, int], run_dir: Path, ckpt: str) -> None:
    """One line when a CPU policy would resume with another number of torch threads than it ran with."""
    for name, n in (saved or {}).items():
        if name in now and now[name] != n:
            raise ConfigError(
                f"{run_dir}: policy {name} computed with {n} torch threads up to checkpoint {ckpt} and would resume "
                f"with {now[name]}; sums over other thread counts round differently, so the run would not be the "
                f"uninterrupted one: resume with torch_threads={n} (execution: local) or ray.torch_threads={n}"
            )


class Checkpoints:
    """Step 6 of a training step and exact resume: ``checkpoints/step_N`` of a run in ``run_dir``
    (its config ``cfg``, its record ``store``; ``threads`` and ``provenance`` as the run started,
    recorded in every checkpoint)."""

    def __init__(self, cfg, run_dir: Path, store: RecordStore, threads: dict[str, int], provenance: dict):
        self.cfg, self.run_dir, self.store, self.threads, self.provenance = cfg, run_dir, store, threads, provenance

    def due(self, step: int, last: int) -> bool:
        """Whether step ``step`` of a run of ``last`` steps ends with a checkpoint."""
        return step % self.cfg.checkpoint_every == 0 or step == last

    def save(self, step: int, workers: Mapping[str, WorkerHandle], method_state: dict, best: dict) -> Path:
        """Write ``checkpoints/step_N`` (every policy's part from its worker, at once under Ray; the
        method's per-step state) under a temporary name, rename it, prune old ones, and commit ``best``."""
        root = self.run_dir / "checkpoints"
        final = root / f"step_{step:06d}"
        tmp = root / f".step_{step:06d}.tmp"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            # absolute: an actor does not work in the driver's directory
            pending = [handle.save(str((tmp / name).absolute())) for name, handle in workers.items()]
            for p in pending:
                p.get()
            state = {
                "step": step,
                "method_state": method_state,
                "config": to_dict(self.cfg),
                "threads": self.threads,  # as the run started
                "provenance": self.provenance,  # the rewards' sources and data files (engine/provenance.py)
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            # every file's sha256, the step and the run: resume trusts a checkpoint only if they still match
            write_manifest(tmp, step, run_identity(self.run_dir))
            replace_dir(tmp, final)
        except Exception as exc:  # noqa: BLE001 (OSError; torch's and safetensors' write errors)
            if not isinstance(exc, OSError) and not is_write_error(exc):
                raise
            raise CheckpointError(f"cannot write checkpoint {final}: {write_error_text(exc, root)}") from None
        kept = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in kept[: -self.cfg.keep_checkpoints]:
            remove_dir(old)  # renamed away first: never a half-deleted step_N
        self.commit_best(step, best)
        return final

    # ------------------------------------------------------------------ best/ and the checkpoint it belongs to
    def commit_best(self, step: int, best: dict[str, dict]) -> None:
        """After checkpoint ``step``: keep the best weights as of that step in ``best/.committed`` (hard
        links, no copy). A run resumed from this checkpoint drops the validations after it, so a best/
        written later (the weights of a step the resumed run recomputes) is replaced by these."""
        committed = self.run_dir / "best" / COMMITTED
        record = _read_json(committed / "best.json") or {}
        changed = False
        for name, b in best.items():
            if b["step"] <= step and record.get(name) != b and (self.run_dir / "best" / name).is_dir():
                tmp = committed / f".{name}.tmp"
                _link_tree(self.run_dir / "best" / name, tmp)
                replace_dir(tmp, committed / name)
                record[name] = b
                changed = True
        if changed:
            write_text_atomic(committed / "best.json", json.dumps(record, indent=1))

    def reconcile_best(self, best: dict[str, dict]) -> None:
        """On resume: make ``best/`` hold what the (truncated) validation log names as ``best`` (updated
        in place). A best/ written after the checkpoint gives way to the one committed with it; without
        one, it is removed (saying so) rather than left naming weights the logs do not mention."""
        best_dir = self.run_dir / "best"
        on_disk = _read_json(best_dir / "best.json") or {}
        if on_disk == best:
            return
        committed = _read_json(best_dir / COMMITTED / "best.json") or {}
        for name in set(on_disk) | set(best):
            want = best.get(name)
            if on_disk.get(name) == want:
                continue
            if want is not None and committed.get(name) == want:
                tmp = best_dir / f".{name}.tmp"
                _link_tree(best_dir / COMMITTED / name, tmp)
                replace_dir(tmp, best_dir / name)
                print(
                    f"graft train: best/{name} restored to step {want['step']}'s weights (it held step "
                    f"{on_disk.get(name, {}).get('step')}'s, from after the checkpoint)"
                )
                continue
            remove_dir(best_dir / name)
            best.pop(name, None)
            print(
                f"graft train: best/{name} removed: it held step {on_disk.get(name, {}).get('step')}'s weights, from after "
                f"the checkpoint; the next validation writes it again"
            )
        write_text_atomic(best_dir / "best.json", json.dumps(best, indent=1))

    # ------------------------------------------------------------------ resume
    def latest(self, announce: bool = False) -> Path | None:
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
            raise CheckpointError(
                f"{root}: every checkpoint is damaged ({'; '.join(problems)}); nothing was deleted. "
                f"Restore a copy of one, or start a new run in another run_dir"
            )
        return None

    def check(self, ckpt: Path, total_steps: int, allow_changed: Sequence[str]) -> list[tuple[str, str]]:
        """Refuse, before anything is rewritten, to resume from ``ckpt`` what would not be the checkpointed
        run: :meth:`check_config`, then :meth:`check_provenance`; returns the changes a resume goes on with."""
        self.check_config(ckpt, total_steps)
        return self.check_provenance(ckpt, allow_changed)

    def check_config(self, ckpt: Path, total_steps: int) -> None:
        """Refuse to resume with a config whose results would differ from the checkpointed run's, or
        with fewer steps than the checkpoint has done (it would rewrite config.yaml to a shorter run)."""
        for link in sorted(p for p in (self.run_dir / "best").glob("*") if p.is_symlink()):
            raise RunDirError(
                f"{link} is a symbolic link; graft-rl writes best/<policy> itself and does not write through a "
                f"link (its target is left as it is): remove the link, then resume"
            )
        state = json.loads((ckpt / "trainer_state.json").read_text())
        done = int(state["step"])
        if total_steps < done:
            raise ConfigError(
                f"{self.run_dir}: the run has done {done} steps (checkpoint {ckpt.name}) and would stop at "
                f"{total_steps}; a resumed run may raise steps (or epochs), not lower them"
            )
        _check_threads(state.get("threads"), self.threads, self.run_dir, ckpt.name)
        saved = state.get("config")
        if saved is None:
            return  # a checkpoint from before configs were recorded in it
        found = config_changes(_normalised(saved), to_dict(self.cfg))
        if found:
            key, before, now = found[0]
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise ConfigError(
                f"{self.run_dir}: config key {key} changed since checkpoint {ckpt.name} ({before!r} -> {now!r}){more}; "
                f"a resumed run may change only {', '.join(HARMLESS_KEYS[1:])}"
            )

    def check_provenance(self, ckpt: Path, allow_changed: Sequence[str]) -> list[tuple[str, str]]:
        """Compare what the checkpoint was trained on and with (:func:`~graft_rl.engine.provenance.fingerprint`)
        with today's: a new version of a built-in verifier's package is reported; a changed reward source
        or data file is refused in one line unless ``allow_changed`` names it. Returns those allowed, for
        :meth:`record_changes` (``changes.jsonl``, which ``graft analyze`` marks)."""
        saved = (_read_json(ckpt / "trainer_state.json") or {}).get("provenance")
        if saved is None:  # a checkpoint from before runs recorded it
            return []
        found = changes(saved, self.provenance)
        for kind, what in found:
            if kind == "version":
                print(f"graft train: {what} since checkpoint {ckpt.name} (reported; a resume goes on with it)")
        refused = [(k, w) for k, w in found if k in CHANGE_KINDS and k not in allow_changed]
        if refused:
            kind, what = refused[0]
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise ConfigError(
                f"{self.run_dir}: {what} since checkpoint {ckpt.name}{more}; its results would mix two {kind}s. "
                f"Restore it, or resume with --allow-changed {kind} to go on with it (the change is recorded)"
            )
        return [(k, w) for k, w in found if k in CHANGE_KINDS]

    def record_changes(self, step: int, found: list[tuple[str, str]]) -> None:
        """``changes.jsonl``: one line per change a resume went on with, at the first step it affects;
        lines after the checkpoint (from an interrupted resume) are dropped first, as the logs are."""
        path = self.run_dir / CHANGES
        records = [r for r in read_log(path)[0] if r["step"] < step]
        records += [{"step": step, "kind": k, "change": w} for k, w in found]
        for _, what in found:
            print(f"graft train: {what}; going on with it from step {step} (--allow-changed, recorded in {CHANGES})")
        if records or path.exists():
            rewrite_log(path, records)

    def restart_from_scratch(self) -> None:
        """A run with no checkpoint: drop its logs, records, validation and best, as a fresh run would."""
        for log in (self.run_dir / "metrics.jsonl", self.run_dir / "validation.jsonl", self.run_dir / CHANGES):
            log.unlink(missing_ok=True)
        self.store.truncate_after(0)
        remove_dir(self.run_dir / "best")

    def restore(
        self, ckpt: Path, workers: Mapping[str, WorkerHandle], found: list[tuple[str, str]]
    ) -> tuple[dict, int]:
        """Load every policy's part of ``ckpt`` on its worker, record the allowed changes ``found``, and
        drop what the interrupted run wrote after the checkpoint (recomputed identically). Returns the
        method's per-step state (e.g. HACPO's capability window) and the step: ``(state, step)``."""
        state = json.loads((ckpt / "trainer_state.json").read_text())
        step = int(state["step"])
        for p in [handle.load_state(str((ckpt / name).absolute())) for name, handle in workers.items()]:
            p.get()
        self.record_changes(step + 1, found)
        for log in (self.run_dir / "metrics.jsonl", self.run_dir / "validation.jsonl"):
            records, torn = read_log(log)
            if torn:
                print(f"graft train: {log.name}: dropped a torn last line (the machine stopped mid-write)")
            if log.exists():
                rewrite_log(log, [r for r in records if r["step"] <= step])
        self.store.truncate_after(step)
        # older checkpoints name the method's state success_history
        return state.get("method_state", {"success_history": state.get("success_history", {})}), step


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _link_tree(src: Path, dst: Path) -> None:
    """``dst``: a copy of directory ``src`` made of hard links (a copy where links are not possible).
    Safe because every file in best/ and checkpoints is replaced by a new file, never written in place."""
    if dst.exists():
        shutil.rmtree(dst)

    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link)


def is_write_error(exc: BaseException) -> bool:
    """torch.save and safetensors report a full disk as a RuntimeError (zip writer) or a SafetensorError
    (serialisation), which is neither a RuntimeError nor an OSError."""
    if type(exc).__name__ == "SafetensorError":
        return True
    text = str(exc)
    return any(
        k in text
        for k in (
            "PytorchStreamWriter",
            "enforce fail",
            "No space left",
            "file write failed",
            "unexpected pos",
            "Error while serializing",
            "SafetensorError",
        )
    )


def write_error_text(exc: BaseException, where: Path) -> str:
    """One line for a failed write: the OS's reason, or for torch's zip writer (``inline_container.cc
    ... unexpected pos``) what it almost always means, with the space left on that disk."""
    try:
        free = f"; {shutil.disk_usage(where if where.exists() else where.parent).free / 2**20:,.0f} MB free there"
    except OSError:
        free = ""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}{free}"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if "No space left" in str(exc) or "StorageFull" in str(exc):
        return f"No space left on device{free}"
    if is_write_error(exc):
        return f"the disk is full or failed while writing ({type(exc).__name__} from torch/safetensors){free}"
    return f"{type(exc).__name__}: {first}{free}"


def _normalised(saved: dict) -> dict:
    """A checkpoint's config as this version writes it (e.g. without other methods' keys, which configs
    written before methods became plugins list), so that only real changes count; as saved if it does
    not load."""
    try:
        return to_dict(load_config(saved, saved=True))
    except (ConfigError, TypeError, ValueError):
        return saved


def gone_source(run_dir: Path, exc: MissingSourceError) -> ConfigError:
    """One line for a plugin or reward file that is gone at ``--resume``: which file, what the run
    recorded of it (its sha256, in the newest checkpoint that has it) and how to go on. The config is
    not damaged, so nothing falls back to a checkpoint's copy of it."""

    def recorded(node, kind: str | None = None):
        if isinstance(node, dict):
            if node.get("source") == str(exc.path) and "sha256" in node:
                return node, kind
            for key, value in node.items():
                found = recorded(value, kind or {"plugins": "plugin", "rewards": "reward"}.get(key))
                if found:
                    return found
        return None

    for ckpt in sorted((run_dir / "checkpoints").glob("step_*"), reverse=True):
        hit = recorded((_read_json(ckpt / "trainer_state.json") or {}).get("provenance"))
        if hit:
            (fp, kind), where = hit, ckpt.name
            break
    else:
        fp, kind, where = {}, None, None
    kind = kind or ("reward" if "data.reward" in str(exc) else "plugin")
    seen = (
        f"the run recorded it in checkpoint {where} (sha256 {str(fp.get('sha256'))[:12]})"
        if where
        else "no checkpoint recorded it"
    )
    return ConfigError(
        f"{exc}; {seen}: put it back at {exc.path} and resume again, or name where it is now in "
        f"{run_dir / 'config.yaml'} (another content also needs --allow-changed {kind})"
    )
