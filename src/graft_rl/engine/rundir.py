"""The run directory's integrity (docs/reliability.md): an exclusive lock, JSONL logs that survive
a torn last line, directories replaced atomically, checkpoints checked before they are trusted,
and the config check on resume.

Guarantees (tested in ``tests/engine/test_reliability.py``, summarised in docs/reliability.md):

- one ``graft train`` per run directory at a time (``flock`` on ``RUN_DIR/.lock``, holder's pid in it);
- a log line is either whole or, if the machine died while writing the last one, ignored;
- ``best/<policy>`` and checkpoints appear under their final name only when complete;
- resume uses the newest *complete* checkpoint and says so when it skips a damaged one;
- resume refuses a config change that alters results, naming the key.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import zipfile
from pathlib import Path

__all__ = [
    "RunDirError",
    "RunLock",
    "read_log",
    "RENAMED_KEYS",
    "rewrite_log",
    "replace_dir",
    "remove_dir",
    "checkpoint_problem",
    "clean_stale",
    "config_changes",
    "HARMLESS_KEYS",
    "best_steps",
    "write_text_atomic",
    "append_lines",
    "finite_json",
    "write_manifest",
    "manifest_problem",
    "manifest_step",
    "run_identity",
    "MANIFEST",
    "file_sha256",
]


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message names the file or key."""


