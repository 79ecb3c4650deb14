"""``graft config show [WHAT]``: every config key with its default and a one-line meaning.

The meanings are the config classes' own comments (each field is documented once, in its
dataclass: the comment on its line, else the comment lines just above it), so this listing cannot
drift from the code. ``WHAT`` is a section (``run``, ``data``, ``validation``, ``ray``, ``tracking``, ``method``,
``policies``, ``peers``) or a method's name (its own keys); nothing lists every section.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from types import SimpleNamespace

from graft_rl.engine.config import (
    DataConfig,
    GeneratorsConfig,
    PeerRecords,
    RayConfig,
    RolloutConfig,
    TrackingConfig,
    TrainConfig,
    ValidationConfig,
    read_config_file,
)
from graft_rl.engine.presets import is_preset
from graft_rl.errors import ConfigError
from graft_rl.methods import MethodConfig, method_class, method_names
from graft_rl.methods.config import method_params, preset_part
from graft_rl.methods.registry import PART_KEYS, load_plugins, normalise, part_modules
from graft_rl.policy import PolicyConfig

__all__ = ["SECTIONS", "describe", "field_comments", "show"]

#: section name -> (the YAML key it lives under, its dataclass)
SECTIONS: dict[str, tuple[str, type]] = {
    "run": ("", TrainConfig),
    "data": ("data", DataConfig),
    "validation": ("validation", ValidationConfig),
    "rollout": ("rollout", RolloutConfig),
    "generators": ("rollout.generators", GeneratorsConfig),
    "ray": ("ray", RayConfig),
    "tracking": ("tracking", TrackingConfig),
    "method": ("method", MethodConfig),
    "policies": ("policies.N", PolicyConfig),
    "peers": ("peers.N", PeerRecords),
}
_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=#]+?(?:=\s*(?P<default>[^#]*?))?\s*(?:#\s*(?P<comment>.*))?$")


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in ``cls``'s source: the one on its line, else the comment block above it."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if not text.startswith("---"):  # a divider naming a group of fields, not one field
                above.append(text)
            continue
        m = _FIELD.match(line)
        if m and not stripped.startswith(("def ", "@", '"""')):
            out.setdefault(m.group(1), (m.group("comment") or " ".join(above)).strip())
        above = []
    return out


def _one_line(text: str, width: int = 100) -> str:
    """``text`` if it fits ``width``, else up to its last sentence end before ``width``, else cut."""
    if len(text) <= width:
        return text
    end = text.rfind(". ", 40, width)
    return text[: end + 1] if end > 0 else text[: width - 1].rstrip() + "…"


