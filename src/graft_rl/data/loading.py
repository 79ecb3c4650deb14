"""Loading a dataset: built-in names, JSONL files read line by line (an error names its line), tables
read by pyarrow (:mod:`graft_rl.data.sources`, :mod:`graft_rl.data.table`), reasoning-gym tasks."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
from collections.abc import Mapping
from pathlib import Path

from graft_rl.data.catalog import _FILES, BUILTIN, BUILTIN_LEFT_OUT, TESTBED_DATA, TESTBED_FILES
from graft_rl.data.problem import _FIELDS, _OPTIONAL, _TYPES, DatasetError, Problem, _chat, content_id

__all__ = ["load_jsonl", "load_dataset", "load_table", "problems_from_rows", "ReasoningGymTask", "JSONL_TABLE_BYTES"]


def _mapped(obj: dict, columns: Mapping[str, str] | None, where: str) -> dict:
    """The row with the user's columns also under our names (``columns``: our name -> theirs); the
    originals stay, so a reward function reads the row by the names its author gave them."""
    if not columns:
        return obj
    obj = dict(obj)
    for ours, theirs in columns.items():
        if theirs not in obj:
            raise DatasetError(f"{where}: row has no {theirs!r} column (data.columns maps {ours} to it)")
        obj[ours] = obj[theirs]
    return obj


def _row(obj: object, where: str, columns: Mapping[str, str] | None = None) -> tuple[Problem, bool]:
    """The row as a problem, and whether its id was generated (it had none)."""
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    obj = _mapped(obj, columns, where)
    if _chat(obj.get("problem")):  # a chat prompt: kept as its messages (prompt_messages reads them back)
        obj = {**obj, "problem": json.dumps([{"role": m["role"], "content": m["content"]} for m in obj["problem"]])}
    generated = "id" not in obj and isinstance(obj.get("problem"), str)
    if generated:
        obj = {**obj, "id": content_id(obj["problem"])}
    for key, typ in _TYPES.items():
        if key not in obj:
            raise DatasetError(f"{where}: row has no '{key}' field")
        val = obj[key]
        if key in ("answer", "id") and isinstance(val, (int, float)) and not isinstance(val, bool):
            val = obj[key] = str(val)  # numeric answers (and ids) are common in third-party files
        if not isinstance(val, typ):
            raise DatasetError(f"{where}: field '{key}' must be a string, got {type(val).__name__}")
    for key, types in _OPTIONAL.items():
        val = obj.get(key)
        if val is not None and not isinstance(val, types):
            raise DatasetError(f"{where}: field '{key}' must be {types[0].__name__} or null, got {type(val).__name__}")
    extra = {k: v for k, v in obj.items() if k not in _FIELDS}
    return Problem(**{k: obj.get(k) for k in _FIELDS}, extra=extra), generated


class _Rows:
    """Collects rows, keeping ids unique: a generated id seen before gets ``-2``, ``-3``, ...; a given one is refused."""

    def __init__(self, limit: int | None):
        self.rows: list[Problem] = []
        self.seen: dict[str, str] = {}
        self.limit = limit

    def add(self, row: Problem, generated: bool, where: str, first: str) -> bool:
        """Add a row; False once ``limit`` rows are in."""
        if generated and row.id in self.seen:
            n = 2
            while f"{row.id}-{n}" in self.seen:
                n += 1
            row = dataclasses.replace(row, id=f"{row.id}-{n}")
        if row.id in self.seen:
            raise DatasetError(f"{where}: duplicate id {row.id!r} (first {self.seen[row.id]})")
        self.seen[row.id] = first
        self.rows.append(row)
        return self.limit is None or len(self.rows) < self.limit


def problems_from_rows(
    rows, name: str, columns: Mapping[str, str] | None = None, limit: int | None = None
) -> list[Problem]:
    """Rows (dicts) as problems: columns mapped, ids generated where absent, duplicate ids refused."""
    out = _Rows(limit)
    for i, obj in enumerate(rows):
        row, generated = _row(obj, f"{name}: row {i}", columns)
        if not out.add(row, generated, f"{name}: row {i}", f"in row {i}"):
            break
    if not out.rows:
        raise DatasetError(f"{name}: no rows")
    return out.rows


def load_jsonl(path: str | Path, limit: int | None = None, columns: Mapping[str, str] | None = None) -> list[Problem]:
    """Read a JSONL problem file (``.jsonl`` or gzipped ``.jsonl.gz``); a malformed row raises one
    :class:`DatasetError` naming file and line. ``columns``: our field name -> the file's column."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return _read_rows(f, path, limit, columns)
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"{path}: not UTF-8 text (byte {exc.start} of a line); a dataset is JSONL, one object per line"
        ) from None
    except (gzip.BadGzipFile, EOFError, OSError) as exc:
        raise DatasetError(f"{path}: cannot read ({type(exc).__name__}: {exc})") from None


def _read_rows(f, path: Path, limit: int | None, columns: Mapping[str, str] | None) -> list[Problem]:
    out = _Rows(limit)
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        row, generated = _row(obj, where, columns)
        if not out.add(row, generated, where, f"on line {lineno}"):
            break
    if not out.rows:
        raise DatasetError(f"{path}: no rows")
    return out.rows


