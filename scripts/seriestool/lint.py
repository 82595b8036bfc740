"""make check: lint the series without touching build/vllm.

Every check runs, whatever the others found; each finding is one line naming the file.  A
check that cannot run is the finding "not run: ... because ...".
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

from . import SeriesError, figures, gitrepo, patchfile, precommit, progress, sdist, topics
from .buildtree import Layout, PatchFailed, apply_error, build_tree, overlay_files, series_patches
from .pins import load_pins

MAX_HEADER_LINES = 15
_LINK_RE = re.compile(r"\]\(<?([^()\s<>#]+)[^()]*\)")


def lint_series_files(layout: Layout) -> list[str]:
    """The series entries and each patch's header: fields, topic, length, figures, result files named."""
    names = patchfile.read_series(layout.patches)
    findings = [f"patches/series: {name} is listed {n} times" for name, n in Counter(names).items() if n > 1]
    tracked = set(gitrepo.out(layout.root, "ls-files", "--", "benchmarks/results").splitlines())
    for name in dict.fromkeys(names):
        if not patchfile.NAME_RE.match(name):
            findings.append(f"patches/series: {name}: name is not NNNN-slug.patch")
        if not (layout.patches / name).is_file():
            findings.append(f"patches/series: {name} is listed but patches/{name} does not exist")
            continue
        try:
            patch = patchfile.parse(layout.patches / name)
        except SeriesError as exc:
            findings.append(str(exc))
            continue
        if not patch.header or not patch.header[0].startswith("Subject:"):
            findings.append(f"patches/{name}: the header must start with 'Subject:'")
        findings += [f"patches/{name}: {problem}" for problem in patchfile.header_problems(patch.header)]
        if len(patch.header) > MAX_HEADER_LINES:
            findings.append(f"patches/{name}: header has {len(patch.header)} lines, more than {MAX_HEADER_LINES}: "
                            "keep Subject/Topic/Why/How/Upstream/Drop when/Tested on to the stable facts")
        # Headers state stable facts: the numbers are in result files (make report / make pr render them).
        for lineno, line in enumerate(patch.header, 1):
            findings += [f"patches/{name}:{lineno}: header carries a figure ({fig.kind}) {fig.text!r}: "
                         "name the result file or test instead" for fig in figures.find_figures(line)]
            findings += [f"patches/{name}:{lineno}: header names {ref}, which is not a committed result file"
                         for ref in (r.rstrip(".:") for r in figures.RESULT_FILE_RE.findall(line))
                         if ref not in tracked]
        if re.search(r"^index ", patch.diff, re.M):
            findings.append(f"patches/{name}: has 'index' lines (run make refresh)")
    for path in sorted(layout.patches.glob("*.patch")):
        if path.name not in names:
            findings.append(f"patches/{path.name}: not listed in patches/series")
    return findings


def lint_doc_links(root: Path) -> list[str]:
    """A relative link ``[text](path)`` in a tracked Markdown file must name an existing file
    (code is skipped; URLs and #anchors are not checked)."""
    findings = []
    for rel in gitrepo.out(root, "ls-files", "--", "*.md").splitlines():
        fenced = False
        for lineno, line in enumerate((root / rel).read_text(errors="replace").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            for target in [] if fenced else _LINK_RE.findall(re.sub(r"`[^`]*`", "", line)):
                if ":" not in target and not ((root / rel).parent / target).exists():
                    findings.append(f"{rel}:{lineno}: link {target!r} names no file")
    return findings


def topic_alone_problem(repo: Path, base: str, all_patches: list[patchfile.Patch], topic: str) -> str | None:
    """Do the topic's patches apply, in series order, on base without the other topics?"""
    with gitrepo.temp_index() as env:
        gitrepo.git(repo, "read-tree", base, env=env)
        for i, patch in enumerate(all_patches):
            if patch.topic != topic:
                continue
            proc = gitrepo.git(repo, "apply", "--cached", "--whitespace=error-all", "-p1", str(patch.path),
                               check=False, env=env)
            if proc.returncode:
                earlier = [f"patches/{p.name} (topic {p.topic or '?'})" for p in all_patches[:i]
                           if p.topic != topic and set(p.files()) & set(patch.files())]
                hint = (f"\n  It may depend on a hunk of {', '.join(earlier)}, which changes the same file "
                        "earlier in the series.\n  Remake it against pristine upstream (each topic must apply "
                        "alone), or move it to that topic.") if earlier else ""
                return (f"topic {topic}: patches/{patch.name} does not apply on pristine upstream without the "
                        f"other topics: {apply_error(proc.stderr)}{hint}")
    return None


def summary(layout: Layout, findings: list[str]) -> str:
    if findings:
        return f"{len(findings)} finding(s)"
    return f"series OK ({len(series_patches(layout))} patches, {len(overlay_files(layout))} overlay files)"


def lint(layout: Layout) -> list[str]:
    findings = lint_series_files(layout) + lint_doc_links(layout.root)
    pins = load_pins(layout.root)
    sdist_file = sdist.fetch(pins, sdist.cache_dir())
    with tarfile.open(sdist_file) as tar:
        pristine = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    findings += [f"vllm_overlay/{rel}: shadows a file upstream has (use a patch)"
                 for rel in overlay_files(layout) if rel in pristine]
    findings += topics.lint_overlay_topics(layout.patches, overlay_files(layout))
    findings += topics.lint_pr_tests(layout.root, layout.patches, pristine)
    with tempfile.TemporaryDirectory(prefix="series-check-") as tmp:
        scratch = Path(tmp) / "vllm"
        not_applied = None
        try:
            build_tree(Layout(root=layout.root, build=scratch), sdist_file, pins, verb="check")
        except PatchFailed as exc:
            not_applied = str(exc)
            findings.append(not_applied)
        except SeriesError as exc:  # a missing patch file, an overlay file shadowing upstream
            findings.append("not run: the zero-fuzz apply, topic-alone and pre-commit hook checks, "
                            f"because {str(exc).splitlines()[0].rstrip(':')}")
            return findings
        root = gitrepo.root_commit(scratch)
        for topic in patchfile.TOPICS:
            progress.say("check", f"topic {topic} alone on pristine upstream ...")
            problem = topic_alone_problem(scratch, root, series_patches(layout), topic)
            findings += [problem] if problem else []
        if not_applied:
            findings.append(f"not run: the pre-commit hooks, because {not_applied}")
            return findings
        hook_findings, notes = precommit.run_hooks(scratch, root)
        findings += hook_findings
        for note in notes:
            progress.say("check", note)
    return findings
