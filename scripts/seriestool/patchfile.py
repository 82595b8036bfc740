"""The patch file format: a header (Subject, Topic, Why, How, Upstream, Drop when, Tested
on; continuation lines indented two spaces), a line ``---``, a git diff without ``index``
lines.  In build/vllm a patch is one commit: the header as its message, plus a
``Series-Patch: <file>`` trailer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import SeriesError

HEADER_FIELDS = ("Subject", "Topic", "Why", "How", "Upstream", "Drop when", "Tested on")
TOPICS = ("order-contract", "fetch-kv", "mla-fusion")
TRAILER = "Series-Patch: "
NAME_RE = re.compile(r"^\d{4}-[a-z0-9][a-z0-9.-]*\.patch$")
_FIELD_RE = re.compile(r"^([A-Z][A-Za-z ]*):(?: (.*))?$")


@dataclass
class Patch:
    path: Path
    header: list[str]          # header lines, "Subject: ..." first
    diff: str                  # from the first "diff --git" line on

    @property
    def name(self) -> str:
        return self.path.name

    def fields(self) -> dict[str, str]:
        return header_fields(self.header)

    @property
    def subject(self) -> str:
        return self.fields().get("Subject", "")

    @property
    def topic(self) -> str:
        return self.fields().get("Topic", "")

    def commit_message(self) -> str:
        subject = self.header[0].removeprefix("Subject:").strip()
        body = "".join(line + "\n" for line in self.header[1:])
        return f"{subject}\n\n{body}" + ("\n" if body else "") + f"{TRAILER}{self.name}\n"

    def files(self) -> list[str]:
        return [line.split(" b/", 1)[-1] for line in self.diff.splitlines() if line.startswith("diff --git ")]


def header_fields(header: list[str]) -> dict[str, str]:
    """Header fields; continuation lines are joined to their field."""
    out: dict[str, str] = {}
    current = None
    for line in header:
        match = _FIELD_RE.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            out[current] = (match.group(2) or "").strip()
        elif current is not None:
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


def header_problems(header: list[str]) -> list[str]:
    """What a header lacks: missing or empty fields, an unknown topic."""
    fields = header_fields(header)
    missing = [f for f in HEADER_FIELDS if not fields.get(f)]
    problems = [f"lacks the header field(s) {', '.join(missing)}"] if missing else []
    if fields.get("Topic") and fields["Topic"] not in TOPICS:
        problems.append(f"unknown Topic {fields['Topic']!r} (one of {', '.join(TOPICS)})")
    return problems


def parse(path: Path) -> Patch:
    text = path.read_text()
    lines = text.splitlines()
    if "---" not in lines:
        raise SeriesError(f"{path}: no '---' line between the header and the diff")
    diff_start = text.find("\ndiff --git ")
    if diff_start < 0:
        raise SeriesError(f"{path}: no 'diff --git' section")
    return Patch(path=path, header=lines[:lines.index("---")], diff=text[diff_start + 1:])


def header_from_commit_message(message: str) -> tuple[list[str], str | None]:
    """Invert Patch.commit_message: (header lines, patch name from the trailer or None)."""
    lines = message.rstrip("\n").splitlines()
    name = None
    if lines and lines[-1].startswith(TRAILER):
        name = lines.pop()[len(TRAILER):].strip()
    while lines and not lines[-1].strip():
        lines.pop()
    body = lines[1:]
    while body and not body[0].strip():
        body.pop(0)
    return [f"Subject: {lines[0] if lines else ''}", *body], name


def strip_index_lines(diff: str) -> str:
    """Drop the ``index abc..def`` lines of a git diff (a line of a hunk starts with " ", "+" or "-")."""
    return re.sub(r"^index [0-9a-f]+\.\.[0-9a-f]+.*\n", "", diff, flags=re.M)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:50] or "patch"


def read_series(patches_dir: Path) -> list[str]:
    series = patches_dir / "series"
    if not series.exists():
        return []
    lines = (raw.split("#", 1)[0].strip() for raw in series.read_text().splitlines())
    return [line for line in lines if line]


def write_series(patches_dir: Path, names: list[str]) -> None:
    """Rewrite the entries of ``series`` in this order; a comment block directly above an
    entry moves with it, comments at the top of the file stay at the top."""
    series = patches_dir / "series"
    top: list[str] = []
    attached: dict[str, list[str]] = {}
    pending: list[str] = []
    for raw in series.read_text().splitlines() if series.exists() else []:
        entry = raw.split("#", 1)[0].strip()
        if entry:
            attached[entry] = pending
            pending = []
        elif attached:
            pending.append(raw)
        else:
            top.append(raw)
    out = list(top)
    for name in names:
        out += attached.get(name, []) + [name]
    series.write_text("\n".join(out + pending) + "\n")
