"""make check: lint the series without touching build/vllm.

Findings, each one line naming the file:
  * series entries that do not exist, duplicates, patch files not in series,
    names not of the form NNNN-slug.patch;
  * headers missing a field (patchfile.HEADER_FIELDS) or naming an unknown topic;
  * headers carrying a figure (figures.find_figures: ratios, %, times, rates,
    test counts) or naming a result file (benchmarks/results/...) that is not
    committed: figures live in result files and the text made from them;
    headers longer than MAX_HEADER_LINES (15) lines;
  * diffs with ``index`` lines (not refreshed);
  * overlay files that shadow a file upstream already has;
  * overlay files with no topic or an unknown one (patches/overlay-topics);
  * pins.env's target stack (torch, Triton) not what the pinned tree runs
    (stack.lint_target_stack);
  * patches/pr-tests lines naming a missing test, an unknown topic, or a path
    upstream already has;
  * a topic whose patches do not apply on pristine upstream without the
    other topics (each topic is exported as one upstream PR);
  * the whole series not applying to pristine upstream with zero fuzz and no
    whitespace errors (built in a scratch directory from the cached sdist);
  * relative links in the tracked Markdown (README.md, docs/, ...) to files or
    anchors that do not exist (doclinks.py);
  * upstream's pre-commit hooks, at the pinned tree's versions, failing on a
    Python file the series adds or changes (precommit.run_hooks, on that
    scratch tree).

Every check runs, whatever the others found.  One that cannot (the scratch tree
needs every listed patch file and an overlay that only adds, the hooks a series
that applies) is the finding "not run: ... because ...".
"""

from __future__ import annotations

import tarfile
import tempfile
from collections import Counter
from pathlib import Path

from . import (
    SeriesError, doclinks, export, figures, gitrepo, patchfile, precommit, progress, sdist, stack,
    topics,
)
from .buildtree import Layout, PatchFailed, build_tree, overlay_files, series_patches
from .pins import load_pins


def _pristine_files(sdist_file: Path) -> set[str]:
    with tarfile.open(sdist_file) as tar:
        return {m.name.split("/", 1)[1] for m in tar.getmembers()
                if m.isfile() and "/" in m.name}


def lint_series_files(layout: Layout) -> list[str]:
    findings = []
    names = patchfile.read_series(layout.patches)
    for name, count in Counter(names).items():
        if count > 1:
            findings.append(f"patches/series: {name} is listed {count} times")
    for name in dict.fromkeys(names):
        path = layout.patches / name
        if not patchfile.NAME_RE.match(name):
            findings.append(f"patches/series: {name}: name is not NNNN-slug.patch")
        if not path.is_file():
            findings.append(f"patches/series: {name} is listed but patches/{name} does not exist")
            continue
        try:
            patch = patchfile.parse(path)
        except SeriesError as exc:
            findings.append(str(exc))
            continue
        fields = patch.fields()
        if not patch.header or not patch.header[0].startswith("Subject:"):
            findings.append(f"patches/{name}: the header must start with 'Subject:'")
        for field in patchfile.HEADER_FIELDS:
            if not fields.get(field):
                findings.append(f"patches/{name}: header field '{field}:' is missing or empty")
        topic = fields.get("Topic")
        if topic and topic not in patchfile.TOPICS:
            findings.append(f"patches/{name}: unknown Topic {topic!r} "
                            f"(one of {', '.join(patchfile.TOPICS)})")
        if any(line.startswith("index ") for line in patch.diff.splitlines()):
            findings.append(f"patches/{name}: has 'index' lines (run make refresh)")
    listed = set(names)
    for path in sorted(layout.patches.glob("*.patch")) if layout.patches.is_dir() else []:
        if path.name not in listed:
            findings.append(f"patches/{path.name}: not listed in patches/series")
    return findings


MAX_HEADER_LINES = 15


