"""make pr TOPIC=...: one topic as an upstream pull request (docs/prs-wheels-image.md).

The branch ``pr/<topic>`` is built in a scratch worktree of build/vllm on the pristine root
(shared files' commits first, then the topic's overlay files, its tests, one signed-off commit
per patch), checked with ruff, then written to ``dist/<topic>/`` by
``git format-patch`` with PR_DESCRIPTION.md in vLLM's template sections.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import SeriesError, buildtree, gitrepo, lint, patchfile, progress, results, topics
from .pins import load_pins

# Exported commits get the series' fixed date: same inputs and identity, same commit ids.
EXPORT_DATE = gitrepo.SERIES_IDENTITY["GIT_AUTHOR_DATE"]
EXPORT_ENV = {"GIT_AUTHOR_DATE": EXPORT_DATE, "GIT_COMMITTER_DATE": EXPORT_DATE}
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
MAX_BODY_LINES = 60     # lines of the PR body outside <details> folds
MAX_CLAIMS = 6
_MAX_SHOWN = 60
_REF_RE = re.compile(r"vllm#(\d+)(?:\s*\(([^)]*)\))?")
_STATUS_RE = re.compile(r"\b(merged|open|closed|not merged|draft)\b", re.I)
# How the kernel tests run on a CPU in vLLM's tree: the Triton interpreter, and an empty
# device list (vLLM's triton_utils then takes the driver for one not up yet).
CPU_KERNEL_ENV = {"CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
CPU_KERNEL_PREFIX = " ".join(f"{k}={v}" for k, v in CPU_KERNEL_ENV.items())


def check_identity(repo: Path) -> None:
    """The exported commits carry a DCO sign-off by the identity git uses in build/vllm
    (environment, its config, global config): refuse before anything is built without one."""
    for role in ("AUTHOR", "COMMITTER"):
        proc = gitrepo.git(repo, "var", f"GIT_{role}_IDENT", check=False)
        if proc.returncode:
            raise SeriesError(f"git has no {role.lower()} identity in {repo} for the exported commits' "
                              f"'Signed-off-by:' line ({(proc.stderr.strip().splitlines() or ['?'])[-1]}).\n"
                              f"Set user.name and user.email (git config --global), or GIT_{role}_NAME / "
                              f"GIT_{role}_EMAIL.")


def pristine_root(layout: buildtree.Layout, pins: dict[str, str]) -> str:
    """The root commit of build/vllm, built by `make apply` if there is no tree yet."""
    if not gitrepo.is_repo(layout.build):
        buildtree.apply(layout)
    root = gitrepo.root_commit(layout.build)
    subject = gitrepo.out(layout.build, "log", "-1", "--format=%s", root)
    expected = buildtree.pristine_message(pins).splitlines()[0]
    if subject != expected:
        raise SeriesError(f"{layout.build} starts from {subject!r}, not {expected!r} (pins.env changed?): "
                          "run `make apply` first")
    return root


@contextmanager
def scratch_worktree(build: Path, name: str, commit: str):
    """A detached checkout of commit next to build/vllm; removed afterwards."""
    path = build.parent / f".{name}.worktree"
    shutil.rmtree(path, ignore_errors=True)   # left by an interrupted run
    gitrepo.git(build, "worktree", "prune")
    gitrepo.git(build, "worktree", "add", "--detach", str(path), commit)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gitrepo.git(build, "worktree", "prune", check=False)


def shown(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    more = f"\n  ... {len(lines) - _MAX_SHOWN} more lines" if len(lines) > _MAX_SHOWN else ""
    return "\n".join("  " + ln for ln in lines[:_MAX_SHOWN]) + more


def find_ruff(root: Path) -> str:
    """The running Python's ruff, else the venv's (`make venv`), else one on PATH."""
    where = [str(Path(sys.executable).parent), str(root / ".venv" / "bin"), os.environ.get("PATH", "")]
    found = shutil.which("ruff", path=os.pathsep.join(where))
    if not found:
        raise SeriesError("ruff not found: `make venv` installs it")
    return found


def upstream_ci_checks(tree: Path, files: list[str], ruff: str) -> str:
    """ruff format --check and ruff check with the pinned tree's config (its pyflakes rules
    report syntax and compile errors too); raise on a failure."""
    python = [f for f in files if f.endswith((".py", ".pyi")) and (tree / f).is_file()]
    checks = [([ruff, "format", "--check", "--no-cache", "--force-exclude", "--", *python], "ruff format --check"),
              ([ruff, "check", "--no-fix", "--no-cache", "--force-exclude", "--output-format", "concise",
                "--", *python], "ruff check")]
    for cmd, what in checks if python else []:
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        if proc.returncode:
            raise SeriesError(f"{what} failed (pinned tree's pyproject.toml):\n{shown(proc.stdout + proc.stderr)}")
    version = subprocess.run([ruff, "--version"], capture_output=True, text=True).stdout.strip()
    return f"checks: {version} format --check + check: {len(python)} file(s) OK"


# --- commit messages ---------------------------------------------------------------

def _fill(label: str, text: str) -> str:
    return textwrap.fill(f"{label}: {text}", width=72, break_long_words=False, break_on_hyphens=False)


def related(upstream: str) -> str | None:
    """The Upstream field without its leading "none (not yet submitted);"."""
    return re.sub(r"^none\b(\s*\([^)]*\))?\s*[;:,.]?\s*", "", upstream.strip(), flags=re.I) or None


def upstream_message(patch: patchfile.Patch) -> str:
    """Subject, Why, How and related PRs; the series-internal fields stay out."""
    fields = patch.fields()
    paragraphs = [_fill(k, fields[k]) for k in ("Why", "How") if fields.get(k)]
    if related(fields.get("Upstream", "")):
        paragraphs.append(_fill("Related", related(fields["Upstream"])))
    return patch.subject + "\n\n" + "\n\n".join(paragraphs) + "\n"


def _docstring_line(path: Path) -> str:
    """First line of a Python file's module docstring."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) if path.suffix == ".py" else "new file."
    except (SyntaxError, ValueError):
        doc = None
    return doc.strip().splitlines()[0] if doc else "new module."


