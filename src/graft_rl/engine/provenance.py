"""What a run was trained on and with (docs/reliability.md, "A resume knows what changed under it").

A run records, in every checkpoint, a fingerprint of each reward it scores with and of each data
file it reads (:func:`fingerprint`); ``--resume`` compares the newest checkpoint's with today's
(:func:`changes`). A changed reward source or data file is refused unless the user allows it
(``graft train --resume RUN --allow-changed reward``); the run then records the change
(``RUN_DIR/changes.jsonl``) so that ``graft analyze`` marks the step. A new version of a built-in
verifier's package is reported, not refused.

- a reward by ``module:function`` or ``file.py:function``: the sha256 of the module's file (the file
  that defines the function; modules it imports are not followed);
- a registered reward or a Python function: the sha256 of the module file defining it (when a worker
  imports it by name), else of its code (bytecode, constants, names: not where it sits), else unrecorded;
- a built-in verifier (``math``, ``gsm8k``, ``gym``): its name and the version of the package that
  does the checking (math-verify, graft-rl, reasoning-gym);
- a plugin (``plugins:`` and the ``module:NAME`` / ``file.py:NAME`` part keys of ``method``): its import
  path and the sha256 of its source file (its module's file; modules it imports are not followed);
  a changed plugin is refused as a changed reward is (``--allow-changed plugin``);
- a data file: its size and sha256 up to :data:`HASH_LIMIT` bytes; a larger one (whose hash would
  take seconds: 1 GiB is about 2 s) its size and the sha256 of :data:`SAMPLES` evenly spaced 1 MiB
  blocks, first and last included (an edit between them goes unseen); a folder (``save_to_disk``):
  each file so, hashed whole while the folder's running total stays under the limit; a built-in set:
  the graft-rl version that ships it; ``hf:`` and ``reasoning_gym:`` specs: the package version.

Only content is compared: a run directory or checkout moved, copied or resumed on another machine
resumes (paths and modification times are not recorded).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

from graft_rl.engine.rundir import file_sha256 as _sha256

__all__ = ["fingerprint", "changes", "check_allowed", "HASH_LIMIT", "CHANGE_KINDS", "CHANGES"]

#: Data files up to this size are hashed whole (sha256); larger ones by :data:`SAMPLES` blocks.
HASH_LIMIT = 1 << 30

#: 1 MiB blocks hashed of a file over :data:`HASH_LIMIT` (evenly spaced, the first and last included).
SAMPLES = 16

#: What ``--allow-changed`` may name.
CHANGE_KINDS = ("reward", "data", "plugin")

#: ``RUN_DIR/changes.jsonl``: the changes a resume went on with, at the step they first affect.
CHANGES = "changes.jsonl"


def check_allowed(kinds) -> tuple[str, ...]:
    """``--allow-changed`` values, each one of :data:`CHANGE_KINDS` (one line naming a wrong one)."""
    from graft_rl.errors import ConfigError

    out = tuple(k.strip() for item in kinds for k in str(item).split(",") if k.strip())
    for k in out:
        if k not in CHANGE_KINDS:
            raise ConfigError(f"--allow-changed {k!r}: expected {' or '.join(CHANGE_KINDS)}")
    return out


_PACKAGES = {"math": "math-verify", "gsm8k": "graft-rl", "gym": "reasoning-gym"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    return Path(spec.origin)


def reward_fingerprint(reward) -> dict:
    """``{"kind", "source", ...}`` of a resolved :class:`~graft_rl.rewards.Reward`."""
    if reward.builtin:
        package = _PACKAGES.get(reward.target, "graft-rl")
        return {"kind": "builtin", "source": reward.target, "package": package, "version": _version(package)}
    if reward.payload is not None:  # a Python function given to the trainer: its source text, if it has one
        return {"kind": "python", "source": reward.name, "sha256": reward.source_sha256}
    module = reward.target.rpartition(":")[0]
    path = Path(module) if module.endswith(".py") else _module_file(module)
    if path is None or not path.is_file():
        return {"kind": "module", "source": module, "sha256": None}
    return {"kind": "module", "source": str(path), "sha256": _sha256(path)}


def _sampled_sha256(path: Path, size: int) -> str:
    """sha256 of the size and :data:`SAMPLES` evenly spaced 1 MiB blocks (first and last included)."""
    h = hashlib.sha256(str(size).encode())
    block = 1 << 20
    with path.open("rb") as f:
        for k in range(SAMPLES):
            f.seek(max(0, (size - block) * k // (SAMPLES - 1)))
            h.update(f.read(block))
    return h.hexdigest()


def _file_fingerprint(path: Path, whole: bool) -> dict:
    size = path.stat().st_size
    if whole:
        return {"bytes": size, "sha256": _sha256(path)}
    return {"bytes": size, "sampled_sha256": _sampled_sha256(path, size)}


def data_fingerprint(spec: str) -> dict:
    """How one dataset is recorded (see the module docstring)."""
    from graft_rl.data import BUILTIN, TESTBED_DATA

    if spec in BUILTIN or spec in TESTBED_DATA:
        return {"kind": "builtin", "version": _version("graft-rl")}
    if spec.startswith("reasoning_gym:"):
        return {"kind": "generated", "version": _version("reasoning-gym")}
    if spec.startswith("hf:"):
        return {"kind": "hub", "version": _version("datasets")}
    path = Path(spec).expanduser()
    if path.is_dir():
        files, total, out = sorted(p for p in path.rglob("*") if p.is_file()), 0, {}
        for p in files:
            total += p.stat().st_size
            out[str(p.relative_to(path))] = _file_fingerprint(p, total <= HASH_LIMIT)
        return {"kind": "folder", "files": out}
    if not path.is_file():
        return {"kind": "missing"}
    return {"kind": "file", **_file_fingerprint(path, path.stat().st_size <= HASH_LIMIT)}


def fingerprint(cfg, rewards: dict) -> dict:
    """The run's fingerprint: ``rewards`` (label -> resolved reward: ``train`` and each validation set's)
    and every dataset the config reads."""
    data = {cfg.data.train: data_fingerprint(cfg.data.train)}
    for vs in cfg.validation.sets():
        data.setdefault(vs["data"], data_fingerprint(vs["data"]))
    out = {"rewards": {label: reward_fingerprint(r) for label, r in rewards.items()}, "data": data}
    plugins = plugin_fingerprints(run_plugins(cfg))
    if plugins:
        out["plugins"] = plugins
    return out


def run_plugins(cfg) -> list[str]:
    """The plugins a run imports: its ``plugins`` list, then the modules its part keys name."""
    from graft_rl.methods.registry import part_modules

    return list(dict.fromkeys([*cfg.plugins, *part_modules(cfg.method)]))


def plugin_fingerprints(specs: list[str]) -> dict[str, dict]:
    """``{spec: {"source": file, "sha256": ...}}`` of each plugin's source file."""
    from graft_rl.methods.registry import plugin_file, plugin_sources

    out = {}
    for spec, source in plugin_sources(specs).items():
        path = plugin_file(spec)
        if source is not None:  # a file plugin: the source this process imported (what ran)
            digest: str | None = hashlib.sha256(source).hexdigest()
        else:
            digest = _sha256(path) if path else None
        out[spec] = {"source": str(path) if path else spec, "sha256": digest}
    return out