def load_dataset(
    name_or_path: str, limit: int | None = None, columns: Mapping[str, str] | None = None
) -> list[Problem]:
    """A built-in dataset by name, ``reasoning_gym:NAME[:SIZE[:SEED]]`` (``NAME``: a task, or tasks joined by
    ``+``, SIZE of each, each its own family), ``hf:ORG/NAME[:CONFIG][:SPLIT]``,
    or a JSONL / parquet / CSV / JSON file or ``save_to_disk`` folder by path; ``limit``: its first N
    problems (>= 1; None for all); ``columns``: our field (``id``, ``problem``, ``answer``, ...) -> the
    data's column, for data whose columns are named otherwise."""
    if limit is not None and limit < 1:
        raise DatasetError(f"{name_or_path}: limit must be >= 1 (or null for every problem), got {limit}")
    if name_or_path in BUILTIN:
        rows = load_jsonl(_FILES / BUILTIN[name_or_path][0])
        rows = [r for r in rows if r.id not in BUILTIN_LEFT_OUT.get(name_or_path, ())]
        return rows[:limit] if limit is not None else rows
    if name_or_path in TESTBED_DATA:
        return load_jsonl(TESTBED_FILES / TESTBED_DATA[name_or_path][0], limit)
    if name_or_path.startswith("reasoning_gym:"):
        rows = _reasoning_gym(name_or_path)
        return rows[:limit] if limit is not None else rows
    path = Path(name_or_path).expanduser()
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return load_jsonl(path, limit, columns)  # line by line: an error names its line
    table = load_table(name_or_path, limit, columns)
    if table is not None:
        return list(table)
    if path.is_file():
        return load_jsonl(path, limit, columns)
    raise DatasetError(
        f"unknown dataset {name_or_path!r}; built-in: {', '.join([*BUILTIN, *TESTBED_DATA])}; or a path to a "
        ".jsonl(.gz) / .parquet / .csv / .json file or a save_to_disk folder, hf:ORG/NAME[:CONFIG][:SPLIT], "
        "or reasoning_gym:NAME[:SIZE[:SEED]]"
    )


#: A JSONL file at least this large is read by pyarrow's reader into a table (:func:`load_table`).
JSONL_TABLE_BYTES = 8 << 20


def load_table(name_or_path: str, limit: int | None = None, columns: Mapping[str, str] | None = None):
    """A dataset as a :class:`~graft_rl.data.table.ProblemTable` (Arrow columns, no Python object per
    row) where it is a table: a parquet / CSV / JSON / Arrow file, a ``save_to_disk`` folder,
    ``hf:...``, or a JSONL file of :data:`JSONL_TABLE_BYTES` or more whose every row has every key
    (:func:`~graft_rl.data.sources.read_jsonl_table`); else None (:func:`load_dataset` reads it line by
    line). The training data of a run is read this way (docs/tasks.md)."""
    from graft_rl.data import sources
    from graft_rl.data.table import from_arrow

    if limit is not None and limit < 1:
        raise DatasetError(f"{name_or_path}: limit must be >= 1 (or null for every problem), got {limit}")
    if name_or_path in BUILTIN or name_or_path in TESTBED_DATA or name_or_path.startswith("reasoning_gym:"):
        return None
    if name_or_path.startswith("hf:"):
        return from_arrow(sources.read_hub(name_or_path), name_or_path, columns, limit)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".jsonl" and path.is_file() and path.stat().st_size >= JSONL_TABLE_BYTES:
        table = sources.read_jsonl_table(path)  # None unless pyarrow reads exactly what the line reader would
        try:
            return None if table is None else from_arrow(table, str(path), columns, limit)
        except DatasetError:
            return None  # the line reader names the line at fault
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return None
    if sources.is_table(path):
        return from_arrow(sources.read_table(path), str(path), columns, limit)
    return None


def _reasoning_gym(spec: str) -> list[Problem]:
    parts = spec.split(":")
    try:
        size = int(parts[2]) if len(parts) > 2 else 1000
        seed = int(parts[3]) if len(parts) > 3 else 0
    except ValueError:
        raise DatasetError(f"{spec}: expected reasoning_gym:NAME[:SIZE[:SEED]] with whole numbers") from None
    names = parts[1].split("+")
    if len(names) == 1:
        return ReasoningGymTask(names[0], size=size, seed=seed).problems()
    # a mixture (SAPO's nine specialties): SIZE problems of each task, each task its family (``subject``)
    return [
        dataclasses.replace(p, subject=name)
        for name in names
        for p in ReasoningGymTask(name, size=size, seed=seed).problems()
    ]


class ReasoningGymTask:
    """A reasoning-gym procedural dataset as :class:`Problem` rows, scored by its own verifier.

    Rows carry ``source = "reasoning_gym:NAME:SIZE:SEED:CONFIG_JSON"`` and ``id =
    "rg/NAME/SEED/INDEX"``, which is all :func:`graft_rl.rewards.gym_scores` needs to
    re-create the entry in a verifier worker.
    """

    def __init__(self, name: str, size: int = 1000, seed: int = 0, **config):
        try:
            import reasoning_gym
        except ImportError as exc:  # pragma: no cover - it is a dependency
            raise DatasetError("reasoning_gym tasks need the 'reasoning-gym' package") from exc
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            raise DatasetError(f"unknown reasoning_gym task {name!r}; available: {', '.join(sorted(DATASETS))}")
        self.name, self.size, self.seed, self.config = name, size, seed, config
        with _quiet():
            self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)

    @property
    def source(self) -> str:
        return f"reasoning_gym:{self.name}:{self.size}:{self.seed}:{json.dumps(self.config, sort_keys=True)}"

    def problems(self) -> list[Problem]:
        with _quiet():
            entries = list(self.dataset)
        return [
            Problem(
                id=f"rg/{self.name}/{self.seed}/{i}", problem=e["question"], answer=str(e["answer"]), source=self.source
            )
            for i, e in enumerate(entries)
        ]


def _quiet() -> contextlib.AbstractContextManager:
    """Swallows what a task generator prints (reasoning-gym's ``bf`` writes a dot per problem)."""
    return contextlib.redirect_stdout(io.StringIO())
