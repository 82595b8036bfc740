"""make pr TOPIC=...: one topic of the series as an upstream pull request.

In the build tree (build/vllm) a branch ``pr/<topic>`` is made from the
pristine root commit: one commit with the topic's overlay files, then one
commit per patch of the topic (applied by the same code as ``make apply``),
authored and signed off (DCO) by the configured git identity.  The branch is
built in a scratch ``git worktree`` next to the build tree, so build/vllm's
checked-out ``main``, its index and any uncommitted work are never touched.

Before anything is written, the checks upstream CI runs that work here run on
the changed files, inside the scratch checkout so that the pinned tree's own
pyproject.toml configures ruff: ``ruff format --check``, ``ruff check`` and
``python -m py_compile``.  Then ``dist/<topic>/`` gets ``git format-patch
--signoff`` output and PR_DESCRIPTION.md, which follows the pinned tree's
.github/PULL_REQUEST_TEMPLATE.md (Overview, Claims, Validation, Details) and is
filled from the patch headers and the committed, clean benchmark results of the
topic's kernels (seriestool/results.py, headlines.py): an overview of two lines,
at most six claims with rounded figures and hardware, the commands, and the
per-case tables and per-patch notes folded in ``<details>`` (at most
MAX_BODY_LINES lines outside the folds).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import (
    SeriesError,
    benchmeta,
    buildtree,
    gitrepo,
    headlines,
    patchfile,
    progress,
    results,
    topics,
)
from .pins import load_pins

# Exported commits get the series' fixed date, so the same inputs and the same
# identity give the same commit ids and byte-identical patch files.
EXPORT_DATE = gitrepo.SERIES_IDENTITY["GIT_AUTHOR_DATE"]
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
RESULTS_DIR = "benchmarks/results"
_MAX_SHOWN = 60

# Used when the pinned tree has no PR template: the classic vLLM sections.
FALLBACK_TEMPLATE = """## Purpose

## Test Plan

## Test Result

---

<details>
<summary> Essential checklist </summary>

