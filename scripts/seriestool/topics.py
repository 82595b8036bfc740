"""Topics: which upstream PR each patch and each overlay file belongs to.

A patch names its topic in its header (``Topic:``).  Overlay files have no
header, so ``patches/overlay-topics`` maps them, one rule a line::

    # comments and blank lines are ignored
    vllm/v1/attention/ops/triton_fetch_kv.py   fetch-kv
    vllm/v1/attention/ops/triton_mla_*.py      mla-fusion

The glob is relative to ``vllm_overlay/``: ``*`` and ``?`` stay inside one
path component, ``**`` spans any number of them.  Every overlay file must
match rules of exactly one topic (``make check`` reports the rest).  The file
is not a patch: ``make apply`` never reads it.
"""

from __future__ import annotations

import re
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


@dataclass
class Rule:
    lineno: int
    glob: str
    topic: str
    regex: re.Pattern


def glob_regex(glob: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def read_rules(patches_dir: Path) -> tuple[list[Rule], list[str]]:
    """The rules of patches/overlay-topics, and findings about malformed lines."""
    path = patches_dir / OVERLAY_TOPICS
    rules: list[Rule] = []
    findings: list[str] = []
    if not path.exists():
        return rules, findings
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"patches/{OVERLAY_TOPICS}:{lineno}"
        if len(parts) != 2:
            findings.append(f"{where}: expected '<glob> <topic>', got {raw.strip()!r}")
            continue
        glob, topic = parts
        # "a,b": a shared file that ships with each of those topics' PRs.
        for one in topic.split(","):
            if one not in TOPICS:
                findings.append(f"{where}: unknown topic {one!r} (one of {', '.join(TOPICS)})")
        rules.append(Rule(lineno, glob.removeprefix("vllm_overlay/"), topic, glob_regex(
            glob.removeprefix("vllm_overlay/"))))
    return rules, findings


def overlay_topic(rules: list[Rule], rel: str) -> tuple[str | None, str | None]:
    """(topic, problem) of one overlay file; exactly one of them is None."""
    topics = sorted({r.topic for r in rules if r.regex.match(rel)})
    if not topics:
        return None, f"vllm_overlay/{rel}: no topic (add a line '<glob> <topic>' to patches/{OVERLAY_TOPICS})"
    if len(topics) > 1:
        return None, f"vllm_overlay/{rel}: matches rules of several topics ({', '.join(topics)}) " \
                     f"in patches/{OVERLAY_TOPICS}"
    unknown = [t for t in topics[0].split(",") if t not in TOPICS]
    if unknown:
        return None, f"vllm_overlay/{rel}: unknown topic {unknown[0]!r} from patches/{OVERLAY_TOPICS}"
    return topics[0], None


def lint_overlay_topics(patches_dir: Path, files: list[str]) -> list[str]:
    rules, findings = read_rules(patches_dir)
    for rel in files:
        _, problem = overlay_topic(rules, rel)
        if problem:
            findings.append(problem)
    for rule in rules:
        if not any(rule.regex.match(rel) for rel in files):
            findings.append(f"patches/{OVERLAY_TOPICS}:{rule.lineno}: {rule.glob!r} matches no overlay file")
    return findings


def overlay_files_of(patches_dir: Path, files: list[str], topic: str) -> list[str]:
    rules, _ = read_rules(patches_dir)
    return [rel for rel in files if topic in (overlay_topic(rules, rel)[0] or "").split(",")]


# --- shared overlay files: which PR adds them ---------------------------------------------------

def owners(rules: list[Rule], rel: str) -> list[str]:
    """The topics that ship an overlay file, in series order (patchfile.TOPICS)."""
    topic, _ = overlay_topic(rules, rel)
    names = (topic or "").split(",")
    return [t for t in TOPICS if t in names]


def shared_files(patches_dir: Path, files: list[str]) -> dict[str, list[str]]:
    """Overlay files shipped by several topics -> those topics in series order.

    The first of them adds the file (in a commit of its own); each later one is
    built on that commit and says so ("Depends on").
    """
    rules, _ = read_rules(patches_dir)
    return {rel: owned for rel in files if len(owned := owners(rules, rel)) > 1}


# --- tests each PR carries --------------------------------------------------------------------------

@dataclass
class PrTest:
    lineno: int
    source: str   # in this repository
    dest: str     # in vLLM's tree
    topic: str


def read_pr_tests(patches_dir: Path) -> tuple[list[PrTest], list[str]]:
    """The lines of patches/pr-tests, and findings about malformed ones."""
    path = patches_dir / PR_TESTS
    out: list[PrTest] = []
    findings: list[str] = []
    if not path.exists():
        return out, findings
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"patches/{PR_TESTS}:{lineno}"
        if len(parts) != 3:
            findings.append(f"{where}: expected '<test file> <path in vLLM> <topic>', got {raw.strip()!r}")
            continue
        source, dest, topic = parts
        if topic not in TOPICS:
            findings.append(f"{where}: unknown topic {topic!r} (one of {', '.join(TOPICS)})")
            continue
        if not dest.startswith("tests/") or not Path(dest).name.startswith("test_"):
            findings.append(f"{where}: {dest} is not a test file of vLLM's tests/ (tests/.../test_*.py)")
            continue
        out.append(PrTest(lineno, source, dest, topic))
    return out, findings


def pr_tests_of(patches_dir: Path, topic: str) -> list[PrTest]:
    return [t for t in read_pr_tests(patches_dir)[0] if t.topic == topic]


def lint_pr_tests(root: Path, patches_dir: Path, pristine: set[str]) -> list[str]:
    entries, findings = read_pr_tests(patches_dir)
    seen: set[str] = set()
    for t in entries:
        where = f"patches/{PR_TESTS}:{t.lineno}"
        if not (root / t.source).is_file():
            findings.append(f"{where}: {t.source} does not exist")
        if t.dest in pristine:
            findings.append(f"{where}: {t.dest} is a file upstream has (a PR test must be new; "
                            "change upstream's tests with a patch)")
        if t.dest in seen:
            findings.append(f"{where}: {t.dest} is listed twice")
        seen.add(t.dest)
    return findings
