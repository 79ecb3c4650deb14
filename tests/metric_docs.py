"""The metric keys ``docs/metrics.md`` documents, to check a run's lines against (tests import it)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).parents[1] / "docs" / "metrics.md"


def documented(log: str) -> list[re.Pattern]:
    """The key patterns of the table under ``## `<log>` `` (``<peer>`` etc. match one path part)."""
    text = DOC.read_text()
    section = text.split(f"## `{log}`", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if line.startswith("| `"):
            for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
                out.append(
                    re.compile(
                        re.sub(r"<[a-z]+>", "[^/]+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">")) + "$"
                    )
                )
    return out


def undocumented(lines: list[dict], log: str = "metrics.jsonl") -> set[str]:
    """The keys of ``lines`` that the table for ``log`` does not document."""
    pats = documented(log)
    return {k for ln in lines for k in ln if not any(p.match(k) for p in pats)}