def files_message(subject: str, text: str, files: list[str]) -> str:
    return f"{subject}\n\n{text}\n\n" + "\n".join(f"  {f}" for f in files) + "\n"


@dataclass
class ExportPlan:
    """What one topic's PR is made of, commit by commit, on pristine upstream."""
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
    return ExportPlan(
        shared=first.get(topic, []), own=[rel for rel in mine if rel not in shared],
        depends=[(u, first[u]) for u in patchfile.TOPICS
                 if u != topic and any(rel in mine for rel in first.get(u, []))],
        tests=[t for t in topics.read_pr_tests(layout.patches)[0] if t.topic == topic],
        shared_with={rel: [t for t in owned if t != topic] for rel, owned in shared.items() if rel in mine})


def shared_message(layout: buildtree.Layout, files: list[str]) -> str:
    """The commit adding files several PRs ship: the same in each (same id), so a later PR
    built on it shows it as the earlier PR's commit."""
    owned = topics.shared_files(layout.patches, files)[files[0]]
    text = "\n".join(_fill(Path(f).name, _docstring_line(layout.overlay / f)) for f in files)
    return files_message(f"Add {', '.join(Path(f).name for f in files)}, shared by PRs {' and '.join(owned)}",
                         text, files)


# --- the PR description ------------------------------------------------------------------

def lines_outside_folds(text: str) -> int:
    """Lines of a Markdown body outside <details> ... </details> (what a reviewer scrolls)."""
    count, depth = 0, 0
    for line in text.splitlines():
        opens, closes = line.count("<details"), line.count("</details>")
        if depth == 0 and not opens:
            count += 1
        depth = max(0, depth + opens - closes)
    return count


def related_refs(upstream_fields: list[str]) -> list[str]:
    """``vllm#N (status)`` for every upstream PR/issue the headers name, once each, in order."""
    out: dict[str, str] = {}
    for text in upstream_fields:
        for match in _REF_RE.finditer(text):
            status = _STATUS_RE.search(match.group(2) or text[match.end():match.end() + 40])
            out.setdefault(match.group(1), status.group(1).lower() if status else "")
    return [f"vllm#{n}" + (f" ({st})" if st else "") for n, st in out.items()]


