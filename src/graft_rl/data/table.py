"""Problem tables held as Arrow columns (docs/tasks.md, "Large datasets").

A training table of a million rows as one :class:`~graft_rl.data.Problem` per row costs about a
gigabyte of Python objects and seconds of start-up; as Arrow columns it costs its own size. A
:class:`ProblemTable` is a read-only sequence of problems over such columns: a row becomes a
:class:`~graft_rl.data.Problem` (or the dict a reward gets) only when it is drawn, and the checks a run
makes on its whole table (ids unique, fields of the right type, prompt sizes, the subjects that make
families, the answers a verifier must match) are column operations.

:func:`from_arrow` turns any Arrow table into one with the rules of the row reader
(:func:`graft_rl.data.problems_from_rows`): the same column mapping, generated ids, type rules and
one-line errors naming the row; iterating it yields the problems the row reader would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from graft_rl.data.problem import _FIELDS, _OPTIONAL, _TYPES, DatasetError, Problem, _chat, content_id

__all__ = ["ProblemTable", "from_arrow", "take", "problem_bytes", "chat_rows", "unique_values"]

_CHUNK = 4096  # rows turned into Python objects at once when a table is iterated


def _plain(value):
    """A cell as a JSON value (the verifier workers receive rows as JSON): numbers, text, lists, dicts."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return json.loads(json.dumps(value, default=str))


class ProblemTable(Sequence):
    """Problems over Arrow columns: ``id``, ``problem``, ``answer`` (strings), the optional fields
    present (``solution``, ``level``, ``subject``, ``source``) and every other column of the data
    (what :attr:`Problem.extra` holds)."""

    def __init__(self, table: pa.Table, name: str):
        self.table = table.combine_chunks()
        self.name = name
        self._fields = [f for f in _FIELDS if f in self.table.column_names]
        self._extra = [c for c in self.table.column_names if c not in _FIELDS]

    def __len__(self) -> int:
        return self.table.num_rows

    def _problems(self, rows: list[dict]) -> list:
        return [
            Problem(
                **{f: r.get(f) for f in self._fields},
                extra={k: _plain(r[k]) for k in self._extra},
            )
            for r in rows
        ]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name}: row {i} of {n}")
        return self._problems(self.table.slice(i % n, 1).to_pylist())[0]

    def take(self, indices: Sequence[int]) -> list:
        """The problems at ``indices``, in that order (one Arrow gather, then Python objects)."""
        if not len(indices):
            return []
        return self._problems(self.table.take(pa.array(list(indices), pa.int64())).to_pylist())

    def __iter__(self) -> Iterator:
        for start in range(0, len(self), _CHUNK):
            yield from self._problems(self.table.slice(start, _CHUNK).to_pylist())

    def column(self, name: str) -> pa.Array:
        return self.table.column(name).combine_chunks()

    def __repr__(self) -> str:
        return f"ProblemTable({self.name!r}, {len(self):,} rows)"


def take(data: Sequence, indices: Sequence[int] | np.ndarray) -> list:
    """The problems at ``indices`` of a :class:`ProblemTable` (one Arrow gather) or of a list."""
    return data.take(list(indices)) if isinstance(data, ProblemTable) else [data[int(i)] for i in indices]


# ---------------------------------------------------------------------------------------- whole-table checks
def problem_bytes(data: Sequence) -> np.ndarray:
    """Each problem's text size in UTF-8 bytes (int64), a column operation for a :class:`ProblemTable`."""
    if isinstance(data, ProblemTable):
        return (
            pc.binary_length(data.column("problem").cast(pa.binary())).to_numpy(zero_copy_only=False).astype(np.int64)
        )
    return np.fromiter((len(p.problem.encode()) for p in data), np.int64, len(data))


def chat_rows(data: Sequence) -> np.ndarray:
    """Which problems are chat prompts (a list of messages, kept as its JSON text)."""
    if isinstance(data, ProblemTable):
        return pc.starts_with(data.column("problem"), '[{"role"').to_numpy(zero_copy_only=False).astype(bool)
    return np.fromiter((p.problem.startswith('[{"role"') for p in data), bool, len(data))


def unique_values(data: Sequence, field: str) -> list:
    """The distinct values of a field over every problem (``None`` among them when some row has none)."""
    if isinstance(data, ProblemTable):
        if field not in data.table.column_names:
            return [None]
        return data.column(field).unique().to_pylist()
    return list(dict.fromkeys(getattr(p, field) for p in data))


# ---------------------------------------------------------------------------------------- reading
def _type_name(value) -> str:
    return type(value).__name__


def _first(mask: pa.Array) -> int:
    """Index of the first true value of a boolean array."""
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def _where(name: str, i: int) -> str:
    return f"{name}: row {i}"


