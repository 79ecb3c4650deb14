"""Answer extraction: the last ``\\boxed{...}`` of a response, and GSM8K-style numbers.

Pure string code, linear in the response length, safe to run in the trainer process.
"""

from __future__ import annotations

import re

__all__ = ["last_boxed", "normalize_answer", "parse_number", "parse_whole_number"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{|\s)")


def last_boxed(text: str) -> str | None:
    r"""Content of the **last** ``\boxed{...}`` (or ``\fbox{...}``, or ``\boxed 5``) in ``text``.

    Braces are matched, so nested groups like ``\boxed{\frac{1}{2}}`` come back whole. An
    unclosed last box returns ``None`` (the response was cut or malformed), as does a text
    with no box.

    Examples:
        >>> last_boxed(r"so \boxed{1} ... finally \boxed{\frac{a}{b}}.")
        '\\frac{a}{b}'
        >>> last_boxed(r"\boxed 5$") , last_boxed("no box"), last_boxed(r"\boxed{12")
        ('5', None, None)
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    if m.group(1) != "{":  # "\boxed 5" form: the token after the space, up to $ or whitespace
        tail = text[m.end() :]
        token = re.match(r"[^\s$]+", tail)
        return token.group(0) if token else None
    depth, start = 1, m.end()
    for i in range(start, len(text)):
        c = text[i]
        if c == "\\":  # skip escaped characters such as \{ and \}
            continue
        if c == "{" and text[i - 1] != "\\":
            depth += 1
        elif c == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def normalize_answer(s: str) -> str:
    """Whitespace-free form used for the exact-match fast path (equal strings are equal answers)."""
    return re.sub(r"\s+", "", s).removeprefix("$").removesuffix("$")


_NUM_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(text: str) -> float | None:
    r"""A GSM8K-style number: commas, ``$``, ``%`` and trailing units dropped; ``None`` if none.

    Examples:
        >>> parse_number("$1,234.50 dollars"), parse_number("-7"), parse_number("x")
        (1234.5, -7.0, None)
    """
    m = _NUM_RE.search(text.replace("\u2212", "-"))
    if not m:
        return None
    digits = m.group(0).replace(",", "")
    if len(digits) > 64:  # a runaway digit string is not an answer
        return None
    try:
        return float(digits)
    except ValueError:
        return None


_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_WHOLE_NUM_RE = re.compile(rf"([+-]?)\s*({_NUM})(?:\s*[A-Za-z][A-Za-z .]*)?")
_FRAC_RE = re.compile(rf"([+-]?)\s*\\[dt]?frac\s*\{{\s*({_NUM})\s*\}}\s*\{{\s*({_NUM})\s*\}}")
_FRAC_SHORT_RE = re.compile(r"([+-]?)\s*\\[dt]?frac(\d)(\d)")
_SLASH_RE = re.compile(rf"([+-]?)\s*({_NUM})\s*/\s*({_NUM})")
_UNIT_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm)\s*\{([^{}]*)\}")


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_whole_number(text: str) -> float | None:
    r"""The value of ``text`` if the *whole* text is one number, else ``None``.

    Accepted: a sign, thousands separators (``1,200``), decimals, ``$``/``%`` and LaTeX spacing,
    a trailing unit in words (``18 dollars``, ``5\text{ cm}``), and simple fractions
    (``\frac{1}{2}``, ``\frac12``, ``3/4``) as numbers. Anything with a second number or an
    operator is not one number: ``12-5``, ``3 or 4 or 5``, ``1,2``, ``2^3``.

    Examples:
        >>> [parse_whole_number(t) for t in ["1,200", r"-\frac{1}{2}", "3/4", r"\$18.50", "7 apples"]]
        [1200.0, -0.5, 0.75, 18.5, 7.0]
        >>> [parse_whole_number(t) for t in ["12-5", "3 or 4 or 5", "1/2 + 1", "1,2", "", "x"]]
        [None, None, None, None, None, None]
    """
    s = text.replace("\u2212", "-").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    s = _UNIT_TEXT_RE.sub(lambda m: " " + m.group(1) + " ", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    if len(s) > 200:
        return None
    for rx in (_FRAC_RE, _FRAC_SHORT_RE, _SLASH_RE):
        m = rx.fullmatch(s)
        if m:
            den = _num(m.group(3))
            if den == 0:
                return None
            value = _num(m.group(2)) / den
            return -value if m.group(1) == "-" else value
    m = _WHOLE_NUM_RE.fullmatch(s)
    if not m:
        return None
    value = _num(m.group(2))
    return -value if m.group(1) == "-" else value
