"""Topics: which upstream PR each patch, overlay file and PR test belongs to.

A patch names its topic in its header; ``patches/overlay-topics`` maps overlay files
(``<fnmatch glob> <topic>[,<topic>]``, the first matching line wins); ``patches/pr-tests``
lists each PR's tests (``<file here> <path in vLLM> <topic>``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from .patchfile import TOPICS

OVERLAY_TOPICS = "overlay-topics"
PR_TESTS = "pr-tests"

# Titles for the exported PR, and the benchmark kernels whose committed
# results (benchmarks/results/*.json, extra_info["kernel"]) are the topic's.
TOPIC_TITLES = {
    "order-contract": "AITER FA: split decode/extend/prefill correctly under Model Runner V2's batch order",
    "fetch-kv": "AITER FA: faster KV-cache fetch for the extend path",
    "mla-fusion": "MLA: fuse RoPE with the KV-cache write",
}
TOPIC_KERNELS = {
    "order-contract": ("order_host",),
    "fetch-kv": ("fetch_kv", "fetch_kv_plan", "paged_context"),
    "mla-fusion": ("mla_rope_cache",),
}


def _lines(path: Path):
    """(where, fields) of each non-comment line of a patches/ list file."""
    for lineno, raw in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            yield f"patches/{path.name}:{lineno}", line.split()


def read_rules(patches_dir: Path) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """((where, glob, topics) of each line of patches/overlay-topics, findings)."""
    rules, findings = [], []
    for where, parts in _lines(patches_dir / OVERLAY_TOPICS):
        if len(parts) != 2:
            findings.append(f"{where}: expected '<glob> <topic>', got {' '.join(parts)!r}")
            continue
        names = parts[1].split(",")
        findings += [f"{where}: unknown topic {one!r} (one of {', '.join(TOPICS)})"
                     for one in names if one not in TOPICS]
        rules.append((where, parts[0], names))
    return rules, findings


def owners(rules, rel: str) -> list[str]:
    """The topics that ship an overlay file (its first matching rule's), in series order."""
    for _, glob, names in rules:
        if fnmatch.fnmatchcase(rel, glob):
            return [t for t in TOPICS if t in names]
    return []


def lint_overlay_topics(patches_dir: Path, files: list[str]) -> list[str]:
    rules, findings = read_rules(patches_dir)
    findings += [f"vllm_overlay/{rel}: no topic (add a line '<glob> <topic>' to patches/{OVERLAY_TOPICS})"
                 for rel in files if not owners(rules, rel)]
    findings += [f"{where}: {glob!r} matches no overlay file" for where, glob, _ in rules
                 if not any(fnmatch.fnmatchcase(rel, glob) for rel in files)]
    return findings


def overlay_files_of(patches_dir: Path, files: list[str], topic: str) -> list[str]:
    rules, _ = read_rules(patches_dir)
    return [rel for rel in files if topic in owners(rules, rel)]


def shared_files(patches_dir: Path, files: list[str]) -> dict[str, list[str]]:
    """Overlay files shipped by several topics -> those topics in series order.  The first
    adds the file (in a commit of its own); each later one is built on that commit."""
    rules, _ = read_rules(patches_dir)
    return {rel: owners(rules, rel) for rel in files if len(owners(rules, rel)) > 1}


@dataclass
class PrTest:
    where: str
    source: str   # in this repository
    dest: str     # in vLLM's tree
    topic: str


def read_pr_tests(patches_dir: Path) -> tuple[list[PrTest], list[str]]:
    """The lines of patches/pr-tests, and findings about malformed ones."""
    out, findings = [], []
    for where, parts in _lines(patches_dir / PR_TESTS):
        if len(parts) != 3:
            findings.append(f"{where}: expected '<test file> <path in vLLM> <topic>', got {' '.join(parts)!r}")
        elif parts[2] not in TOPICS:
            findings.append(f"{where}: unknown topic {parts[2]!r} (one of {', '.join(TOPICS)})")
        elif not parts[1].startswith("tests/") or not Path(parts[1]).name.startswith("test_"):
            findings.append(f"{where}: {parts[1]} is not a test file of vLLM's tests/ (tests/.../test_*.py)")
        else:
            out.append(PrTest(where, *parts))
    return out, findings


def lint_pr_tests(root: Path, patches_dir: Path, pristine: set[str]) -> list[str]:
    entries, findings = read_pr_tests(patches_dir)
    seen: set[str] = set()
    for t in entries:
        if not (root / t.source).is_file():
            findings.append(f"{t.where}: {t.source} does not exist")
        if t.dest in pristine:
            findings.append(f"{t.where}: {t.dest} is a file upstream has (a PR test must be new; "
                            "change upstream's tests with a patch)")
        if t.dest in seen:
            findings.append(f"{t.where}: {t.dest} is listed twice")
        seen.add(t.dest)
    return findings