def _as_text(col: pa.Array, key: str, name: str) -> pa.Array:
    """A required column as strings: numbers become their text (``str(x)``, as the row reader does)."""
    if col.null_count:
        i = _first(col.is_null())
        raise DatasetError(f"{_where(name, i)}: field '{key}' must be a string, got NoneType")
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return col.cast(pa.string())
    if key in ("answer", "id") and pa.types.is_integer(t):
        return pc.cast(col, pa.string())
    if key in ("answer", "id") and pa.types.is_floating(t):
        return pa.array([str(x) for x in col.to_pylist()], pa.string())
    raise DatasetError(f"{_where(name, 0)}: field '{key}' must be a string, got {_type_name(col[0].as_py())}")


def _problem_column(col: pa.Array, name: str) -> pa.Array:
    """The ``problem`` column as text; a list of chat messages becomes its JSON text (as the row reader keeps it)."""
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        out = []
        for i, v in enumerate(col.to_pylist()):
            if not _chat(v):
                raise DatasetError(f"{_where(name, i)}: field 'problem' must be a string, got {_type_name(v)}")
            out.append(json.dumps([{"role": m["role"], "content": m["content"]} for m in v]))
        return pa.array(out, pa.string())
    return _as_text(col, "problem", name)


def _optional(col: pa.Array, key: str, name: str) -> pa.Array:
    t, want = col.type, _OPTIONAL[key][0]
    ok = pa.types.is_null(t) or (
        pa.types.is_integer(t) if want is int else (pa.types.is_string(t) or pa.types.is_large_string(t))
    )
    if not ok:
        i = _first(col.is_valid())
        raise DatasetError(
            f"{_where(name, i)}: field '{key}' must be {want.__name__} or null, got {_type_name(col[i].as_py())}"
        )
    if pa.types.is_null(t):
        return pa.nulls(len(col), pa.int64() if want is int else pa.string())
    return col.cast(pa.int64() if want is int else pa.string())


def _decoded(col: pa.Array) -> pa.Array:
    """A dictionary-encoded column (a pandas Categorical in parquet) as its values; string views as strings."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if getattr(pa.types, "is_string_view", lambda t: False)(col.type):
        col = col.cast(pa.string())
    return col


def _generated_ids(problems: pa.Array) -> pa.Array:
    """Content ids for rows without one: a hash of the problem text, duplicates ``-2``, ``-3``, ..."""
    seen: set[str] = set()
    out = []
    for text in problems.to_pylist():
        cid = content_id(text)
        if cid in seen:
            n = 2
            while f"{cid}-{n}" in seen:
                n += 1
            cid = f"{cid}-{n}"
        seen.add(cid)
        out.append(cid)
    return pa.array(out, pa.string())


def _check_unique(ids: pa.Array, name: str) -> None:
    if pc.count_distinct(ids).as_py() == len(ids):
        return
    first: dict[str, int] = {}
    for i, x in enumerate(ids.to_pylist()):
        if x in first:
            raise DatasetError(f"{_where(name, i)}: duplicate id {x!r} (first in row {first[x]})")
        first[x] = i


def from_arrow(
    table: pa.Table, name: str, columns: Mapping[str, str] | None = None, limit: int | None = None
) -> ProblemTable:
    """An Arrow table as a :class:`ProblemTable`, by the row reader's rules: ``columns`` (our field ->
    the data's column) adds our names beside the data's own, a missing ``id`` is generated from the
    problem's text, numbers in ``id``/``answer`` become text, and a wrong type or a duplicate id is one
    :class:`~graft_rl.data.DatasetError` naming the row."""
    if limit is not None:
        table = table.slice(0, limit)
    if table.num_rows == 0:
        raise DatasetError(f"{name}: no rows")
    cols: dict[str, pa.Array] = {n: _decoded(table.column(n).combine_chunks()) for n in table.column_names}
    for ours, theirs in (columns or {}).items():
        if theirs not in cols:
            raise DatasetError(f"{_where(name, 0)}: row has no {theirs!r} column (data.columns maps {ours} to it)")
        cols[ours] = cols[theirs]
    if "problem" in cols:
        cols["problem"] = _problem_column(cols["problem"], name)
    if "id" not in cols and "problem" in cols:
        cols["id"] = _generated_ids(cols["problem"])
        given = False
    else:
        given = True
    for key in _TYPES:
        if key not in cols:
            raise DatasetError(f"{_where(name, 0)}: row has no '{key}' field")
        if key != "problem":
            cols[key] = _as_text(cols[key], key, name)
    for key in _OPTIONAL:
        if key in cols:
            cols[key] = _optional(cols[key], key, name)
    if given:
        _check_unique(cols["id"], name)
    order = [f for f in _FIELDS if f in cols] + [c for c in cols if c not in _FIELDS]
    return ProblemTable(pa.table({c: cols[c] for c in order}), name)
