"""A researcher's own data: parquet / CSV / JSON files, save_to_disk folders and hub datasets (from the
local cache, offline) through Hugging Face ``datasets``; column mapping, generated ids, chat prompts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graft_rl.data import DatasetError, load_dataset, prompt_chat

ROWS = [
    {"question": f"What is {i} + {i}?", "label": 2 * i, "difficulty": "easy" if i < 3 else "hard"} for i in range(6)
]
COLUMNS = {"problem": "question", "answer": "label"}


def _check(problems, n=6):
    assert len(problems) == n
    assert [p.problem for p in problems] == [r["question"] for r in ROWS[:n]]
    assert [p.answer for p in problems] == [str(r["label"]) for r in ROWS[:n]]  # numbers become text
    assert problems[4].extra["difficulty"] == "hard"  # kept for the reward, with the mapped columns' own names
    row = problems[4].row()
    assert (
        row["difficulty"] == "hard" and row["answer"] == "8" and row["label"] == 8 and row["question"] == row["problem"]
    )
    assert len({p.id for p in problems}) == n


def test_parquet_with_a_column_mapping(tmp_path):
    path = tmp_path / "task.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    _check(load_dataset(str(path), columns=COLUMNS))
    assert len(load_dataset(str(path), limit=2, columns=COLUMNS)) == 2


def test_csv_and_json_files(tmp_path):
    csv = tmp_path / "task.csv"
    csv.write_text(
        "question,label,difficulty\n" + "".join(f"{r['question']},{r['label']},{r['difficulty']}\n" for r in ROWS)
    )
    _check(load_dataset(str(csv), columns=COLUMNS))
    js = tmp_path / "task.json"
    js.write_text(json.dumps(ROWS))
    _check(load_dataset(str(js), columns=COLUMNS))


def test_a_jsonl_whose_fields_are_named_otherwise(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _check(load_dataset(str(path), columns=COLUMNS))
    with pytest.raises(DatasetError, match=r"task.jsonl:1: row has no 'problem' field"):
        load_dataset(str(path))  # without the mapping: one line naming file, line and field
    with pytest.raises(DatasetError, match=r"row has no 'prompt' column \(data.columns maps problem to it\)"):
        load_dataset(str(path), columns={"problem": "prompt", "answer": "label"})


def test_a_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(folder))
    _check(load_dataset(str(folder), columns=COLUMNS))


def test_ids_are_stable_when_absent_and_unique_for_duplicates(tmp_path):
    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS + ROWS[:1]), path)
    first = load_dataset(str(path), columns=COLUMNS)
    again = load_dataset(str(path), columns=COLUMNS)
    assert [p.id for p in first] == [p.id for p in again]  # the same ids every load (resume, peers' records)
    assert first[6].id == first[0].id + "-2"
    shuffled = tmp_path / "shuffled.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[::-1]), shuffled)
    assert {p.id for p in load_dataset(str(shuffled), columns=COLUMNS)} == {p.id for p in first[:6]}  # by content


def test_chat_prompts_are_kept_as_messages(tmp_path):
    rows = [
        {
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": f"{i}+{i}?"}],
            "answer": str(2 * i),
        }
        for i in range(3)
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    problems = load_dataset(str(path), columns={"problem": "messages"})
    assert problems[1].row()["problem"] == rows[1]["messages"]  # the reward sees the messages
    chat = prompt_chat(problems[1].problem, "Answer in a box.")
    assert chat == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1+1?\nAnswer in a box."}]
    assert prompt_chat("2+2?", None) == [{"role": "user", "content": "2+2?"}]


def test_a_hub_dataset_from_the_local_cache_offline(tmp_path, monkeypatch):
    """A dataset downloaded once (the hub cache's layout) loads with no network; one absent is one line."""
    pytest.importorskip("datasets")
    repo = tmp_path / "hf" / "hub" / "datasets--testorg--arith"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    files = repo / "snapshots" / "0123abcd" / "data"
    files.mkdir(parents=True)
    (files / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (files / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _check(load_dataset("hf:testorg/arith", columns=COLUMNS))
    assert len(load_dataset("hf:testorg/arith::test", columns=COLUMNS)) == 2
    with pytest.raises(
        DatasetError, match=r"hf:testorg/absent: not in the local Hugging Face cache .* HF_HUB_OFFLINE is set"
    ):
        load_dataset("hf:testorg/absent", columns=COLUMNS)
    with pytest.raises(DatasetError, match=r"expected hf:ORG/NAME\[:CONFIG\]\[:SPLIT\]"):
        load_dataset("hf:")


def test_the_shipped_datasets_are_unchanged():
    rows = load_dataset("math500")
    assert rows[0].extra == {} and set(rows[0].row()) <= {
        "id",
        "problem",
        "answer",
        "solution",
        "level",
        "subject",
        "source",
    }