- [ ] The purpose of the PR, with links to the issues and PRs it relates to.
- [ ] The test plan: the exact commands.
- [ ] The test results: before/after numbers and the hardware they come from.
- [ ] Documentation updated where user-facing behaviour changed.
</details>
"""


# --- identity, tree, branch --------------------------------------------------

_IDENT_RE = re.compile(r"^(?P<name>.*) <(?P<email>[^<>]*)> \d+ [+-]\d{4}$")


def _ask_git_var(repo: Path | None, var: str) -> subprocess.CompletedProcess:
    """``git var VAR`` in repo, or outside any repository when repo is None."""
    if repo is not None:
        return gitrepo.git(repo, "var", var, check=False)
    with tempfile.TemporaryDirectory(prefix="series-ident-") as tmp:
        # Outside every repository: only the environment and the global/system config count.
        env = {"GIT_CEILING_DIRECTORIES": str(Path(tmp).parent)}
        return gitrepo.git(Path(tmp), "var", var, check=False, env=env)


def git_identity(build: Path) -> dict[str, str]:
    """The author and committer git itself would use for a commit in build/vllm, fixed date.

    ``git var GIT_AUTHOR_IDENT`` / ``GIT_COMMITTER_IDENT`` resolve it the way
    ``git commit`` does: GIT_AUTHOR_* / GIT_COMMITTER_* from the environment,
    then the tree's own config, then the global and system config.  Before
    build/vllm exists, the same question is asked outside any repository.
    """
    repo = build if gitrepo.is_repo(build) else None
    ident: dict[str, str] = {}
    for role in ("AUTHOR", "COMMITTER"):
        proc = _ask_git_var(repo, f"GIT_{role}_IDENT")
        match = _IDENT_RE.match(proc.stdout.strip()) if proc.returncode == 0 else None
        if not match or not match["name"].strip() or not match["email"].strip():
            why = next((ln.removeprefix("fatal: ") for ln in proc.stderr.splitlines()
                        if ln.startswith("fatal:")), proc.stderr.strip() or proc.stdout.strip())
            raise SeriesError(
                f"git has no {role.lower()} identity for a commit in {build} ({why}): the exported "
                f"commits carry a DCO 'Signed-off-by:' line (vLLM requires it) from that identity.\n"
                f"Set it the way git looks for it: GIT_{role}_NAME / GIT_{role}_EMAIL in the environment, "
                f"`git -C {build} config user.email ...`, or\n"
                f"  git config --global user.name 'Your Name'\n"
                f"  git config --global user.email you@example.com")
        ident[f"GIT_{role}_NAME"] = match["name"].strip()
        ident[f"GIT_{role}_EMAIL"] = match["email"].strip()
        ident[f"GIT_{role}_DATE"] = EXPORT_DATE
    return ident


def pristine_root(layout: buildtree.Layout, pins: dict[str, str]) -> str:
    """The root commit of build/vllm, built by `make apply` if there is no tree yet."""
    build = layout.build
    if not gitrepo.is_repo(build):
        if build.exists():
            raise SeriesError(f"{build} exists but is not a tree made by `make apply` (no .git)")
        buildtree.apply(layout)
    root = gitrepo.root_commit(build)
    subject = gitrepo.out(build, "log", "-1", "--format=%s", root)
    expected = f"vLLM {pins['VLLM_VERSION']} pristine (upstream {pins['VLLM_COMMIT']})"
    if subject != expected:
        raise SeriesError(f"{build} starts from {subject!r}, not {expected!r} (pins.env changed?): "
                          f"run `make apply` first")
    return root


def _remove_worktree(build: Path, path: Path) -> None:
    if path.exists():
        gitrepo.git(build, "worktree", "remove", "--force", str(path), check=False)
    if path.exists():  # not registered (an interrupted run): our own scratch directory
        shutil.rmtree(path)
    gitrepo.git(build, "worktree", "prune", check=False)


@contextmanager
def scratch_worktree(build: Path, name: str, commit: str):
    """A detached checkout of commit next to build/vllm; removed afterwards."""
    path = build.parent / f".{name}.worktree"
    _remove_worktree(build, path)
    gitrepo.git(build, "worktree", "add", "--detach", str(path), commit)
    try:
        yield path
    finally:
        _remove_worktree(build, path)


# --- topics applying alone -------------------------------------------------------

def _dependency_hint(patch: patchfile.Patch, earlier: list[patchfile.Patch], topic: str) -> str:
    files = set(patch.files())
    others = [p for p in earlier if p.topic != topic and files & set(p.files())]
    if not others:
        return ""
    listed = ", ".join(f"patches/{p.name} (topic {p.topic or '?'})" for p in others)
    return (f"\n  It may depend on a hunk of {listed}, which changes the same file earlier in the series.\n"
            f"  Remake it against pristine upstream (each topic must apply alone), or move it to that topic.")


def topic_alone_problem(repo: Path, base: str, all_patches: list[patchfile.Patch],
                        topic: str) -> str | None:
    """Do the topic's patches apply, in series order, on base without the other topics?

    Works on a temporary index, so it touches neither the checkout nor HEAD.
    """
    mine = [p for p in all_patches if p.topic == topic]
    if not mine:
        return None
    with tempfile.TemporaryDirectory(prefix="series-topic-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        gitrepo.git(repo, "read-tree", base, env=env)
        for patch in mine:
            proc = gitrepo.git(repo, "apply", "--cached", "--whitespace=error-all", "-p1",
                               str(patch.path), check=False, env=env)
            if proc.returncode:
                earlier = all_patches[:all_patches.index(patch)]
                return (f"topic {topic}: patches/{patch.name} does not apply on pristine upstream "
                        f"without the other topics: {buildtree._hunk_failure(patch, proc.stderr)}"
                        + _dependency_hint(patch, earlier, topic))
    return None


# --- upstream CI checks -------------------------------------------------------------

def find_ruff(root: Path, explicit: str | None) -> list[str]:
    if explicit:  # resolved now: the checks run inside the scratch checkout
        found = str(Path(explicit).absolute()) if os.sep in explicit else shutil.which(explicit)
        if not found or not Path(found).is_file():
            raise SeriesError(f"ruff not found at {explicit!r}")
        return [found]
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    for candidate in (shutil.which("ruff"), root / ".venv" / "bin" / "ruff"):
        if candidate and Path(candidate).exists():
            return [str(candidate)]
    raise SeriesError("ruff not found: `make venv` installs it (ci/requirements-test.txt), "
                      "or pass RUFF=/path/to/ruff")


def _shown(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    more = f"\n  ... {len(lines) - _MAX_SHOWN} more lines" if len(lines) > _MAX_SHOWN else ""
    return "\n".join("  " + ln for ln in lines[:_MAX_SHOWN]) + more


def upstream_pre_commit_ruff(tree: Path) -> str | None:
    """The ruff version upstream's .pre-commit-config.yaml pins, if it says."""
    config = tree / ".pre-commit-config.yaml"
    if not config.exists():
        return None
    match = re.search(r"ruff-pre-commit\s*\n\s*rev:\s*(\S+)", config.read_text())
    return match.group(1) if match else None