def changes(before: dict, now: dict) -> list[tuple[str, str]]:
    """``(kind, what changed)`` for every difference: kind ``reward``, ``plugin`` or ``data`` (refused unless
    allowed), or ``version`` (a built-in verifier's package or a generated set's: reported only)."""
    out: list[tuple[str, str]] = []
    old_r, new_r = before.get("rewards", {}), now.get("rewards", {})
    for label in sorted(set(old_r) | set(new_r)):
        a, b = old_r.get(label), new_r.get(label)
        if a == b:
            continue
        where = "the training reward" if label == "train" else f"validation set {label}'s reward"
        if a is None or b is None or a.get("kind") != b.get("kind"):
            out.append(("reward", f"{where} is now {_name(b)} (was {_name(a)})"))
        elif a["kind"] == "builtin":
            if a.get("source") != b.get("source"):
                out.append(("reward", f"{where} is now {_name(b)} (was {_name(a)})"))
            elif a.get("version") != b.get("version"):
                out.append(("version", f"{where} {a['source']}: {a['package']} {a['version']} -> {b['version']}"))
        elif a.get("sha256") != b.get("sha256"):  # content only: a moved checkout or another machine resumes
            out.append(("reward", f"{where}: {b['source']} changed (sha256 {_short(a)} -> {_short(b)})"))
    old_p, new_p = before.get("plugins", {}), now.get("plugins", {})
    for spec in sorted(set(old_p) | set(new_p)):
        a, b = old_p.get(spec), new_p.get(spec)
        if a is None or b is None:
            continue  # a plugin added or left out by the resumed config is a config change, judged there
        if a.get("sha256") != b.get("sha256"):
            where = spec if b["source"] == spec else f"{spec} ({b['source']})"  # a module: its file too
            out.append(("plugin", f"plugin {where} changed (sha256 {_short(a)} -> {_short(b)})"))
    old_d, new_d = before.get("data", {}), now.get("data", {})
    for spec in sorted(set(old_d) | set(new_d)):
        a, b = old_d.get(spec), new_d.get(spec)
        if a is None or a == b:
            continue  # a set added by the resumed config is a config change, judged there
        if b is None:
            continue
        if a.get("kind") in ("builtin", "generated", "hub") and a.get("kind") == b.get("kind"):
            out.append(("version", f"{spec}: the package that provides it went {a['version']} -> {b['version']}"))
        elif _content(a) != _content(b):
            out.append(("data", f"{spec} changed ({_data_diff(a, b)})"))
    return out


def _content(fp: dict):
    """What a data fingerprint says of the content (older records' modification times left out)."""
    if fp.get("kind") == "folder":
        return {k: _content(v) for k, v in fp.get("files", {}).items()}
    return {k: v for k, v in fp.items() if k != "mtime_ns"}


def _name(fp: dict | None) -> str:
    return "nothing" if fp is None else f"{fp.get('source')}"


def _short(fp: dict) -> str:
    return (fp.get("sha256") or "unrecorded")[:12]


def _data_diff(a: dict, b: dict) -> str:
    if b.get("kind") == "missing":
        return "it is gone"
    if a.get("bytes") != b.get("bytes") and "bytes" in a:
        return f"{a['bytes']:,} -> {b.get('bytes', 0):,} bytes"
    if "sha256" in a:
        return f"sha256 {a['sha256'][:12]} -> {str(b.get('sha256'))[:12]}"
    if "sampled_sha256" in a:
        return f"the sampled sha256 of this file over {HASH_LIMIT >> 30} GiB differs"
    changed = sorted(
        k for k in set(a.get("files", {})) | set(b.get("files", {})) if a["files"].get(k) != b["files"].get(k)
    )
    return f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} differ"
