"""make check: every relative link in the repository's Markdown resolves.

For each tracked ``*.md`` file (README.md, docs/, benchmarks/, scripts/...),
every inline link or image ``[text](target)`` whose target is not a URL
(``http:``, ``https:``, ``mailto:``) must name an existing file or folder,
relative to the Markdown file, and a ``#fragment`` must be a heading anchor of
the target Markdown file (GitHub's slugs: lower case, punctuation dropped,
spaces to hyphens, ``-1``, ``-2`` ... for repeats) or an explicit
``<a id="...">`` / ``<a name="...">``.  Fenced code blocks and inline code are
not read.  One finding a broken link: ``file:line: link target ... why``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_FENCE_RE = re.compile(r"^\s*(```|~~~)")
_CODE_RE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+(?:\([^()\s]*\)[^()\s<>]*)*)>?"
                      r"(?:\s+\"[^\"]*\")?\s*\)")
_HEADING_RE = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_ANCHOR_RE = re.compile(r"<a\s+(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_URL_RE = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _prose_lines(text: str, keep_code: bool = False):
    """(line number, line without inline code unless keep_code) outside fenced code blocks."""
    fenced = None
    for lineno, line in enumerate(text.splitlines(), 1):
        fence = _FENCE_RE.match(line)
        if fence:
            if fenced is None:
                fenced = fence.group(1)
            elif fence.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield lineno, line if keep_code else _CODE_RE.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading)              # inline HTML
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(text, keep_code=True):
        found.update(_ANCHOR_RE.findall(line))
        match = _HEADING_RE.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str):
    """(line number, target) of every inline link and image outside code."""
    for lineno, line in _prose_lines(text):
        for match in _LINK_RE.finditer(line):
            yield lineno, match.group(1)


def check_file(root: Path, rel: str, cache: dict[Path, set[str]] | None = None) -> list[str]:
    cache = {} if cache is None else cache
    path = root / rel
    findings = []
    for lineno, target in links(path.read_text(errors="replace")):
        if _URL_RE.match(target):
            continue
        where, _, fragment = target.partition("#")
        dest = (path.parent / where).resolve() if where else path.resolve()
        shown = f"{rel}:{lineno}: link {target!r}"
        if where.startswith("/"):
            findings.append(f"{shown}: absolute path (GitHub resolves it from the site root; use a "
                            "path relative to the file)")
            continue
        if not dest.exists():
            findings.append(f"{shown}: {dest.relative_to(root) if dest.is_relative_to(root) else dest} "
                            "does not exist")
            continue
        if fragment and dest.suffix == ".md" and dest.is_file():
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(errors="replace"))
            if fragment not in cache[dest]:
                findings.append(f"{shown}: no heading or anchor #{fragment} in "
                                f"{dest.relative_to(root) if dest.is_relative_to(root) else dest}")
    return findings


def tracked_markdown(root: Path) -> list[str]:
    """Tracked *.md files (git ls-files), or every *.md outside build/ and dot folders without git."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "*.md"],
                          capture_output=True, text=True)
    if proc.returncode == 0:
        return sorted(f for f in proc.stdout.split("\0") if f and (root / f).is_file())
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.md")
                  if not any(part.startswith(".") or part == "build" for part in p.relative_to(root).parts))


def lint_links(root: Path) -> list[str]:
    cache: dict[Path, set[str]] = {}
    return [f for rel in tracked_markdown(root) for f in check_file(root, rel, cache)]