def upstream_ci_checks(tree: Path, files: list[str], ruff: list[str],
                       origins: dict[str, str] | None = None) -> list[str]:
    """ruff format --check, ruff check (tree's config), py_compile; report lines or raise.

    ``origins``: files copied into the PR as they are (its tests): tree path -> the file here.
    """
    origins = origins or {}
    python = [f for f in files if f.endswith((".py", ".pyi")) and (tree / f).is_file()]
    if not python:
        return ["checks: no Python files changed"]

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)

    version = run([*ruff, "--version"])
    if version.returncode:
        raise SeriesError(f"{' '.join(ruff)} --version failed: {_shown(version.stderr or version.stdout)}")
    fmt = run([*ruff, "format", "--check", "--no-cache", "--force-exclude", "--", *python])
    if fmt.returncode:
        output = fmt.stdout + fmt.stderr
        named = [f for f in python if f in output]
        tree_files = [f for f in named if f not in origins]
        hints = []
        if tree_files:
            hints.append(f"(cd build/vllm && {' '.join(ruff)} format {' '.join(tree_files)}), commit there "
                         "and `make refresh`")
        if any(f in origins for f in named):
            hints.append(f"{' '.join(ruff)} format --config build/vllm/pyproject.toml "
                         + " ".join(origins[f] for f in named if f in origins))
        raise SeriesError(
            f"ruff format --check failed (pinned tree's pyproject.toml): {', '.join(named) or 'see below'}\n"
            + _shown(output) + "\nTo fix: format them with the pinned tree's configuration and this ruff, "
            "e.g. " + (" and ".join(hints) or f"{' '.join(ruff)} format") + ".")
    lint = run([*ruff, "check", "--no-fix", "--no-cache", "--force-exclude",
                "--output-format", "concise", "--", *python])
    if lint.returncode:
        raise SeriesError("ruff check failed (pinned tree's pyproject.toml):\n"
                          + _shown(lint.stdout + lint.stderr))
    for rel in python:
        proc = run([sys.executable, "-m", "py_compile", rel])
        if proc.returncode:
            raise SeriesError(f"{rel}: python -m py_compile failed:\n" + _shown(proc.stderr + proc.stdout))
    name = (version.stdout.strip().splitlines() or [" ".join(ruff)])[0]
    report = [f"checks: {name} format --check + check, py_compile: {len(python)} file(s) OK"]
    pinned = upstream_pre_commit_ruff(tree)
    if pinned and pinned.lstrip("v") not in name:
        report.append(f"note: upstream's .pre-commit-config.yaml pins ruff {pinned}; checked with {name}")
    return report


# --- commit messages ---------------------------------------------------------------

def _fill(label: str, text: str) -> str:
    return textwrap.fill(f"{label}: {text}", width=72, break_long_words=False, break_on_hyphens=False)


def related(upstream: str) -> str | None:
    """The Upstream field without its leading "none (not yet submitted);"."""
    text = re.sub(r"^none\b(\s*\([^)]*\))?\s*[;:,.]?\s*", "", upstream.strip(), flags=re.I)
    return text or None


def upstream_message(patch: patchfile.Patch) -> str:
    """Subject, Why, How and related PRs; the series-internal fields stay out."""
    fields = patch.fields()
    paragraphs = [_fill(k, fields[k]) for k in ("Why", "How") if fields.get(k)]
    if related(fields.get("Upstream", "")):
        paragraphs.append(_fill("Related", related(fields["Upstream"])))
    return patch.subject + "\n\n" + "\n\n".join(paragraphs) + "\n"


def overlay_message(topic: str, files: list[str]) -> str:
    return (f"Add the new files of {topic}\n\n"
            + textwrap.fill(topics.TOPIC_TITLES.get(topic, topic) + ".", width=72) + "\n\n"
            + "\n".join(f"  {f}" for f in files) + "\n")


def shared_message(layout: buildtree.Layout, owners: list[str], files: list[str]) -> str:
    """The commit that adds files several PRs ship: the same in each (same ids), so a later PR
    built on it shows it as the earlier PR's commit."""
    names = ", ".join(Path(f).name for f in files)
    lines = [f"Add {names}, shared by PRs {' and '.join(owners)}", ""]
    lines += [_fill(Path(f).name, _docstring_line(layout.overlay / f)) for f in files]
    return "\n".join(lines) + "\n\n" + "\n".join(f"  {f}" for f in files) + "\n"