def _fold(summary: str, body: str) -> list[str]:
    return ["<details>", f"<summary>{summary}</summary>", "", body.strip(), "", "</details>"]


def _code(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _where_tests_run(tests: list[str], kernel_tests: bool) -> list[str]:
    """pytest lines for vLLM's tree, each saying where it runs."""
    if not tests:
        return []
    joined = " ".join(tests)
    if kernel_tests:
        return [f"pytest -q {joined}   # GPU (CUDA or ROCm): compiled, real sizes",
                f"{CPU_KERNEL_PREFIX} pytest -q {joined}   # CPU: Triton interpreter, small shapes (GPU cases skip)"]
    return [f"VLLM_TARGET_DEVICE=cpu pytest -q {joined}   # CPU (no GPU needed); on a GPU machine without "
            "VLLM_TARGET_DEVICE"]


def _hardware(result: results.ResultFile) -> str:
    m = result.series
    runtime = f"ROCm/HIP {m['hip']}" if m.get("hip") else (f"CUDA {m['cuda']}" if m.get("cuda") else "no GPU runtime")
    return (f"{result.device}, {runtime}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}; "
            f"series commit {result.commit[:12] or 'unknown'}")


def _validation(layout: buildtree.Layout, topic: str, changed: list[str], plan: ExportPlan, heads: dict) -> str:
    kernels = topics.TOPIC_KERNELS.get(topic, ())
    py = [f for f in changed if f.endswith((".py", ".pyi"))]
    shipped = [t.dest for t in plan.tests]
    upstream_tests = [f for f in changed if f.startswith("tests/") and Path(f).name.startswith("test_")
                      and f not in shipped]
    out = ["From a vLLM checkout with this PR (upstream's pre-commit ruff and pyproject.toml):", "", "```sh"]
    if py:
        out += [f"FILES=\"{' '.join(py)}\"", "ruff format --check $FILES && ruff check $FILES"]
    out += _where_tests_run(shipped, True) + _where_tests_run(upstream_tests, False) + ["```", ""]
    for path in dict.fromkeys(h.result.path for h in heads.values()):
        kern = [k for k, h in heads.items() if h.result.path == path]
        out.append(f"Results: `{path}` ({_hardware(heads[kern[0]].result)}; {_code(kern)}).")
    if any(k not in heads for k in kernels):
        out.append(f"No committed clean results for {_code(k for k in kernels if k not in heads)}.")
    not_rocm = [k for k in kernels if not (k in heads and heads[k].result.rocm)]
    out += ["", "Not run on ROCm hardware: " + (f"benchmarks of {_code(not_rocm)}; " if not_rocm else "")
            + "the AITER code paths (tests marked `rocm`): the series repository holds no ROCm test results."]
    for kernel, h in heads.items():
        body = "\n\n".join(x for x in [f"Baseline: {h.baseline()}." if h.baseline() else "", h.table()] if x)
        out += [""] + _fold(f"Per-case results: <code>{kernel}</code> on {h.device}", body)
    return "\n".join(out)


def describe(layout: buildtree.Layout, topic: str, pins: dict[str, str], patches: list[patchfile.Patch],
             changed: list[str], template: str | None, series_commit: str, plan: ExportPlan) -> str:
    """The PR body in the pinned template's sections (Overview, Claims, Validation, Details):
    each thing said once, every figure rounded from committed results, tables and notes folded."""
    title = topics.TOPIC_TITLES.get(topic, topic)
    selection = results.select(layout.root)
    heads = {k: results.headline(layout.root, k, f)
             for k in topics.TOPIC_KERNELS.get(topic, ()) if (f := selection.latest(k))}
    fields = [p.fields() for p in patches]
    first_why = next((f["Why"].strip() for f in fields if f.get("Why")), "")
    sentence = re.match(r"(.+?[.!?])(?:\s|$)", first_why)
    problem = sentence.group(1) if sentence else first_why
    refs = related_refs([f.get("Upstream", "") for f in fields])
    overview = [f"**{title}** (vLLM {pins['VLLM_VERSION']}). {problem}".rstrip(),
                "Related: " + (", ".join(refs) if refs else "none") + "."]
    for other, shared in plan.depends:
        overview += ["", f"Depends on PR `{other}`: its first commit adds {_code(shared)}, which this PR uses too; "
                     f"this branch starts with that commit, unchanged (same id). `git am` "
                     f"`dist/{other}/0001-*.patch` first, or apply PR `{other}`."]
    if plan.shared:
        users = sorted({t for f in plan.shared for t in plan.shared_with.get(f, [])}, key=patchfile.TOPICS.index)
        overview += ["", f"The first commit adds {_code(plan.shared)}, shared with PR{'s' if len(users) > 1 else ''} "
                     f"{_code(users)}, which build{'' if len(users) > 1 else 's'} on that commit."]
    claims = [c for h in heads.values() for c in h.claims][:MAX_CLAIMS]
    claims += [f"{p.subject}." for p in patches][:MAX_CLAIMS - len(claims)]

    details = []
    if plan.shared or plan.own:
        details.append("New files (none replaces an upstream file):")
        details += [f"- `{f}`: {_docstring_line(layout.overlay / f)}" for f in plan.shared + plan.own]
    if plan.tests:
        details.append(f"Tests: {_code(t.dest for t in plan.tests)} (also run by the series' CPU tier).")
    notes = []
    for patch, f in zip(patches, fields, strict=True):
        why = f.get("Why", "").strip()
        why = why[len(problem):].strip() if why.startswith(problem) and why == first_why else why
        notes += [f"**{_code(patch.files())}**", ""]
        notes += [f"- {k}: {v}" for k, v in (("Why", why), ("How", f.get("How", ""))) if v]
        notes += [f"- Related: {related(f['Upstream'])}"] if related(f.get("Upstream", "")) else []
        notes.append("")
    if notes:
        details += [""] + _fold("Why and how, one patch commit after the other", "\n".join(notes))
    base = (f"after PR {_code(u for u, _ in plan.depends)}'s first commit" if plan.depends
            else "by itself, without the series' other topics")
    details += ["", f"Generated by `make pr TOPIC={topic}` from series commit {series_commit}; applies on "
                f"vLLM {pins['VLLM_VERSION']} (upstream {pins['VLLM_COMMIT']}) {base}."]
    sections = {"Overview": "\n".join(overview), "Claims": "\n".join(f"- {c}" for c in claims),
                "Validation": _validation(layout, topic, changed, plan, heads), "Details": "\n".join(details)}
    # vLLM's template sections, then the pinned template's footer from its '---' line on (its checklist).
    lines = (template or "").splitlines()
    parts = [f"# [ROCm] {title}", ""]
    for key, text in sections.items():
        parts += [f"## {key}", "", text.strip(), ""]
    return "\n".join(parts + (lines[lines.index("---"):] if "---" in lines else [])).rstrip() + "\n"


# --- the export -----------------------------------------------------------------------------

def export(layout: buildtree.Layout, topic: str, dist_root: Path) -> list[str]:
    if topic not in patchfile.TOPICS:
        raise SeriesError(f"unknown topic {topic!r}: make pr TOPIC=<{'|'.join(patchfile.TOPICS)}>")
    pins = load_pins(layout.root)
    build = layout.build
    check_identity(build if gitrepo.is_repo(build) else layout.root)
    ruff_cmd = find_ruff(layout.root)
    all_patches = buildtree.series_patches(layout)
    mine = [p for p in all_patches if p.topic == topic]
    files = buildtree.overlay_files(layout)
    untopiced = [f for f in topics.lint_overlay_topics(layout.patches, files) if f.startswith("vllm_overlay/")]
    if untopiced:
        raise SeriesError("overlay files without a valid topic (every file must go to one PR):\n"
                          + "\n".join("  " + u for u in untopiced))
    overlay = topics.overlay_files_of(layout.patches, files, topic)
    if not mine and not overlay:
        raise SeriesError(f"topic {topic} has no patches and no overlay files: nothing to export")
    plan = export_plan(layout, topic, files)
    missing = [t.source for t in plan.tests if not (layout.root / t.source).is_file()]
    if missing:
        raise SeriesError(f"patches/{topics.PR_TESTS} names tests that do not exist: {', '.join(missing)}")
    root = pristine_root(layout, pins)
    problem = lint.topic_alone_problem(build, root, all_patches, topic)
    if problem:
        raise SeriesError(problem + f"\nNothing was exported; {build} is untouched.")
    branch = f"pr/{topic}"
    progress.say("pr", f"building {branch} on pristine vLLM {pins['VLLM_VERSION']} in a scratch worktree ...")
    with scratch_worktree(build, f"pr-{topic}", root) as tree:
        def add(pairs: list[tuple[Path, str]], message: str) -> None:
            for source, rel in pairs:
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, tree / rel)
            gitrepo.git(tree, "add", "-f", "--", *[rel for _, rel in pairs])
            gitrepo.git(tree, "commit", "-q", "-s", "-F", "-", input_text=message, env=EXPORT_ENV)

        for _, shared in plan.depends:   # the commits of earlier PRs adding files this one ships too
            add([(layout.overlay / rel, rel) for rel in shared], shared_message(layout, shared))
        base = gitrepo.head(tree)
        if plan.shared:
            add([(layout.overlay / rel, rel) for rel in plan.shared], shared_message(layout, plan.shared))
        if plan.own:
            add([(layout.overlay / rel, rel) for rel in plan.own], files_message(
                f"Add the new files of {topic}", textwrap.fill(topics.TOPIC_TITLES[topic] + ".", 72), plan.own))
        if plan.tests:
            add([(layout.root / t.source, t.dest) for t in plan.tests], files_message(
                f"Add tests of {topic}", textwrap.fill(
                    "What the new code must do, checked against independent references (GPU: compiled, real "
                    "sizes; CPU: TRITON_INTERPRET=1, small shapes).", 72), [t.dest for t in plan.tests]))
        for patch in mine:
            buildtree.apply_patch(tree, patch)
            gitrepo.git(tree, "commit", "--amend", "-q", "--reset-author", "-s", "-F", "-",
                        input_text=upstream_message(patch), env=EXPORT_ENV)
        changed = gitrepo.out(tree, "diff", "--name-only", "--no-renames", "--diff-filter=d", base, "HEAD").split()
        try:
            with progress.stage("pr", f"ruff format --check, ruff check on {len(changed)} file(s)"):
                checked = upstream_ci_checks(tree, changed, ruff_cmd)
        except SeriesError as exc:
            raise SeriesError(f"{exc}\nThe export stopped: {branch} and dist/{topic}/ were not written.") from None
        template = gitrepo.git(tree, "show", f"{root}:{TEMPLATE}", check=False)
        moved = gitrepo.git(build, "branch", "-f", branch, gitrepo.head(tree), check=False)
        if moved.returncode:
            raise SeriesError(f"cannot update {branch} in {build}: {moved.stderr.strip()}\n"
                              f"(check out main there: git -C {build} checkout main)")
    out = dist_root / topic
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    written = gitrepo.git(build, "format-patch", "--signoff", "--no-signature", "-o", str(out),
                          f"{base}..{branch}", env=EXPORT_ENV).stdout.split()
    commit = gitrepo.git(layout.root, "rev-parse", "--short=12", "HEAD", check=False).stdout.strip() or "(none)"
    dirty = " + uncommitted changes" if gitrepo.series_inputs_dirty(layout.root) else ""
    text = describe(layout, topic, pins, mine, changed,
                    template.stdout if template.returncode == 0 else None, commit + dirty, plan)
    (out / "PR_DESCRIPTION.md").write_text(text)
    on = f"on PR {', '.join(u for u, _ in plan.depends)}'s shared commit(s) on " if plan.depends else "on "
    return [f"{branch} in {build}: {len(written)} commit(s) {on}vLLM {pins['VLLM_VERSION']} pristine "
            f"({len(overlay)} overlay file(s), {len(plan.tests)} test file(s), {len(mine)} patch(es)); main untouched",
            checked, *[f"wrote {out / Path(w).name}" for w in written], f"wrote {out / 'PR_DESCRIPTION.md'}"]