def describe(cls: type, keys: list[str] | None = None) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for the fields of a config dataclass (``keys``: only these)."""
    comments = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name == "params" or (keys is not None and f.name not in keys):
            continue
        if f.name in ("data", "validation", "rollout", "generators", "ray", "tracking", "method", "policies", "peers"):
            continue  # a section of its own (field types are strings here: name them)
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append((f.name, default, _one_line(comments.get(f.name, ""))))
    return rows


def _table(title: str, rows: list[tuple[str, str, str]]) -> str:
    width = max([len(k) for k, _, _ in rows] + [8])
    dwidth = min(max([len(d) for _, d, _ in rows] + [7]), 24)
    lines = [title]
    for key, default, meaning in rows:
        d = default if len(default) <= dwidth else default[: dwidth - 1] + "…"
        wrapped = textwrap.wrap(meaning, 100 - width - dwidth - 6) or [""]
        lines.append(f"  {key:<{width}}  {d:<{dwidth}}  {wrapped[0]}")
        lines += [" " * (width + dwidth + 6) + w for w in wrapped[1:]]
    return "\n".join(lines)


def show(what: str | None = None, plugins: list[str] | tuple[str, ...] = ()) -> str:
    """The listing of one section, of one method's own keys, or (``None``) of every section. ``plugins``
    are imported first (a user's methods and parts); ``what`` may be a config file: its method, listed
    after importing the config's own plugins."""
    load_plugins(plugins)
    if what is not None and (what.endswith((".yaml", ".yml")) or is_preset(what)):
        return _show_config(what)
    if what is None:
        parts = [show(name) for name in SECTIONS]
        listing = "\n".join(
            textwrap.fill(f"{n}: {method_class(n).source}", 98, initial_indent="  ", subsequent_indent="    ")
            for n in method_names()
        )
        return (
            "\n\n".join(parts)
            + "\n\nmethods (graft config show NAME: its parts and own keys), and their sources:\n"
            + listing
        )
    if what in SECTIONS:
        prefix, cls = SECTIONS[what]
        where = f"{prefix}." if prefix else ""
        out = _table(f"{what} ({where}KEY)", describe(cls))
        if what == "method":
            own = {
                name: [f.name for p in method_params(name) for f in dataclasses.fields(p)] for name in method_names()
            }
            listing = "; ".join(f"{n}: {', '.join(k) or '-'}" for n, k in own.items())
            parts = "; ".join(f"{kind}: {', '.join(reg.names())}" for kind, reg in PART_KEYS.items())
            for line in (
                f"a method's own keys (its parts' included), flat beside these: {listing}",
                f"the parts each part key can name (or module:NAME / file.py:NAME): {parts}",
            ):
                out += "\n" + textwrap.fill(line, 98, initial_indent="  ", subsequent_indent="    ")
        return out
    if what in method_names():
        cls = method_class(what)
        doc = (inspect.getdoc(inspect.getmodule(cls)) or "").split("\n\n")[0].replace("\n", " ")
        head = textwrap.fill(f"method {what}: {_one_line(doc, 160)}", 100, subsequent_indent="  ")
        peers = (
            "reads the exchange switches (graft config show method)"
            if cls.uses_peers
            else "trains on its own groups only"
        )
        parts = textwrap.fill(
            "parts: " + ", ".join(f"{kind} {preset_part(what, kind)}" for kind in PART_KEYS),
            98,
            subsequent_indent="    ",
        )
        parts += "\n" + textwrap.fill(f"source: {cls.source}", 98, initial_indent="  ", subsequent_indent="    ")
        params = method_params(what)
        if not params:
            return f"{head}\n  {parts}\n  no keys of its own; {peers}"
        rows = [row for p in params for row in describe(p)]
        return _table(f"{head}\n  {parts}\n  {peers}; its own keys (method.KEY):", rows)
    raise ConfigError(
        f"graft config show: {what!r} is neither a section ({', '.join(SECTIONS)}) nor a method "
        f"({', '.join(method_names())}); a method of your own: add --plugins SPEC, or name a config that imports it"
    )


def _show_config(path: str) -> str:
    """``graft config show CONFIG.yaml`` (or a preset's name): the config's method (its parts and keys),
    its plugins imported."""
    try:
        data = read_config_file(path)
    except ConfigError as exc:
        raise ConfigError(f"graft config show: {exc}") from None
    method = data.get("method") or {}
    # paths as `graft train` reads them (relative to the current directory), then the part keys' modules
    load_plugins([normalise(p) for p in data.get("plugins") or []])
    load_plugins(part_modules(SimpleNamespace(**{"name": "", **method})))
    return show(str(method.get("name", "graft")))


def _hardware(path) -> str:
    """What a preset asks for: GPUs (per policy), Ray, its rollout backends; or the error that loading it
    raises on this install (a plugin or package it needs)."""
    from graft_rl.engine.config import load_config

    try:
        cfg = load_config(path)
    except Exception as exc:  # listed, not raised: one preset must not hide the others
        return f"(loads with {type(exc).__name__})"
    gpus = [pc.world_size for pc in cfg.policies if pc.device.startswith("cuda")]
    where = "CPU" if not gpus else f"{sum(gpus)} GPU" + ("s" if sum(gpus) > 1 else "")
    if 1 < len(gpus) <= 3:
        where += f" ({' + '.join(map(str, gpus))})"
    elif len(gpus) > 3:
        where += f" ({len(gpus)} policies)"
    ray = ", Ray" if cfg.execution == "ray" else ""
    return f"{where}{ray}, {'/'.join(sorted({pc.backend for pc in cfg.policies}))}"


def preset_listing() -> str:
    """``graft config list``: every preset, one line each: its name, the hardware it asks for, what it is."""
    from graft_rl.engine.presets import PRESETS, presets

    rows = [(p.name, _hardware(p.path), p.about) for p in presets()]
    if not rows:
        raise ConfigError(f"graft config list: no presets in {PRESETS} (a broken install?)")
    width = max(len(r[0]) for r in rows)
    hw = max(len(r[1]) for r in rows)
    lines = [f"presets ({len(rows)}; graft train NAME, graft config init FILE --from NAME), in {PRESETS}:"]
    lines += [f"  {name:<{width}}  {h:<{hw}}  {_one_line(about, 110)}" for name, h, about in rows]
    return "\n".join(lines)