def tests_message(topic: str, tests: list[topics.PrTest]) -> str:
    return (f"Add tests of {topic}\n\n"
            + textwrap.fill("What the new code must do, checked against independent references "
                            "(GPU: compiled, real sizes; CPU: TRITON_INTERPRET=1, small shapes).",
                            width=72) + "\n\n"
            + "\n".join(f"  {t.dest}" for t in tests) + "\n")


@dataclass
class ExportPlan:
    """What one topic's PR is made of, commit by commit, on pristine upstream."""
    topic: str
    depends: list[tuple[str, list[str]]]   # (earlier topic, the shared files its commit adds)
    shared: list[str]                      # shared files this topic adds first (own commit)
    own: list[str]                         # overlay files of this topic alone
    tests: list[topics.PrTest]
    shared_with: dict[str, list[str]]      # shared file -> the other topics shipping it


def export_plan(layout: buildtree.Layout, topic: str, files: list[str]) -> ExportPlan:
    shared = topics.shared_files(layout.patches, files)
    mine = topics.overlay_files_of(layout.patches, files, topic)
    first: dict[str, list[str]] = {}
    for rel, owned in shared.items():
        first.setdefault(owned[0], []).append(rel)
    depends = [(u, first[u]) for u in patchfile.TOPICS if u != topic and u in first
               and any(rel in mine for rel in first[u])]
    return ExportPlan(
        topic=topic, depends=depends, shared=first.get(topic, []),
        own=[rel for rel in mine if rel not in shared],
        tests=topics.pr_tests_of(layout.patches, topic),
        shared_with={rel: [t for t in owned if t != topic] for rel, owned in shared.items()
                     if rel in mine})


# --- results and the PR description ------------------------------------------------------

# The PR body keeps at most this many lines outside <details> folds.
MAX_BODY_LINES = 64
MAX_CLAIMS = 6
_REF_RE = re.compile(r"vllm#(\d+)(?:\s*\(([^)]*)\))?")
_STATUS_RE = re.compile(r"\b(merged|open|closed|not merged|draft)\b", re.I)


def _hardware(result: results.ResultFile) -> str:
    m = result.series
    runtime = f"ROCm/HIP {m['hip']}" if m.get("hip") else (f"CUDA {m['cuda']}" if m.get("cuda")
                                                           else "no GPU runtime")
    return (f"{result.device}, {runtime}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}; "
            f"series commit {result.commit[:12] or 'unknown'}")


def test_files_of(root: Path, topic: str, overlay: list[str], patches: list[patchfile.Patch]) -> list[str]:
    """Tests of the series repo for the topic: named after it or its kernels, importing one of
    its new modules, or named in its patch headers."""
    names = set(topics.TOPIC_KERNELS.get(topic, ())) | {topic.replace("-", "_")}
    stems = {Path(f).stem for f in overlay if f.endswith(".py") and not Path(f).stem.startswith("__")}
    imports = re.compile(r"^\s*(?:from|import)\s+[\w.]*\b(?:" + "|".join(map(re.escape, sorted(stems)))
                         + r")\b", re.M) if stems else None
    headers = " ".join(" ".join(p.header) for p in patches)
    found = []
    tests = root / "tests"
    for path in sorted(tests.rglob("test_*.py")) if tests.is_dir() else []:
        rel = path.relative_to(root).as_posix()
        if rel.startswith("tests/series/"):
            continue
        if (any(n in rel for n in names) or rel in headers
                or (imports and imports.search(path.read_text(errors="replace")))):
            found.append(rel)
    return found


def _docstring_line(path: Path) -> str:
    """First sentence-line of a Python file's module docstring."""
    if path.suffix != ".py":
        return "new file."
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (SyntaxError, ValueError):
        doc = None
    return doc.strip().splitlines()[0] if doc else "new module."


def _benchmarked(root: Path, kernels: tuple[str, ...]) -> list[str]:
    sources = "".join(p.read_text(errors="replace") for p in sorted((root / "benchmarks").glob("bench_*.py")))
    return [k for k in kernels if f'kernel="{k}"' in sources or f"kernel='{k}'" in sources]


