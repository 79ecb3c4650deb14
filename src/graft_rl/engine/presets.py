"""The presets: the package's own configs (``graft_rl/configs``; a checkout's ``configs/`` is the same tree),
named by their path below it without ``.yaml``: ``lookup/graft``, ``paper/pair1/graft_lora``, ``real/cpu``.

Every command that takes a config takes a preset name (:func:`resolve`); a file that exists wins over a
preset of the same name, and the command says so. :func:`presets` lists them with what each is (its
first comment line). Paths only: reading one is :func:`graft_rl.engine.config.read_config_file`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["PRESETS", "Preset", "is_preset", "not_found", "preset_path", "presets", "resolve"]

#: Where the presets live: inside the installed package.
PRESETS = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class Preset:
    name: str  #: e.g. ``paper/pair1/graft``
    path: Path
    about: str  #: the file's first comment line


def _name(arg: str) -> str:
    """``configs/lookup/graft.yaml``, ``lookup/graft.yaml`` and ``lookup/graft`` all name ``lookup/graft``."""
    name = arg.replace("\\", "/").strip("/")
    for prefix in ("src/graft_rl/configs/", "graft_rl/configs/", "configs/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name[: -len(".yaml")] if name.endswith(".yaml") else name[: -len(".yml")] if name.endswith(".yml") else name


def preset_path(arg: str) -> Path | None:
    """The preset file ``arg`` names, or ``None``."""
    name = _name(str(arg))
    if not name or ".." in name.split("/"):
        return None
    p = PRESETS / f"{name}.yaml"
    return p if p.is_file() else None


def is_preset(arg: str) -> bool:
    return preset_path(arg) is not None


def resolve(arg: str | Path) -> tuple[Path, str | None]:
    """``(file, note)`` for a config argument: an existing file as given (``note`` names the preset it
    shadows, if any), else the preset it names. A name that is neither is returned as given, for the
    loader's own "not found" line (:func:`not_found` words it)."""
    p = Path(arg)
    preset = preset_path(str(arg))
    if not p.is_file() and p.suffix not in (".yaml", ".yml") and p.with_name(p.name + ".yaml").is_file():
        p = p.with_name(p.name + ".yaml")  # `lookup/graft` beside a local lookup/graft.yaml: the file
    if p.is_file():
        if preset is not None and preset.resolve() != p.resolve():
            return p, f"using the file {p}, not the preset {_name(str(arg))} of the same name"
        return p, None
    if preset is not None:
        return preset, None
    return p, None


def not_found(arg: str | Path) -> str:
    """The one line for a config that is neither a file nor a preset, with the nearest preset names."""
    import difflib

    name = _name(str(arg))
    near = difflib.get_close_matches(name, [q.name for q in presets()], n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return f"config file {arg} not found, nor a preset of that name (graft config list){hint}"


def _about(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def presets() -> list[Preset]:
    """Every preset, sorted by name."""
    return [
        Preset(path.relative_to(PRESETS).with_suffix("").as_posix(), path, _about(path))
        for path in sorted(PRESETS.rglob("*.yaml"))
    ]
