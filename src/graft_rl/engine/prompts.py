"""The training table at any size (docs/tasks.md, "Large datasets"; docs/design.md, layer 5).

Start-up and per-step cost do not grow with the table:

- :func:`check_prompts` keeps the promise that every prompt fits every policy (its context and
  ``max_prompt_tokens``, else one line before step 1) and clamps ``max_new_tokens`` to what the
  longest training prompt leaves, as before, but tokenises only the prompts that could reach a
  limit: a prompt of ``b`` UTF-8 bytes has at most ``factor * (overhead + b) + slack`` tokens
  (:func:`graft_rl.policy.tokens.prompt_bound`), computed for the whole table as one column
  operation. Every other prompt is shorter than the limit, so the result is the one tokenising
  every prompt gives. Under Ray only those prompts travel to the actors, never the table.
- :class:`PromptRows` turns the rows a step draws into the dicts a reward gets, and keeps only the
  last few steps' (a run never holds one Python object per row of its table).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graft_rl.data.table import chat_rows, problem_bytes, take, unique_values

__all__ = ["PromptRows", "PromptFamilies", "check_prompts", "candidates", "training_data", "prompt_families"]


class PromptRows(Mapping):
    """Prompt id -> the row a reward gets (every column), for the prompts drawn lately.

    :meth:`draw` turns table indices into ``(id, problem)`` pairs and remembers their rows, tagged with
    the step that drew them; rows drawn two steps before the newest are forgotten (a step's batch,
    its refills and the next step's prefetched batch stay)."""

    def __init__(self, data: Sequence):
        self.data = data
        self._rows: OrderedDict[str, tuple[int, dict, int]] = OrderedDict()

    def draw(self, indices: Sequence[int], step: int) -> list[tuple[str, str]]:
        indices = list(indices)
        problems = take(self.data, indices)
        for i, p in zip(indices, problems, strict=True):
            self._rows[p.id] = (i, p.row(), step)
            self._rows.move_to_end(p.id)
        newest = max(t for _, _, t in self._rows.values())
        while self._rows and next(iter(self._rows.values()))[2] < newest - 2:
            self._rows.popitem(last=False)
        return [(p.id, p.problem) for p in problems]

    def index(self, prompt_id: str) -> int:
        """The table index of a drawn prompt."""
        return self._rows[prompt_id][0]

    def __getitem__(self, prompt_id: str) -> dict:
        return self._rows[prompt_id][1]

    def __iter__(self):
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


class PromptFamilies(Mapping):
    """Prompt id -> family (its ``subject``), read from the drawn rows; true even before any draw."""

    def __init__(self, rows: PromptRows):
        self.rows = rows

    def __getitem__(self, prompt_id: str) -> str:
        return self.rows[prompt_id]["subject"]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __bool__(self) -> bool:
        return True


def training_data(cfg) -> Sequence:
    """``data.train``: a :class:`ProblemTable` for a table file (Arrow columns, docs/tasks.md "Large
    datasets"), else the row reader's list; at least ``prompt_batch`` problems (else one line)."""
    from graft_rl.data import load_dataset, load_table
    from graft_rl.errors import ConfigError

    data = load_table(cfg.data.train, cfg.data.limit, cfg.data.columns)
    if data is None:
        data = load_dataset(cfg.data.train, cfg.data.limit, cfg.data.columns)
    if len(data) < cfg.prompt_batch:
        raise ConfigError(
            f"data.train {cfg.data.train!r} has {len(data)} problems, fewer than prompt_batch={cfg.prompt_batch}"
        )
    return data


def prompt_families(rows: PromptRows, data: Sequence, val_sets: dict) -> tuple[Mapping, dict[str, bool]]:
    """``(prompt id -> family, validation set -> scored per family)``: training prompts have families
    when every one names a ``subject`` and there are 2..MAX_FAMILIES of them, or when the pool is one
    family that validation scores among others (the lookup pair); else ``{}``."""
    from graft_rl.engine.evaluation import MAX_FAMILIES, families

    subjects = unique_values(data, "subject")
    per_family = {name: bool(families(ps)) for name, ps in val_sets.items()}
    if None not in subjects and 2 <= len(subjects) <= MAX_FAMILIES:
        return PromptFamilies(rows), per_family
    val_fams = {p.subject for name, ps in val_sets.items() if per_family[name] for p in ps}
    if len(subjects) == 1 and subjects[0] is not None and subjects[0] in val_fams:
        return PromptFamilies(rows), per_family
    return {}, per_family


def candidates(data: Sequence, bound: dict, limit: float) -> np.ndarray:
    """Indices of the problems whose token bound exceeds ``limit`` (every one when the policy has no
    bound): only these can be longer than ``limit`` tokens."""
    n = len(data)
    if not n or not np.isfinite(limit):
        return np.arange(0)
    if bound.get("factor") is None:
        return np.arange(n)
    size = bound["factor"] * (bound["overhead"] + problem_bytes(data)) + bound["slack"]
    return np.flatnonzero((size > limit) | chat_rows(data))  # a chat prompt's turns are rendered one by one


def check_prompts(workers: dict, train: Sequence, others: list[Sequence], max_new_tokens: int):
    """``{policy: (max_new_tokens, note)}``: every prompt of ``train`` and ``others`` (validation sets)
    fits each policy (else its :class:`~graft_rl.policy.tokens.PromptTooLongError`, naming the prompt),
    and the training responses' budget, clamped to the context the longest training prompt leaves.
    ``workers``: each policy's :class:`~graft_rl.engine.handles.WorkerHandle` (every call started on
    all of them before any is awaited)."""
    bounds = {name: w.prompt_bound() for name, w in workers.items()}
    bounds = {name: pending.get() for name, pending in bounds.items()}
    fits: dict[str, Any] = {}
    budgets: dict[str, Any] = {}
    for name, b in bounds.items():
        ctx = b["context"]
        if ctx is None:  # no stated context: nothing to check against (as the exact check did)
            fits[name] = budgets[name] = None
            continue
        fit_limit = min(ctx - 1, b["max_prompt_tokens"])
        every = [take(d, candidates(d, b, fit_limit)) for d in (train, *others)]
        fits[name] = workers[name].prompt_budget([p for ps in every for p in ps], 1)
    for pending in fits.values():
        if pending is not None:
            pending.get()
    for name, b in bounds.items():
        if b["context"] is None:
            continue
        budgets[name] = workers[name].prompt_budget(
            take(train, candidates(train, b, b["context"] - max_new_tokens)), max_new_tokens
        )
    return {name: (max_new_tokens, None) if p is None else p.get() for name, p in budgets.items()}