def related_refs(upstream_fields: list[str]) -> list[str]:
    """``vllm#N (status)`` for every upstream PR/issue the headers name, once each, in order."""
    out: dict[str, str] = {}
    for text in upstream_fields:
        for match in _REF_RE.finditer(text):
            status = _STATUS_RE.search(match.group(2) or text[match.end():match.end() + 40])
            out.setdefault(match.group(1), status.group(1).lower() if status else "")
    return [f"vllm#{n}" + (f" ({st})" if st else "") for n, st in out.items()]


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?[.!?])(?:\s|$)", text.strip())
    return (match.group(1) if match else text.strip()).rstrip()


def _sections(template: str) -> tuple[str, list[tuple[str, str]], str]:
    """(preamble, [(heading line, body)], footer from the first '---' line on)."""
    lines = template.splitlines()
    footer_at = next((i for i, ln in enumerate(lines) if ln.strip() == "---"), len(lines))
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for line in lines[:footer_at]:
        if line.startswith("## "):
            sections.append((line, []))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return ("\n".join(preamble), [(h, "\n".join(b)) for h, b in sections],
            "\n".join(lines[footer_at:]))


def render_description(template: str, title: str, content: dict[str, str]) -> str:
    """Fill the template's sections; the overview, claims, validation and details always appear.

    Content keys: ``overview``, ``claims``, ``plan`` (commands), ``result`` (results, folded
    tables) and ``details``.  The pinned template's Validation takes plan and result; the classic
    template's Purpose takes overview and claims.
    """
    slots = {"overview": ("overview",), "purpose": ("overview", "claims"), "summary": ("overview",),
             "claims": ("claims",), "validation": ("plan", "result"), "test plan": ("plan",),
             "test result": ("result",), "test results": ("result",), "details": ("details",)}
    preamble, sections, footer = _sections(template)
    used: set[str] = set()
    parts = [f"# {title}", ""]
    if preamble.strip():
        parts += [preamble.strip(), ""]
    for heading, body in sections:
        keys = [k for k in slots.get(heading[3:].strip().lower(), ()) if k not in used]
        parts += [heading, ""]
        if not keys:
            kept = re.sub(r"<!--.*?-->", "", body, flags=re.S).strip()
            parts += [kept, ""] if kept else []
            continue
        for key in keys:
            if content.get(key, "").strip():
                parts += [content[key].strip(), ""]
            used.add(key)
    for key, heading in (("overview", "## Overview"), ("claims", "## Claims"), ("plan", "## Validation"),
                         ("result", None), ("details", "## Details")):
        if key not in used and content.get(key, "").strip():
            parts += ([heading, ""] if heading else []) + [content[key].strip(), ""]
    if footer.strip():
        parts.append(footer.strip())
    return "\n".join(parts).rstrip() + "\n"


def lines_outside_folds(text: str) -> int:
    """Lines of a Markdown body outside <details> ... </details> (what a reviewer scrolls)."""
    count, depth = 0, 0
    for line in text.splitlines():
        opens, closes = line.count("<details"), line.count("</details>")
        if depth == 0 and not opens:
            count += 1
        depth = max(0, depth + opens - closes)
    return count


def _fold(summary: str, body: str) -> list[str]:
    return ["<details>", f"<summary>{summary}</summary>", "", body.strip(), "", "</details>"]