def lint_header_claims(layout: Layout) -> list[str]:
    """Patch headers state stable facts, briefly: no figure, only committed result files,
    at most MAX_HEADER_LINES lines.

    A header's ``Tested on`` names tiers and the result files or test ids that
    back it; the numbers are in those files and rendered by ``make report`` /
    ``make pr``.  A result file must be committed (``git ls-files``; on disk
    when the series repository is not a git checkout).  A header longer than
    MAX_HEADER_LINES is an essay: the design notes belong in docs/ or the PR.
    """
    findings = []
    tracked = None
    if gitrepo.is_repo(layout.root):
        listed = gitrepo.git(layout.root, "ls-files", "--", "benchmarks/results", check=False)
        tracked = set(listed.stdout.splitlines()) if listed.returncode == 0 else None
    for name in dict.fromkeys(patchfile.read_series(layout.patches)):
        path = layout.patches / name
        if not path.is_file():
            continue  # lint_series_files reports it
        try:
            header = patchfile.parse(path).header
        except SeriesError:
            continue
        if len(header) > MAX_HEADER_LINES:
            findings.append(f"patches/{name}: header has {len(header)} lines, more than "
                            f"{MAX_HEADER_LINES}: keep Subject/Topic/Why/How/Upstream/Drop when/"
                            "Tested on to the stable facts")
        for lineno, line in enumerate(header, 1):
            for fig in figures.find_figures(line):
                findings.append(f"patches/{name}:{lineno}: header carries a figure ({fig.kind}) "
                                f"{fig.text!r}: name the result file or test instead")
            for ref in figures.RESULT_FILE_RE.findall(line):
                ref = ref.rstrip(".:")
                known = ref in tracked if tracked is not None else (layout.root / ref).is_file()
                if not known:
                    findings.append(f"patches/{name}:{lineno}: header names {ref}, which is not a "
                                    f"committed result file")
    return findings


def lint(layout: Layout) -> list[str]:
    findings = lint_series_files(layout) + lint_header_claims(layout) + doclinks.lint_links(layout.root)
    pins = load_pins(layout.root)
    sdist_file = sdist.fetch(pins, sdist.cache_dir())
    with progress.stage("check", f"listing {sdist_file.name}"):
        pristine = _pristine_files(sdist_file)
    for rel in overlay_files(layout):
        if rel in pristine:
            findings.append(f"vllm_overlay/{rel}: shadows a file upstream has (use a patch)")
    findings += topics.lint_overlay_topics(layout.patches, overlay_files(layout))
    findings += topics.lint_pr_tests(layout.root, layout.patches, pristine)
    with tempfile.TemporaryDirectory(prefix="series-check-") as tmp:
        scratch = Layout(root=layout.root, build=Path(tmp) / "vllm")
        not_applied = None
        try:
            build_tree(scratch, sdist_file, pins, record_state=False, verb="check")
        except PatchFailed as exc:
            not_applied = str(exc).splitlines()[0]
            findings.append(not_applied)
        except SeriesError as exc:  # a missing patch file, an overlay file shadowing upstream
            findings.append("not run: the zero-fuzz apply, topic-alone, target-stack and pre-commit hook "
                            f"checks, because {str(exc).splitlines()[0].rstrip(':')}")
            return findings
        findings += stack.lint_target_stack(pins, stack.tree_reader(scratch.build))
        patches = series_patches(layout)
        root = gitrepo.root_commit(scratch.build)
        for topic in patchfile.TOPICS:
            with progress.stage("check", f"topic {topic} alone on pristine upstream"):
                problem = export.topic_alone_problem(scratch.build, root, patches, topic)
            if problem:
                findings.append(problem)
        if not_applied:
            findings.append(f"not run: the pre-commit hooks, because {not_applied}")
            return findings
        hook_findings, notes = precommit.run_hooks(scratch.build, root)
        findings += hook_findings
        for note in notes:
            progress.say("check", note)
    return findings
