"""Problem tables over Arrow columns (issue 40, item 4): the same problems as the row reader, the
same one-line errors, and whole-table checks as column operations."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from graft_rl.data import DatasetError, check_answers, load_dataset, load_jsonl, load_table, problems_from_rows
from graft_rl.data.sources import read_jsonl_table
from graft_rl.data.table import ProblemTable, chat_rows, from_arrow, problem_bytes, unique_values

ROWS = [
    {"question": "1+1=?", "target": 2, "kind": "a", "weight": 0.5, "tags": ["x", "y"], "level": 1},
    {"question": "2+2=?", "target": 4, "kind": "b", "weight": 1.5, "tags": [], "level": None},
    {"question": "2+2=?", "target": 4, "kind": "b", "weight": 2.5, "tags": ["z"], "level": 3},  # same text: id -2
    {
        "question": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+3?"}],
        "target": 6,
        "kind": "a",
        "weight": 0.0,
        "tags": ["é"],
        "level": 2,
    },
]
COLUMNS = {"problem": "question", "answer": "target", "subject": "kind"}


def _same(a, b):
    assert list(a) == list(b)
    assert [p.extra for p in a] == [p.extra for p in b]


def _rows_for_arrow(rows):
    """The chat row's problem column must be one type for Arrow: every problem as messages."""
    out = []
    for r in rows:
        q = r["question"]
        out.append({**r, "question": q if isinstance(q, list) else [{"role": "user", "content": q}]})
    return out


def test_a_table_yields_what_the_row_reader_gives():
    rows = [r for r in ROWS if isinstance(r["question"], str)]
    table = from_arrow(pa.Table.from_pylist(rows), "t", COLUMNS)
    _same(table, problems_from_rows(rows, "t", COLUMNS))
    chats = _rows_for_arrow(ROWS)
    _same(from_arrow(pa.Table.from_pylist(chats), "t", COLUMNS), problems_from_rows(chats, "t", COLUMNS))
    assert [p.id for p in table][1:] == [table[1].id, table[1].id + "-2"]  # generated, duplicates numbered
    assert table[-1].answer == "4" and table[1:3] == list(table)[1:3] and table.take([2, 0]) == [table[2], table[0]]


def test_given_ids_numbers_and_optional_fields_follow_the_row_reader():
    rows = [
        {"id": 7, "problem": "p", "answer": 1.5, "source": "s", "solution": None},
        {"id": 8, "problem": "q", "answer": 2.0, "source": None, "solution": "x"},
    ]
    _same(from_arrow(pa.Table.from_pylist(rows), "t"), problems_from_rows(rows, "t"))


@pytest.mark.parametrize(
    ("rows", "columns", "message"),
    [
        ([{"id": "a", "problem": "p", "answer": "1"}] * 2, None, r"t: row 1: duplicate id 'a' \(first in row 0\)"),
        ([{"problem": "p", "answer": "1"}], {"answer": "label"}, r"row has no 'label' column \(data.columns maps"),
        ([{"problem": "p"}], None, r"t: row 0: row has no 'answer' field"),
        ([{"problem": "p", "answer": "1"}, {"problem": None, "answer": "2"}], None, r"row 1: .*got NoneType"),
        ([{"problem": "p", "answer": True}], None, r"field 'answer' must be a string, got bool"),
        ([{"problem": "p", "answer": "1", "level": "hard"}], None, r"field 'level' must be int or null, got str"),
    ],
)
def test_bad_tables_are_one_line_naming_the_row(rows, columns, message):
    with pytest.raises(DatasetError, match=message):
        from_arrow(pa.Table.from_pylist(rows), "t", columns)


def test_whole_table_checks_are_column_operations():
    chats = from_arrow(pa.Table.from_pylist(_rows_for_arrow(ROWS)), "t", COLUMNS)
    assert list(chat_rows(chats)) == [True] * 4
    plain = from_arrow(pa.Table.from_pylist(ROWS[:3]), "t", COLUMNS)
    as_list = list(plain)
    assert list(problem_bytes(plain)) == list(problem_bytes(as_list)) == [5, 5, 5]
    assert sorted(unique_values(plain, "subject")) == ["a", "b"] == sorted(unique_values(as_list, "subject"))
    assert unique_values(plain, "source") == [None]
    bad = from_arrow(pa.Table.from_pylist([{"id": "x", "problem": "p", "answer": "3 or 4"}]), "bad")
    with pytest.raises(DatasetError, match=r"bad: problem 'x' has answer '3 or 4', which is not one number"):
        check_answers(bad, "gsm8k", "bad")
    check_answers(plain, "gsm8k", "plain")


def test_a_large_jsonl_read_by_pyarrow_gives_the_line_reader_s_problems(tmp_path, monkeypatch):
    from graft_rl.data import loading

    path = tmp_path / "big.jsonl"
    rows = [{"id": f"q{i}", "problem": f"{i}*{i}?", "answer": str(i * i), "meta": {"k": i}} for i in range(50)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(loading, "JSONL_TABLE_BYTES", 1)
    table = load_table(str(path), columns=None)
    assert isinstance(table, ProblemTable)
    _same(table, load_jsonl(path))
    path.write_text(path.read_text() + '{"id": "bad", "problem": 3}\n')  # a type that changes: the line reader
    assert read_jsonl_table(path) is None and load_table(str(path)) is None
    with pytest.raises(DatasetError, match=r"big.jsonl:51: field 'problem' must be a string"):
        load_dataset(str(path))


def test_the_shipped_jsonl_files_read_the_same_through_pyarrow():
    from graft_rl.data import TESTBED_DATA, TESTBED_FILES

    for name, (rel, _) in TESTBED_DATA.items():
        table = read_jsonl_table(TESTBED_FILES / rel)
        assert table is not None, name
        _same(from_arrow(table, name), load_dataset(name))


def test_a_csv_keeps_empty_cells_null_and_dates_as_text(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("problem,answer,when,subject\n1+1=?,2,2020-01-01,\n2+2=?,4,2020-01-02,a\n")
    table = load_table(str(path))
    rows = list(table)
    assert rows[0].extra["when"] == "2020-01-01" and rows[0].subject is None and rows[1].subject == "a"


def test_a_parquet_with_a_categorical_column_reads(tmp_path):
    import pyarrow.parquet as pq

    t = pa.table({"problem": pa.array(["a", "b", "a"]).dictionary_encode(), "answer": ["1", "2", "3"]})
    pq.write_table(t, tmp_path / "cat.parquet")
    assert [p.problem for p in load_table(str(tmp_path / "cat.parquet"))] == ["a", "b", "a"]


@pytest.mark.parametrize(
    "lines",
    [
        ['{"id": "a", "problem": "p", "answer": "1"}', '{"problem": "q", "answer": "2"}'],  # a key missing
        ['{"id": "a", "problem": "p", "answer": 1}', '{"id": "b", "problem": "q", "answer": 2.5}'],  # 1 -> 1.0
        [
            '{"id": "a", "problem": "p", "answer": "1", "m": {"x": 1}}',
            '{"id": "b", "problem": "q", "answer": "2", "m": {"y": 2}}',
        ],
    ],
    ids=["missing key", "int and float", "nested keys differ"],
)
def test_a_jsonl_pyarrow_would_read_differently_goes_to_the_line_reader(tmp_path, lines):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert read_jsonl_table(path) is None