# How the kernel tests run on a CPU in vLLM's tree: the Triton interpreter, and an
# empty device list, which vLLM's triton_utils takes for a driver that is not up
# yet (without it vLLM swaps Triton for placeholders where no GPU driver is active).
CPU_KERNEL_ENV = {"CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
CPU_KERNEL_PREFIX = " ".join(f"{k}={v}" for k, v in CPU_KERNEL_ENV.items())


def _where_tests_run(tests: list[str], upstream_kernel_tests: bool) -> list[str]:
    """pytest lines for vLLM's tree, each saying where it runs."""
    if not tests:
        return []
    joined = " ".join(tests)
    if upstream_kernel_tests:
        return [f"pytest -q {joined}   # GPU (CUDA or ROCm): compiled, real sizes",
                f"{CPU_KERNEL_PREFIX} pytest -q {joined}"
                "   # CPU: Triton interpreter, small shapes (GPU cases skip)"]
    return [f"VLLM_TARGET_DEVICE=cpu pytest -q {joined}   # CPU (no GPU needed); on a GPU machine "
            "without VLLM_TARGET_DEVICE"]


def describe(layout: buildtree.Layout, topic: str, pins: dict[str, str], patches: list[patchfile.Patch],
             overlay: list[str], changed: list[str], template: str | None, series_commit: str,
             plan: ExportPlan | None = None) -> str:
    """The PR body in the pinned template's sections (Overview, Claims, Validation, Details):
    short, each thing said once, with every figure rounded from committed results
    (seriestool/headlines.py) and the per-case tables and per-patch notes folded."""
    root = layout.root
    plan = plan or ExportPlan(topic, [], [], list(overlay), [], {})
    kernels = topics.TOPIC_KERNELS.get(topic, ())
    title = f"[ROCm] {topics.TOPIC_TITLES.get(topic, topic)}"
    fields = [p.fields() for p in patches]
    selection = results.select(root)
    heads = {k: headlines.headline(root, k, f) for k in kernels if (f := selection.latest(k))}

    problem_at = next((i for i, f in enumerate(fields) if f.get("Why")), None)
    problem = _first_sentence(fields[problem_at]["Why"]) if problem_at is not None else ""
    refs = related_refs([f.get("Upstream", "") for f in fields])
    overview = [f"**{topics.TOPIC_TITLES.get(topic, topic)}** (vLLM {pins['VLLM_VERSION']})."
                + (f" {problem}" if problem else ""),
                "Related: " + (", ".join(refs) if refs else "none") + "."]
    stacking = []
    for other, shared in plan.depends:
        stacking.append(f"Depends on PR `{other}`: its first commit adds "
                        f"{', '.join(f'`{f}`' for f in shared)}, which this PR uses too. This branch "
                        f"starts with that commit, unchanged (the same commit id); the patches of this "
                        f"PR come after it: `git am` `dist/{other}/0001-*.patch` first, or apply PR "
                        f"`{other}`.")
    if plan.shared:
        users = sorted({t for f in plan.shared for t in plan.shared_with.get(f, [])},
                       key=patchfile.TOPICS.index)
        stacking.append(f"The first commit adds {', '.join(f'`{f}`' for f in plan.shared)}, shared "
                        f"with PR{'s' if len(users) > 1 else ''} {', '.join(f'`{u}`' for u in users)}, "
                        f"which build{'' if len(users) > 1 else 's'} on that commit.")

    claims = [c for k in kernels if k in heads for c in heads[k].claims][:MAX_CLAIMS]
    for patch in patches:
        if len(claims) >= MAX_CLAIMS:
            break
        claims.append(f"{patch.subject}.")

    py = [f for f in changed if f.endswith((".py", ".pyi"))]
    shipped = [t.dest for t in plan.tests]
    upstream_tests = [f for f in changed if f.startswith("tests/") and Path(f).name.startswith("test_")
                      and f not in shipped]
    plan_lines = ["From a vLLM checkout with this PR (upstream's pre-commit ruff and pyproject.toml):",
                  "", "```sh"]
    if py:
        plan_lines += [f"FILES=\"{' '.join(py)}\"", "ruff format --check $FILES && ruff check $FILES"]
    plan_lines += _where_tests_run(shipped, upstream_kernel_tests=True)
    plan_lines += _where_tests_run(upstream_tests, upstream_kernel_tests=False)
    series_tests = [f for f in test_files_of(root, topic, overlay, patches)
                    if f not in {t.source for t in plan.tests}]
    plan_lines += ["```", "", f"In the series repository (vLLM {pins['VLLM_VERSION']} + the AITER series; "
                   f"`make pr TOPIC={topic}` runs the lint above):", "", "```sh"]
    if series_tests:
        plan_lines += [f"make test TESTS=\"{' '.join(series_tests)}\"   # CPU: builds build/vllm and .venv"]
    else:
        plan_lines += ["make test   # CPU: the whole tier"]
    benched = _benchmarked(root, kernels)
    on_host = [k for k in benched if k in heads and not (heads[k].result.series.get("cuda")
                                                           or heads[k].result.rocm)]
    if on_host:
        plan_lines += [f"make bench-host   # CPU: host cost into build/results/ ({', '.join(on_host)})"]
    if [k for k in benched if k not in on_host]:
        plan_lines += [f"make bench   # GPU: benchmarks/results/<date>-<device>-<commit>.json "
                       f"({', '.join(k for k in benched if k not in on_host)})"]
    plan_lines += ["```"]

    result: list[str] = []
    files = list(dict.fromkeys(h.result.path for h in heads.values()))
    for path in files:
        kern = [k for k, h in heads.items() if h.result.path == path]
        result.append(f"Results: `{path}` ({_hardware(heads[kern[0]].result)}; "
                      f"{', '.join(f'`{k}`' for k in kern)}).")
    missing = [k for k in kernels if k not in heads]
    if missing:
        result.append(f"No committed clean results for {', '.join(f'`{k}`' for k in missing)}.")
    rocm = {k for k, h in heads.items() if h.result.rocm}
    not_rocm = [f"benchmarks of {', '.join(f'`{k}`' for k in kernels if k not in rocm)}"] \
        if any(k not in rocm for k in kernels) else []
    not_rocm.append("the AITER code paths (tests marked `rocm`): the series repository holds no ROCm "
                    "test results")
    result += ["", "Not run on ROCm hardware: " + "; ".join(not_rocm) + "."]
    for kernel, h in heads.items():
        cases = h.result.cases(kernel)
        host = benchmeta.host_cases(h.result.data, kernel) if not cases else []
        baseline = ("the unpatched functions, host code timed by pytest-benchmark" if host
                    else benchmeta.baseline_of(root, kernel, cases))
        body = "\n\n".join(x for x in [h.sentence, f"Baseline: {baseline}." if baseline else "",
                                       benchmeta.host_table(host) if host
                                       else benchmeta.case_table(cases, h.compare)] if x)
        result += [""] + _fold(f"Per-case results: <code>{kernel}</code> on {h.device}", body)

    details = []
    new_files = [*plan.shared, *plan.own]
    if new_files:
        details.append("New files (none replaces an upstream file):")
        details += [f"- `{f}`: {_docstring_line(layout.overlay / f)}" for f in new_files]
    if shipped:
        details.append(f"Tests: {', '.join(f'`{t}`' for t in shipped)} (also run by the series' CPU tier).")
    notes = []
    for i, (patch, f) in enumerate(zip(patches, fields, strict=True)):
        why = f.get("Why", "")
        if i == problem_at:   # its first sentence is the Overview's
            why = why.strip()[len(problem):].strip()
        notes += [f"**{', '.join(f'`{x}`' for x in patch.files())}**", ""]
        notes += [f"- {k}: {v}" for k, v in (("Why", why), ("How", f.get("How", ""))) if v]
        if related(f.get("Upstream", "")):
            notes.append(f"- Related: {related(f['Upstream'])}")
        notes.append("")
    if notes:
        details += [""] + _fold("Why and how, one patch commit after the other", "\n".join(notes))
    base = (f"after PR {', '.join(f'`{u}`' for u, _ in plan.depends)}'s first commit"
            if plan.depends else "by itself, without the series' other topics")
    details += ["", f"Generated by `make pr TOPIC={topic}` from series commit {series_commit}; applies on "
                f"vLLM {pins['VLLM_VERSION']} (upstream {pins['VLLM_COMMIT']}) {base}."]

    content = {"overview": "\n".join(overview) + ("\n\n" + "\n\n".join(stacking) if stacking else ""),
               "claims": "\n".join(f"- {c}" for c in claims),
               "plan": "\n".join(plan_lines), "result": "\n".join(result), "details": "\n".join(details)}
    return render_description(template or FALLBACK_TEMPLATE, title, content)


# --- the export -----------------------------------------------------------------------------

def export(layout: buildtree.Layout, topic: str, dist_root: Path, ruff: str | None = None) -> list[str]:
    if topic not in patchfile.TOPICS:
        raise SeriesError(f"unknown topic {topic!r}: make pr TOPIC=<{'|'.join(patchfile.TOPICS)}>")
    pins = load_pins(layout.root)
    build = layout.build
    ident = git_identity(build)
    ruff_cmd = find_ruff(layout.root, ruff)
    all_patches = buildtree.series_patches(layout)
    mine = [p for p in all_patches if p.topic == topic]
    files = buildtree.overlay_files(layout)
    rules, _ = topics.read_rules(layout.patches)
    untopiced = [problem for rel in files for problem in [topics.overlay_topic(rules, rel)[1]] if problem]
    if untopiced:
        raise SeriesError("overlay files without a valid topic (every file must go to one PR):\n"
                          + "\n".join("  " + u for u in untopiced))
    overlay = topics.overlay_files_of(layout.patches, files, topic)
    if not mine and not overlay:
        raise SeriesError(f"topic {topic} has no patches and no overlay files: nothing to export")
    root = pristine_root(layout, pins)
    with progress.stage("pr", f"topic {topic} alone on pristine upstream"):
        problem = topic_alone_problem(build, root, all_patches, topic)
    if problem:
        raise SeriesError(problem + f"\nNothing was exported; {build} is untouched.")

    branch = f"pr/{topic}"
    report: list[str] = []
    plan = export_plan(layout, topic, files)
    missing = [t.source for t in plan.tests if not (layout.root / t.source).is_file()]
    if missing:
        raise SeriesError(f"patches/{topics.PR_TESTS} names tests that do not exist: {', '.join(missing)}")
    progress.say("pr", f"checking out pristine vLLM {pins['VLLM_VERSION']} in a scratch worktree ...")
    with scratch_worktree(build, f"pr-{topic}", root) as tree:
        def add(pairs: list[tuple[Path, str]], message: str) -> None:
            for source, rel in pairs:
                dest = tree / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest)
            gitrepo.git(tree, "add", "-f", "--", *[rel for _, rel in pairs])
            gitrepo.git(tree, "commit", "-q", "-s", "-F", "-", input_text=message, env=ident)

        # Built on the commits of earlier PRs that add files this one ships too.
        for other, shared in plan.depends:
            add([(layout.overlay / rel, rel) for rel in shared],
                shared_message(layout, topics.owners(rules, shared[0]), shared))
        base = gitrepo.head(tree)
        if plan.shared:
            add([(layout.overlay / rel, rel) for rel in plan.shared],
                shared_message(layout, topics.owners(rules, plan.shared[0]), plan.shared))
        if plan.own:
            add([(layout.overlay / rel, rel) for rel in plan.own], overlay_message(topic, plan.own))
        if plan.tests:
            add([(layout.root / t.source, t.dest) for t in plan.tests], tests_message(topic, plan.tests))
        for i, patch in enumerate(mine, 1):
            progress.say("pr", f"patch {i}/{len(mine)} {patch.name}")
            try:
                buildtree.apply_patch(tree, patch)
            except SeriesError as exc:
                raise SeriesError(f"{exc}\nNothing was exported; {build} is untouched.") from None
            gitrepo.git(tree, "commit", "--amend", "-q", "--reset-author", "-s", "-F", "-",
                        input_text=upstream_message(patch), env=ident)
        changed = gitrepo.out(tree, "diff", "--name-only", "--no-renames", "--diff-filter=d",
                              base, "HEAD").splitlines()
        try:
            with progress.stage("pr", f"ruff format --check, ruff check, py_compile on {len(changed)} file(s)"):
                report += upstream_ci_checks(tree, changed, ruff_cmd, {t.dest: t.source for t in plan.tests})
        except SeriesError as exc:
            raise SeriesError(f"{exc}\nThe export stopped: {branch} and dist/{topic}/ "
                              "were not written.") from None
        template = gitrepo.git(tree, "show", f"{root}:{TEMPLATE}", check=False)
        head = gitrepo.head(tree)
        moved = gitrepo.git(build, "branch", "-f", branch, head, check=False)
        if moved.returncode:
            raise SeriesError(f"cannot update {branch} in {build}: {moved.stderr.strip()}\n"
                              f"(check out main there: git -C {build} checkout main)")

    out = dist_root / topic
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    written = gitrepo.git(build, "format-patch", "--signoff", "--no-signature", "-o", str(out),
                          f"{base}..{branch}", env=ident).stdout.splitlines()
    commit = gitrepo.git(layout.root, "rev-parse", "--short=12", "HEAD", check=False).stdout.strip()
    dirty = gitrepo.series_inputs_dirty(layout.root)
    series_commit = (commit or "(none)") + (" + uncommitted changes" if dirty else "")
    text = describe(layout, topic, pins, mine, overlay, changed,
                    template.stdout if template.returncode == 0 else None, series_commit, plan)
    (out / "PR_DESCRIPTION.md").write_text(text)
    count = len(written)
    on = (f"on PR {', '.join(u for u, _ in plan.depends)}'s shared commit(s) on "
          if plan.depends else "on ")
    report.insert(0, f"{branch} in {build}: {count} commit(s) {on}vLLM {pins['VLLM_VERSION']} pristine "
                     f"({len(overlay)} overlay file(s), {len(plan.tests)} test file(s), {len(mine)} "
                     f"patch(es)); main untouched")
    report += [f"wrote {out / Path(w).name}" for w in written]
    report.append(f"wrote {out / 'PR_DESCRIPTION.md'}")
    return report
