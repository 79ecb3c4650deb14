"""A griffe extension for the documentation site (mkdocs.yml): our docstrings are Google style with
reStructuredText roles and math (``:func:`x```, ``:math:`x```, ``.. math::``), which Markdown would
show raw. Roles become code spans; math becomes arithmatex's ``\\( \\)`` and ``$$`` blocks
(MathJax on the site). The docstrings themselves stay as they are, for ``help()`` and Sphinx."""

from __future__ import annotations

import re

try:
    import griffe
except ImportError:  # the converter alone (its test runs in venvs without the docs extra)
    griffe = None

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|const):`(~?)([^`]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")


def _role(m: re.Match) -> str:
    """``:func:`~a.b``` -> `` `b` ``, ``:func:`a.b``` -> `` `a.b` `` (Sphinx's reading of ``~``)."""
    short, target = m.group(1), m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _math_blocks(text: str) -> str:
    """``.. math:: first line`` and its indented continuation lines -> a ``$$`` block."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)\.\. math::\s*(.*)$", line)
        if not m:
            out.append(line)
            i += 1
            continue
        indent, body = m.group(1), [m.group(2)] if m.group(2) else []
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            body.append(lines[i].strip())
            i += 1
        out += [f"{indent}$$", *(f"{indent}{b}" for b in body), f"{indent}$$"]
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    text = _math_blocks(text)
    text = MATH_ROLE.sub(lambda m: f"\\({m.group(1)}\\)", text)
    return ROLE.sub(_role, text)


if griffe is not None:

    class RstToMarkdown(griffe.Extension):
        def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = rst_to_markdown(obj.docstring.value)
