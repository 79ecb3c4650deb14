"""What one problem is (a row of a dataset), with no other part of ``graft_rl.data``: the leaf its
modules (``sources``, ``table``) and the package import."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

__all__ = ["DatasetError", "Problem", "content_id", "prompt_messages"]


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer."""

    id: str
    problem: str
    answer: str
    solution: str | None = None
    level: int | None = None
    subject: str | None = None
    source: str | None = None
    #: the row's other columns (JSON values), passed to a reward function with the fields above
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}

    def row(self) -> dict:
        """Every column of the problem's row, as a reward function gets it (a chat prompt as its messages)."""
        out = {**self.extra, **self.to_dict()}
        messages = prompt_messages(self.problem)
        if messages is not None:
            out["problem"] = messages
        return out


_TYPES = {"problem": str, "answer": str, "id": str}  # in the order a missing one is named
_OPTIONAL = {"solution": (str,), "level": (int,), "subject": (str,), "source": (str,)}


_FIELDS = ("id", "problem", "answer", "solution", "level", "subject", "source")


def content_id(problem: str) -> str:
    """A stable id for a row that has none: a hash of its problem text (duplicates get ``-2``, ``-3``, ...)."""
    return "h" + hashlib.sha1(problem.encode()).hexdigest()[:12]


def _chat(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def prompt_messages(problem: str) -> list[dict] | None:
    """The chat messages of a problem given as a list of messages (as :func:`load_dataset` keeps it), else None."""
    if not problem.startswith('[{"role"'):
        return None
    try:
        value = json.loads(problem)
    except json.JSONDecodeError:
        return None
    return value if _chat(value) else None
