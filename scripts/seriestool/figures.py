"""Figures (measured or counted results) in text: a patch header must carry none (``make check``),
README/docs only inside generated regions (``make report`` warns).  A figure is a number with
the unit of a measurement or a test run: a ratio, percent, time, rate, error in ulp, test count,
before -> after count or a bare ``µs``; identifiers, versions, shapes and sizes are not figures.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# A number that is not part of an identifier or a version: not preceded by a
# letter, digit, '_', '.', '#', '/', '-' or '*' (vllm#123, v0.1, e4m3, 8/4, 2**31).
_DIGITS = r"\d+(?:,\d{3})*(?:\.\d+)?"
_NUM = rf"(?<![\w.#/*-]){_DIGITS}"
_RANGE = rf"{_NUM}(?:\s*(?:-|–|—|to)\s*{_DIGITS})?"
_END = r"(?![\w/])"

_PATTERNS = (
    ("ratio", rf"{_RANGE}(?:[x×]|\s×)(?!\s*\d)(?![\w])"),
    ("percent", rf"{_RANGE}\s?%"),
    ("time", rf"{_RANGE}\s?(?:µs|μs|us|ms|ns){_END}"),
    ("time", rf"{_RANGE}\s(?:s|sec|secs|seconds?|mins?|minutes?|hours?){_END}"),
    ("rate", rf"{_RANGE}\s?(?:[KMGTP]i?B/s|[KMGTP]bit/s|tok(?:ens)?/s|req(?:uests)?/s|it/s|"
             rf"[KMGTP]?FLOP/?s|[KMGTP]?FLOPS)(?![\w])"),
    ("roundoff", rf"{_RANGE}\s?(?:ulps?|units? of roundoff){_END}"),
    ("test count", rf"{_NUM}\s(?:passed|failed|skipped|xfailed|xpassed|errors?|pass|fail|"
                   rf"tests? pass(?:ed)?){_END}"),
    ("test count", rf"\.py\s+\d+/\d+{_END}"),
    ("test count", rf"{_NUM}/\d+\s(?:passed|pass|tests?){_END}"),
    ("before -> after", rf"{_NUM}\s*(?:->|→)\s*{_DIGITS}{_END}"),
    ("bare µs", r"(?<![\w])[µμ]s(?![\w])"),
)
_FIGURE_RE = re.compile("|".join(f"(?P<k{i}>{p})" for i, (_, p) in enumerate(_PATTERNS)))
_KINDS = {f"k{i}": kind for i, (kind, _) in enumerate(_PATTERNS)}


# A result file named in text (a patch header's Tested on, prose).
RESULT_FILE_RE = re.compile(r"benchmarks/results/[^\s`'\"()\[\],;]+")


class Figure(NamedTuple):
    kind: str
    text: str
    start: int


def find_figures(text: str) -> list[Figure]:
    """Every figure in ``text``, in order (see the module docstring)."""
    return [Figure(_KINDS[m.lastgroup], " ".join(m.group(0).split()), m.start())
            for m in _FIGURE_RE.finditer(text)]


# Not prose: generated regions (`make report`'s, `make readme`'s, `make compile-report`'s) and code.
_NOT_PROSE_RE = re.compile(
    r"<!-- gen:(?P<block>[\w.:-]+) -->.*?<!-- /gen:(?P=block) -->"
    r"|<!-- series-table:begin[^>]*-->.*?<!-- series-table:end -->"
    r"|<!-- (?P<tool>compile-tier|roofline):begin[^>]*-->.*?<!-- (?P=tool):end -->"
    r"|```.*?```|`[^`\n]*`",
    re.S)


def hand_typed(text: str) -> list[tuple[int, Figure]]:
    """(line number, figure) of every figure outside generated regions and code."""
    blanked = _NOT_PROSE_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [(blanked.count("\n", 0, f.start) + 1, f) for f in find_figures(blanked)]