class RunLock:
    """An exclusive, non-blocking OS lock (``flock``) on the run directory itself, held until close or
    process exit. ``RUN_DIR/.lock`` only carries the holder's pid for the message: deleting it (or the
    whole file being replaced) cannot let a second writer in, since the lock is on the directory."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        self.path = self.dir / ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        if self.fd is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = self.path.read_text().strip() or "?"
            except (OSError, UnicodeDecodeError):
                holder = "?"
            raise RunDirError(f"run_dir {self.dir} is in use by another graft train (pid {holder})") from None
        self.fd = fd
        with contextlib.suppress(
            OSError
        ):  # the pid is for the message only; a read-only directory fails later, in one line
            write_text_atomic(self.path, f"{os.getpid()}\n")

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


#: metric keys renamed since runs were first recorded: old name -> new name. :func:`read_log` gives
#: every reader (``graft analyze``, ``graft seeds``, reports, ``--resume``) the new names, so a run
#: recorded before a rename reads like one recorded after it.
RENAMED_KEYS: dict[str, str] = {
    "time_score": "time_logprobs",  # the worker's phase that computes pi_old and weighs peer rows (0.9)
}


def _renamed(record: dict) -> dict:
    if not any(k in record for k in RENAMED_KEYS):
        return record
    return {RENAMED_KEYS.get(k, k): v for k, v in record.items()}


def read_log(path: Path) -> tuple[list[dict], bool]:
    """The records of a JSONL log and whether a torn last line (power loss mid-write) was dropped.

    A line that does not parse anywhere but last is damage, not a torn write: one error line.
    Keys renamed since the line was written come back under their new names (:data:`RENAMED_KEYS`).
    """
    if not path.is_file():
        return [], False
    lines = path.read_bytes().split(b"\n")
    out, torn = [], False
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            out.append(_renamed(json.loads(raw)))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if i == last:
                torn = True
                continue
            raise RunDirError(f"{path}:{i + 1}: not valid JSON (a damaged log; remove or repair that line)") from None
    return out, torn


def rewrite_log(path: Path, records: list[dict]) -> None:
    """Replace a JSONL log atomically (temporary name + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise RunDirError(
            f"{path} is a symbolic link; graft-rl writes this directory itself and does not replace or delete "
            f"through a link (its target is left as it is): remove the link, then run again"
        )


def remove_dir(path: Path) -> None:
    """Delete a directory so that an interruption never leaves it half-deleted under its name; a
    symbolic link in its place is refused in one line (:class:`RunDirError`)."""
    _refuse_link(path)
    if not path.exists():
        return
    trash = path.with_name(f".trash_{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` directory to ``final``, replacing what was there: at every instant
    ``final`` is either the old complete directory, absent, or the new complete one. A symbolic link
    at ``final`` is refused in one line (:class:`RunDirError`)."""
    _refuse_link(final)
    if final.exists():
        old = final.with_name(f".trash_{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def clean_stale(run_dir: Path) -> list[str]:
    """Remove what interrupted writes leave behind (``.step_N.tmp``, ``.trash_*``, ``*.tmp``), in
    ``checkpoints/``, ``best/`` and ``best/.committed/``. A ``.trash_X`` whose ``X`` is gone and whose files
    all match its manifest is the only copy (a kill between :func:`replace_dir`'s renames) and is renamed
    back instead; one that does not match is half of a :func:`remove_dir` and goes. Returns what it did."""
    removed = []
    # best/.committed holds the best weights as of the newest checkpoint, swapped in the same way
    for sub in (run_dir / "checkpoints", run_dir / "best", run_dir / "best" / ".committed"):
        if not sub.is_dir():
            continue
        for p in sub.iterdir():
            lone = p.name.startswith(".trash_") and not (sub / p.name.removeprefix(".trash_")).exists()
            if lone and p.is_dir() and manifest_problem(p, required=True) is None:
                # killed between replace_dir's two renames: the old directory is the only copy; it returns
                os.replace(p, sub / p.name.removeprefix(".trash_"))
                removed.append(f"{p.relative_to(run_dir)} (restored as {p.name.removeprefix('.trash_')})")
            elif p.name.startswith((".trash_", ".step_")) or p.name.endswith(".tmp"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(str(p.relative_to(run_dir)))
    return removed


def _loadable_torch_file(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0 and zipfile.is_zipfile(path)


#: Every file of a checkpoint (or of ``best/<policy>``) with its size and sha256, written last.
MANIFEST = "manifest.json"


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


RUN_ID = "run_id"  # RUN_DIR/run_id: the run's identity, bound into every manifest it writes


def run_identity(run_dir: Path, create: bool = True) -> str | None:
    """The run's identity (a random hex id in ``RUN_DIR/run_id``, written at its first checkpoint or
    best/ and kept when the directory is copied or moved); None when there is none and ``create`` is off."""
    path = Path(run_dir) / RUN_ID
    try:
        return path.read_text().strip() or None
    except OSError:
        if not create:
            return None
    import uuid

    write_text_atomic(path, uuid.uuid4().hex + "\n")
    return path.read_text().strip()


def write_manifest(directory: Path, step: int | None = None, run: str | None = None) -> None:
    """Record every file under ``directory`` (size, sha256) in its ``manifest.json`` (atomically), with
    the ``step`` it holds and the ``run`` (:func:`run_identity`) that wrote it."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    write_text_atomic(directory / MANIFEST, json.dumps({"step": step, "run": run, "files": entries}, indent=0))


def manifest_problem(
    directory: Path, only: str | None = None, required: bool = False, step: int | None = None, run: str | None = None
) -> str | None:
    """Why ``directory`` does not match its manifest (a file missing, resized or changed; another step
    or run than ``step``/``run`` where given and recorded), or None. Without a manifest: a problem when
    ``required`` (a checkpoint or best/ of a run), else not judged (a model directory of any origin).
    ``only``: check just the files under that subdirectory (one policy of a checkpoint)."""
    path = directory / MANIFEST
    if not path.exists():
        return f"{MANIFEST} is missing (its files cannot be checked)" if required else None
    try:
        manifest = json.loads(path.read_text())
        entries = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is damaged"
    if step is not None and manifest.get("step") is not None and int(manifest["step"]) != step:
        return f"it holds step {manifest['step']}'s state, not step {step}'s ({MANIFEST})"
    if run is not None and manifest.get("run") is not None and manifest["run"] != run:
        return f"it was written by another run ({MANIFEST}: run {manifest['run'][:8]}, this run {run[:8]})"
    for rel, want in entries.items():
        if only is not None and not rel.startswith(only.rstrip("/") + "/"):
            continue
        f = directory / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{rel} has {f.stat().st_size} bytes, {want['bytes']} when written"
        if file_sha256(f) != want["sha256"]:
            return f"{rel} differs from what was written (sha256)"
    return None


def manifest_step(directory: Path) -> int | None:
    """The step a manifest says its directory holds (None: not recorded, or no manifest)."""
    try:
        step = json.loads((directory / MANIFEST).read_text()).get("step")
        return None if step is None else int(step)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def checkpoint_problem(ckpt: Path, policies: list[str]) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: every file against the checksums recorded
    when it was written (:func:`write_manifest`), then a check of every file resume reads."""
    named = int(ckpt.name.rsplit("_", 1)[-1]) if ckpt.name.rsplit("_", 1)[-1].isdigit() else None
    problem = manifest_problem(ckpt, required=True, step=named, run=run_identity(ckpt.parent.parent, create=False))
    if problem is not None:
        return problem
    state = ckpt / "trainer_state.json"
    try:
        step = int(json.loads(state.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "trainer_state.json is missing or damaged"
    if named is not None and step != named:
        return f"trainer_state.json says step {step}, the directory's name step {named}"
    for name in policies:
        d = ckpt / name
        if not (d / "config.json").is_file() and not (d / "adapter_config.json").is_file():
            return f"{name}/config.json is missing"  # (a LoRA policy's: adapter_config.json)
        weights = list(d.glob("*.safetensors")) + list(d.glob("pytorch_model*.bin"))
        if not weights or any(w.stat().st_size == 0 for w in weights):
            return f"{name}'s weights are missing or empty"
        states = sorted(d.glob("policy_state*.pt"))
        if not states:
            return f"{name}/policy_state.pt is missing"
        for s in states:
            if not _loadable_torch_file(s):
                return f"{name}/{s.name} is empty or damaged"
    return None


#: Config keys a resumed run may change: they decide how long it runs, where and how it is
#: observed or placed, never what a step computes (thread counts are checked apart:
#: :func:`graft_rl.engine.checkpointing.cpu_threads`).
HARMLESS_KEYS = (
    "run_dir",
    "steps",
    "epochs",
    "checkpoint_every",
    "keep_checkpoints",
    "tensorboard",
    "report_to",
    "tracking",
    "torch_threads",  # and execution, ray.*: as long as each CPU policy keeps its thread count
    "execution",
    "ray",
    "validation.every",
    "validation.at_start",
    "method.max_num_gen_batches",  # whether a dynamic-sampling step may go on, never what it computes
    # one step off: how weights travel and which node generators sit on, never what they sample (not their
    # replicas, which deal the prompts and seeds, nor their threads; nor rollout.mode: a one-step-off run is
    # the lag-1 run, which a colocated run at lag 0 is not)
    "rollout.transfer",
    "rollout.inflight_at_checkpoint",
    "rollout.generators.resources",
)


def _flatten(d, prefix=""):
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        out = {}
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: d}


def config_changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """``(key, before, now)`` for every key whose change would alter the run's results."""
    a, b = _flatten(saved), _flatten(now)
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == h or key.startswith(h + ".") for h in HARMLESS_KEYS):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append((key, a.get(key, "<absent>"), b.get(key, "<absent>")))
    # a key set on both sides first: another method's name changes which keys the method has
    return sorted(out, key=lambda c: "<absent>" in (c[1], c[2]))


def best_steps(validation: list[dict], select_initial: bool = False) -> dict[str, dict]:
    """The best-checkpoint rule, one for the trainer and ``graft analyze`` (paper Appendix B): per
    policy, the validation line with the highest ``val/score``, the earliest on ties; step 0 (the
    initial weights) is a candidate only with ``validation.select_initial``. Returns
    ``{policy: {"step": s, "score": x}}``."""
    best: dict[str, dict] = {}
    for d in validation:
        if d["step"] == 0 and not select_initial:
            continue
        b = best.get(d["policy"])
        if b is None or d["val/score"] > b["score"]:
            best[d["policy"]] = {"step": d["step"], "score": d["val/score"]}
    return best


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` when the OS did not (a ``write()`` that fails with ENOSPC has no filename)."""
    if exc.filename:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines to a log; an OS error (a full disk) names the file (``OSError.filename``)."""
    try:
        with path.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
    except OSError as exc:
        raise _named(exc, path) from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file, then a rename); an OS error names the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # a partial temporary file is no result
        raise _named(exc, path) from None


def finite_json(x):
    """NaN/inf become null, so the JSONL logs stay strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_json(v) for v in x]
    return x
