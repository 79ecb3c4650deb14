"""Datasets: shipped files with provenance, schema errors naming file and line, reasoning-gym tasks."""

from __future__ import annotations

import json

import pytest

from graft_rl.data import (
    BENCHMARKS,
    BUILTIN,
    PROMPT_SUFFIX,
    DatasetError,
    ReasoningGymTask,
    files_dir,
    load_dataset,
    load_jsonl,
    make_prompt,
    verifier_for,
)
from graft_rl.rewards import score_responses

EXPECTED_ROWS = {
    "math_train": 7498,  # the file's 7,500 less the 2 with an empty reference (BUILTIN_LEFT_OUT)
    "math500": 500,
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "minerva": 272,
    "gsm8k_train": 7473,
    "gsm8k_test": 1319,
}


@pytest.mark.parametrize("name", list(BUILTIN))
def test_builtin_datasets_ship_with_the_package(name):
    rows = load_dataset(name)
    assert len(rows) == EXPECTED_ROWS[name]
    assert all(r.id and r.problem for r in rows)


def test_provenance_ships_beside_the_data():
    text = (files_dir() / "PROVENANCE.md").read_text()
    assert "sha256" in text and "math_train.jsonl" in text


def test_benchmarks_are_the_papers_five():
    assert BENCHMARKS == ("math500", "aime24", "aime25", "amc23", "minerva")


def test_limit():
    assert len(load_dataset("math500", limit=7)) == 7


def test_row_without_answer_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(
        json.dumps({"id": "a", "problem": "1+1", "answer": "2"}) + "\n" + json.dumps({"id": "b", "problem": "x"}) + "\n"
    )
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: row has no 'answer' field"):
        load_jsonl(p)


def test_malformed_json_and_duplicates_and_types(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": "a", "problem": "p", "answer": "1"}\n{oops\n')
    with pytest.raises(DatasetError, match=r"x.jsonl:2: not valid JSON"):
        load_jsonl(p)
    p.write_text('{"id": "a", "problem": "p", "answer": "1"}\n{"id": "a", "problem": "q", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"duplicate id 'a' \(first on line 1\)"):
        load_jsonl(p)
    p.write_text('{"id": "a", "problem": 3, "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"field 'problem' must be a string"):
        load_jsonl(p)
    p.write_text('{"id": "a", "problem": "p", "answer": 12}\n')
    assert load_jsonl(p)[0].answer == "12"


def test_unknown_name_lists_what_exists(tmp_path):
    with pytest.raises(DatasetError, match="built-in: math_train, math500"):
        load_dataset("math5000")
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(str(tmp_path / "missing.jsonl"))


def test_prompt_format_uses_the_papers_suffix():
    assert make_prompt("Q?") == "Q?\n" + PROMPT_SUFFIX
    assert make_prompt("Q?", suffix=None) == "Q?"


def test_verifier_for():
    assert verifier_for("math500") == "math" and verifier_for("gsm8k_test") == "gsm8k"
    assert verifier_for("reasoning_gym:chain_sum") == "gym"


@pytest.mark.slow  # builds reasoning-gym tasks and scores them in the verifier pool
def test_reasoning_gym_task_rows_and_scoring():
    task = ReasoningGymTask("chain_sum", size=5, seed=1)
    rows = task.problems()
    assert len(rows) == 5 and rows[0].id == "rg/chain_sum/1/0"
    responses = [f"\\boxed{{{r.answer}}}" for r in rows[:3]] + ["\\boxed{-99999}", "none"]
    scores, stats = score_responses(
        responses, [r.answer for r in rows], "gym", [r.source for r in rows], [r.id for r in rows]
    )
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0] and stats.total == 5
    assert load_dataset("reasoning_gym:chain_sum:5:1")[2] == rows[2]
    with pytest.raises(DatasetError, match="unknown reasoning_gym task"):
        ReasoningGymTask("no_such_task")


def test_reasoning_gym_generators_print_nothing(capfd):
    # reasoning-gym's bf compiler writes a dot per problem: SAPO's nine specialties filled a terminal
    from graft_rl.rewards.checks import gym_score

    rows = load_dataset("reasoning_gym:bf:3:0")
    assert len(rows) == 3 and gym_score("bf", 3, 0, "{}", 1, rows[1].answer) == 1.0
    assert capfd.readouterr().out == ""


def test_score_responses_dispatch():
    assert score_responses([r"\boxed{2}"], ["2"], "gsm8k")[0] == [1.0]
    with pytest.raises(ValueError, match="unknown verifier"):
        score_responses(["x"], ["1"], "code")


def test_gzipped_jsonl_loads_and_errors_name_file_and_line(tmp_path):
    import gzip

    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('{"id": "a", "problem": "1+1", "answer": "2"}\n{"id": "b", "problem": "x"}\n')
    assert [p.id for p in load_dataset(str(path), limit=1)] == ["a"]
    with pytest.raises(DatasetError, match=r"d\.jsonl\.gz:2: .*answer"):
        load_dataset(str(path))
