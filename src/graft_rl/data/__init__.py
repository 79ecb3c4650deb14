"""Prompt datasets (docs/design.md, layer 2): JSONL problems, the paper's benchmarks, procedural tasks,
and any table ``datasets`` reads (docs/tasks.md).

Every dataset is a list of :class:`Problem` rows with the schema of the shipped files
(``files/PROVENANCE.md``): ``id``, ``problem``, ``answer`` and optional ``solution``,
``level``, ``subject``, ``source``; any other column is kept in :attr:`Problem.extra` for a reward
function. Built-in names: ``math_train`` (the default training
set, 7,500 less the 2 with an empty reference: ``BUILTIN_LEFT_OUT``), the five benchmarks ``math500``, ``aime24``, ``aime25``, ``amc23``,
``minerva``, and ``gsm8k_train`` / ``gsm8k_test``. A JSONL file is loaded by path;
``reasoning_gym:NAME`` builds a procedural task (:class:`ReasoningGymTask`); ``hf:ORG/NAME[:CONFIG][:SPLIT]``,
a parquet / CSV / JSON file or a ``save_to_disk`` folder load through ``datasets``
(:mod:`graft_rl.data.sources`). ``columns`` maps a file's own column names to ``id``/``problem``/``answer``;
a row without an id gets one from its content; a problem given as a list of chat messages is kept as one.

The modules: ``problem`` (the row), ``catalog`` (what ships), ``loading``, ``sources`` and ``table``
(reading), ``prompts`` (what a model sees), ``answers`` (which verifier, and answers it cannot match).
"""

from __future__ import annotations

from graft_rl.data.answers import check_answers, default_reward, verifier_for
from graft_rl.data.catalog import BENCHMARKS, BUILTIN, BUILTIN_LEFT_OUT, TESTBED_DATA, TESTBED_FILES, files_dir
from graft_rl.data.loading import ReasoningGymTask, load_dataset, load_jsonl, load_table, problems_from_rows
from graft_rl.data.problem import DatasetError, Problem, content_id, prompt_messages
from graft_rl.data.prompts import PROMPT_SUFFIX, make_prompt, prompt_chat

__all__ = [
    "Problem",
    "DatasetError",
    "PROMPT_SUFFIX",
    "BUILTIN",
    "BUILTIN_LEFT_OUT",
    "TESTBED_DATA",
    "TESTBED_FILES",
    "BENCHMARKS",
    "load_jsonl",
    "load_dataset",
    "load_table",
    "make_prompt",
    "prompt_messages",
    "prompt_chat",
    "problems_from_rows",
    "verifier_for",
    "default_reward",
    "check_answers",
    "ReasoningGymTask",
    "files_dir",
    "content_id",
]
