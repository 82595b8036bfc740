"""make rebase: port the series to another vLLM release with git's three-way merges
(``git rebase --onto`` in build/rebase/vllm; docs/series-workflow.md).  A conflict stops it
with a report (the patch, each file, the patch's hunk and upstream's change there); the finish
rewrites patches/, vllm_overlay/, pins.env and README's table all or nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import Interrupted, SeriesError, buildtree, gitrepo, lint, patchfile, progress, readme, sdist
from .buildtree import Layout
from .pins import REQUIRED, load_pins, update_pins

CLEAN, MERGED, HAND = "clean", "merged", "resolved by hand"
EMPTY, HAND_DROPPED = "dropped: upstream has it", "dropped by hand"
OVERLAY = "overlay"
WRITTEN_PATHS = ("patches", "vllm_overlay", "pins.env", "README.md")   # what finish writes
WRITTEN = "patches/, vllm_overlay/, pins.env and README.md"
_MARKER_RE = re.compile(r"^(<{7}|>{7}|\|{7})(?: |$)", re.M)
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")
_SHOW_LINES = 14           # changed lines shown per hunk in a conflict report
_SHOW_HUNKS = 4            # patch hunks shown per conflicted file
_KINDS = {"UU": "both changed it", "AA": "both added it",
          "DU": "upstream deleted it (or moved it where git could not follow)",
          "UD": "the patch deletes it, upstream changed it", "AU": "added by upstream", "UA": "added by the patch",
          "DD": "both deleted it"}


@dataclass
class Paths:
    dir: Path                  # build/rebase
    repo: Path                 # build/rebase/vllm: where the rebase runs and conflicts are resolved
    state: Path                # build/rebase/state.json: written once the repository is ready

    @classmethod
    def of(cls, layout: Layout) -> Paths:
        d = layout.build.parent / "rebase"
        return cls(dir=d, repo=d / "vllm", state=d / "state.json")


def _load(paths: Paths) -> dict | None:
    return json.loads(paths.state.read_text()) if paths.state.is_file() else None


def _save(paths: Paths, state: dict) -> None:
    tmp = paths.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, paths.state)


def _drop(paths: Paths) -> None:
    """Remove build/rebase; state.json goes first, so a half-removed tree is no rebase."""
    paths.state.unlink(missing_ok=True)
    shutil.rmtree(paths.dir, ignore_errors=True)


def _git(paths: Paths, *args: str, check: bool = True, env: dict | None = None):
    return gitrepo.git(paths.repo, *args, check=check, env=env)


def _in_progress(paths: Paths) -> bool:
    return (paths.repo / ".git" / "rebase-merge").is_dir()


def sdist_facts(tree: Path) -> dict[str, str]:
    """VLLM_COMMIT from vllm/_version.py, AITER_REF from docker/Dockerfile.rocm_base (if present)."""
    facts = {"VLLM_COMMIT": "unknown"}
    for key, rel, pattern in (("VLLM_COMMIT", "vllm/_version.py", r"commit_id\s*=\s*['\"]([^'\"]+)['\"]"),
                              ("AITER_REF", "docker/Dockerfile.rocm_base", r"^ARG AITER_BRANCH=\"?([^\"\s]+)\"?")):
        found = re.search(pattern, (tree / rel).read_text(), re.M) if (tree / rel).is_file() else None
        if found:
            facts[key] = found.group(1)
    return facts


# --- the old and the rebased commits ------------------------------------------------

def _key(paths: Paths, commit: str) -> str:
    """Patch file name (its Series-Patch trailer) or "overlay"."""
    message = _git(paths, "log", "-1", "--format=%B", commit).stdout
    if message.startswith(buildtree.OVERLAY_SUBJECT):
        return OVERLAY
    _, name = patchfile.header_from_commit_message(message)
    return name or commit[:10]


def _commits(paths: Paths, base: str, tip: str) -> list[tuple[str, str]]:
    """(key, commit) of base..tip, oldest first."""
    revs = _git(paths, "rev-list", "--reverse", f"{base}..{tip}").stdout.split()
    return [(_key(paths, c), c) for c in revs]


def _diff(paths: Paths, commit: str) -> str:
    return patchfile.strip_index_lines(gitrepo.diff(paths.repo, f"{commit}^", commit, None))


def classify(paths: Paths, state: dict) -> list[dict]:
    """One row per commit of the old series: key, status, detail."""
    new = dict(_commits(paths, state["new_pristine"], "HEAD"))
    stops = {s["key"]: s for s in state["stops"]}
    rows = []
    for key, old_commit in _commits(paths, state["old_pristine"], state["old_tip"]):
        stop, new_commit = stops.get(key), new.get(key)
        if new_commit is None and stop:     # a conflict resolved to no change (skipped)
            row = (HAND_DROPPED, f"conflict in {', '.join(stop['files'])}; resolved to no change")
        elif new_commit is None:
            row = (EMPTY, f"became empty on vLLM {state['to']['VLLM_VERSION']}")
        elif stop:
            row = (HAND, f"conflict in {', '.join(stop['files'])}")
        elif _diff(paths, old_commit) == _diff(paths, new_commit):
            row = (CLEAN, "")
        else:
            row = (MERGED, "git's three-way merge moved or changed its hunks")
        rows.append({"key": key, "status": row[0], "detail": row[1]})
    return rows


def render_table(state: dict, rows: list[dict], check_line: str) -> str:
    frm, to = state["from"], state["to"]
    lines = [f"# Rebase of the series: vLLM {frm['VLLM_VERSION']} -> {to['VLLM_VERSION']}", "",
             f"`make rebase` at series commit {state['series_head'] or '(none)'}: from upstream "
             f"{frm['VLLM_COMMIT']} (sdist sha256 `{frm['VLLM_SDIST_SHA256']}`) to upstream {to['VLLM_COMMIT']} "
             f"(sdist sha256 `{to['VLLM_SDIST_SHA256']}`).", "",
             "| # | commit | result | detail |", "|---|---|---|---|"]
    patches = [row for row in rows if row["key"] != OVERLAY]
    for row in rows:
        number = patches.index(row) + 1 if row in patches else "–"
        lines.append(f"| {number} | `{row['key']}` | {row['status']} | {row['detail']} |")
    return "\n".join(lines + ["", f"`make check` on the result: {check_line}", ""])


# --- the conflict report ----------------------------------------------------------------

@dataclass
class Hunk:
    index: int                 # within its file, from 1
    old_start: int
    old_len: int
    lines: list[str]           # the body: " ", "-", "+" and "\\ No newline" lines


def _hunks(diff: str) -> list[Hunk]:
    """The hunks of a one-file unified diff, in order."""
    hunks: list[Hunk] = []
    for line in diff.splitlines():
        match = _HUNK_RE.match(line)
        if match:
            hunks.append(Hunk(len(hunks) + 1, int(match.group(1)), int(match.group(2) or 1), []))
        elif hunks:
            hunks[-1].lines.append(line)
    return hunks


def _overlaps(patch_hunk: Hunk, up: Hunk) -> bool:
    """Does an upstream change (a -U0 hunk, old-side lines) touch the patch hunk's lines (old side)?"""
    lo, hi = patch_hunk.old_start, patch_hunk.old_start + max(patch_hunk.old_len, 1)
    # A pure insertion (old_len 0) sits after line old_start; adjacent changes conflict too.
    ulo, uhi = up.old_start - 1, up.old_start + max(up.old_len, 1) + 1
    return ulo < hi and lo < uhi


def _marker_spans(path: Path) -> list[str]:
    """"a-b" for each <<<<<<< ... >>>>>>> block of the file as it stands in the rebase tree."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    spans, begin = [], None
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("<<<<<<< "):
            begin = i
        elif line.startswith(">>>>>>> ") and begin:
            spans.append(f"{begin}-{i}")
            begin = None
    return spans


def _changed(hunks: list[Hunk]) -> list[str]:
    """The - and + lines of hunks, without their positions (the report numbers lines one way only)."""
    body = [f"      {ln}" for h in hunks for ln in h.lines if ln[:1] in "-+"]
    more = [f"      ... {len(body) - _SHOW_LINES} more lines"] if len(body) > _SHOW_LINES else []
    return body[:_SHOW_LINES] + more


def _file_report(paths: Paths, picked: str, path: str, code: str, versions: str) -> list[str]:
    """What the patch and upstream changed in one conflicted file."""
    spans = _marker_spans(paths.repo / path)
    where = f"; conflict markers at lines {', '.join(spans)} of {paths.repo / path}" if spans else ""
    lines = [f"  {path}: {_KINDS.get(code, 'conflict')}{where}"]
    theirs = _hunks(gitrepo.diff(paths.repo, f"{picked}^", picked, [path]))
    if code == "DU":
        return lines + ["    the patch changes it:", *_changed(theirs),
                        "    to drop the patch's change to it (upstream's deletion stands): "
                        f"git -C {paths.repo} rm {path}",
                        "    to restore it (as the patch leaves it; git left that in the tree): leave it, "
                        "CONTINUE=1 stages it"]
    ups = _hunks(gitrepo.diff(paths.repo, f"{picked}^", "HEAD", [path], context=0))
    shown = 0
    for hunk in theirs:
        near = [u for u in ups if _overlaps(hunk, u)]
        if not near:
            continue
        shown += 1
        if shown > _SHOW_HUNKS:
            return lines + ["    ... more hunks conflict"]
        lines += [f"    patch hunk #{hunk.index} changes:", *_changed([hunk]),
                  f"    upstream ({versions}) changed there:", *_changed(near)]
    if not shown and code == "UU":
        lines.append("    (no upstream change overlaps a hunk of the patch: see the markers)")
    return lines


def conflict_report(paths: Paths, state: dict, picked: str, git_output: str) -> str:
    key = _key(paths, picked)
    patches = [k for k, _ in _commits(paths, state["old_pristine"], state["old_tip"]) if k != OVERLAY]
    frm, to = state["from"]["VLLM_VERSION"], state["to"]["VLLM_VERSION"]
    if key == OVERLAY:
        lines = [f"rebase: conflict in the overlay commit (vllm_overlay/, before the {len(patches)} patches; "
                 f"vLLM {frm} -> {to})"]
    else:
        header, _ = patchfile.header_from_commit_message(_git(paths, "log", "-1", "--format=%B", picked).stdout)
        drop_when = patchfile.header_fields(header).get("Drop when", "(no Drop when: line)")
        position = patches.index(key) + 1 if key in patches else "?"
        lines = [f"rebase: conflict in patches/{key} (patch {position} of {len(patches)}, "
                 f"vLLM {frm} -> {to})", f"  Drop when: {drop_when}"]
    codes = {ln[3:]: ln[:2] for ln in _git(paths, "status", "--porcelain", "--untracked-files=no").stdout.splitlines()}
    for path in _git(paths, "diff", "--name-only", "--diff-filter=U").stdout.split():
        lines += _file_report(paths, picked, path, codes.get(path, ""), f"{frm} -> {to}")
    touched = _git(paths, "diff-tree", "--no-commit-id", "--name-only", "-r", "--no-renames", picked).stdout.split()
    upstream_diff = paths.dir / f"{key}.upstream.diff"
    upstream_diff.write_text(_git(paths, "diff", "-M", state["old_pristine"], state["new_pristine"], "--",
                                  *touched).stdout if touched else "")
    lines += [f"  git: {ln.strip()}" for ln in git_output.splitlines() if ln.startswith("CONFLICT")][:10]
    lines += [
        f"  upstream diff {frm} -> {to} of the files this commit touches: {upstream_diff}",
        "",
        f"Resolve in {paths.repo}: edit the files (markers: <<<<<<< vLLM {to} + the patches before, "
        f"||||||| the old base, ======= then this patch's side >>>>>>>), then",
        "  make rebase CONTINUE=1   stages everything in that tree and goes on (a file that still has",
        "                           markers is refused; resolving to no change drops the patch)",
        "  make rebase ABORT=1      drops the rebase; patches/ and pins.env stay as they are",
    ]
    return "\n".join(lines)


# --- the steps ---------------------------------------------------------------------------

def _run_rebase(layout: Layout, paths: Paths, state: dict, args: list[str]) -> tuple[int, str]:
    env = {**gitrepo.SERIES_IDENTITY, "GIT_EDITOR": "true", "GIT_SEQUENCE_EDITOR": "true"}
    progress.say("rebase", f"git {' '.join(args[:2])}: three-way merges onto vLLM {state['to']['VLLM_VERSION']} ...")
    try:
        proc = _git(paths, *args, check=False, env=env)
    except KeyboardInterrupt:
        raise Interrupted(f"git rebase stopped in {paths.repo}; `make rebase CONTINUE=1` goes on, "
                          f"ABORT=1 drops it") from None
    output = proc.stdout + proc.stderr
    picked = _git(paths, "rev-parse", "REBASE_HEAD", check=False).stdout.strip() if _in_progress(paths) else ""
    if picked:
        key = _key(paths, picked)
        files = _git(paths, "diff", "--name-only", "--diff-filter=U").stdout.split()
        state["stops"] = [s for s in state["stops"] if s["key"] != key] + [{"key": key, "files": files}]
        _save(paths, state)
        return 1, conflict_report(paths, state, picked, output)
    if proc.returncode or _in_progress(paths):
        raise SeriesError(f"git {' '.join(args)} failed in {paths.repo}:\n{output.strip()}")
    return finish(layout, paths, state)


def start(layout: Layout, version: str, sha256: str) -> tuple[int, str]:
    paths = Paths.of(layout)
    state = _load(paths)
    if state:
        raise SeriesError(f"a rebase to vLLM {state['to']['VLLM_VERSION']} is in progress in {paths.repo}: "
                          f"resolve and `make rebase CONTINUE=1`, or `make rebase ABORT=1`")
    if not re.fullmatch(r"[0-9A-Za-z.+!-]+", version or ""):
        raise SeriesError("make rebase VLLM_VERSION=X VLLM_SDIST_SHA256=Y: VLLM_VERSION is missing or malformed")
    if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
        raise SeriesError("make rebase VLLM_VERSION=X VLLM_SDIST_SHA256=Y: VLLM_SDIST_SHA256 must be the "
                          "sdist's 64-hex-digit sha256 (PyPI's JSON API lists it: "
                          f"https://pypi.org/pypi/vllm/json, releases -> {version} -> sdist -> digests)")
    if gitrepo.series_inputs_dirty(layout.root):
        raise SeriesError("patches/, vllm_overlay/ or pins.env have uncommitted changes: commit or stash "
                          "them first (a finished rebase rewrites them)")
    old_pins = load_pins(layout.root)
    if (old_pins["VLLM_VERSION"], old_pins["VLLM_SDIST_SHA256"]) == (version, sha256):
        raise SeriesError(f"the series is already pinned to vLLM {version} with that sdist")
    if paths.dir.exists():
        progress.say("rebase", f"removing {paths.dir}, left by an interrupted start")
        _drop(paths)
    new_pins = {**old_pins, "VLLM_VERSION": version, "VLLM_SDIST_SHA256": sha256}
    old_sdist = sdist.fetch(old_pins, sdist.cache_dir())
    new_sdist = sdist.fetch(new_pins, sdist.cache_dir())
    series_head = gitrepo.git(layout.root, "rev-parse", "--short=12", "HEAD", check=False).stdout.strip()
    try:
        paths.dir.mkdir(parents=True)
        try:
            buildtree.build_tree(Layout(root=layout.root, build=paths.repo), old_sdist, old_pins, verb="rebase")
        except buildtree.PatchFailed as exc:
            raise SeriesError(f"the series does not apply to its own pin (vLLM {old_pins['VLLM_VERSION']}); "
                              f"fix that first (`make check`):\n{exc}") from None
        _git(paths, "config", "merge.conflictStyle", "diff3")
        old_pristine = gitrepo.root_commit(paths.repo)
        new_pristine = _import_pristine(paths, new_sdist, new_pins)
        state = {"root": str(layout.root), "series_head": series_head, "inputs": buildtree.inputs_hash(layout),
                 "from": {k: old_pins[k] for k in REQUIRED}, "to": {k: new_pins[k] for k in REQUIRED},
                 "old_pristine": old_pristine, "old_tip": gitrepo.head(paths.repo), "new_pristine": new_pristine,
                 "stops": []}
        _save(paths, state)     # from here on the rebase exists: CONTINUE=1 / ABORT=1
    except KeyboardInterrupt:
        raise Interrupted(f"nothing changed; {paths.dir} is removed by the next `make rebase`") from None
    except BaseException:
        _drop(paths)
        raise
    return _run_rebase(layout, paths, state, ["rebase", "--onto", new_pristine, old_pristine, "main"])


def _import_pristine(paths: Paths, sdist_file: Path, pins: dict[str, str]) -> str:
    """The other sdist as a root commit of its own (pins get its VLLM_COMMIT and AITER_REF)."""
    _git(paths, "checkout", "-q", "--orphan", f"vllm-{pins['VLLM_VERSION']}")
    _git(paths, "rm", "-rfq", ".")
    progress.say("rebase", f"unpacking {sdist_file.name} ...")
    sdist.unpack(sdist_file, paths.repo)
    pins.update(sdist_facts(paths.repo))
    progress.say("rebase", f"committing pristine vLLM {pins['VLLM_VERSION']} ...")
    commit = gitrepo.commit_all(paths.repo, buildtree.pristine_message(pins))
    _git(paths, "checkout", "-q", "main")
    return commit


def resume(layout: Layout) -> tuple[int, str]:
    paths = Paths.of(layout)
    state = _load(paths)
    if not state:
        raise SeriesError("no rebase in progress: start one with "
                          "`make rebase VLLM_VERSION=X VLLM_SDIST_SHA256=Y`")
    _restore(layout, paths)     # a finish killed while it wrote
    if buildtree.inputs_hash(layout) != state["inputs"]:
        raise SeriesError("patches/, vllm_overlay/ or pins.env changed since the rebase started; finishing "
                          "would overwrite them. Restore them, or `make rebase ABORT=1` and start again.")
    if not _in_progress(paths):
        return finish(layout, paths, state)
    changed = _git(paths, "diff", "--name-only", "HEAD").stdout.split()
    unmerged = _git(paths, "diff", "--name-only", "--diff-filter=U").stdout.split()
    left = []
    for rel in dict.fromkeys(unmerged + changed):
        path = paths.repo / rel
        if path.is_file():
            text = path.read_text(errors="replace")
            left += [f"  {rel}:{text.count(chr(10), 0, m.start()) + 1}" for m in _MARKER_RE.finditer(text)][:3]
    if left:
        raise SeriesError("conflict markers are still there; resolve them, then `make rebase CONTINUE=1`:\n"
                          + "\n".join(left))
    _git(paths, "add", "-A")
    if _git(paths, "diff", "--cached", "--quiet", "HEAD", check=False).returncode == 0:
        return _run_rebase(layout, paths, state, ["rebase", "--skip"])   # resolved to no change: dropped
    return _run_rebase(layout, paths, state, ["rebase", "--continue"])


def abort(layout: Layout) -> str:
    paths = Paths.of(layout)
    state = _load(paths)
    if not paths.dir.exists():
        return "rebase: none in progress; nothing to drop"
    restored = _restore(layout, paths)
    _drop(paths)
    target = f" to vLLM {state['to']['VLLM_VERSION']}" if state else ""
    what = ("restored to what they were before an interrupted finish wrote them" if restored
            else "hold nothing of it")
    return f"rebase{target} dropped: {paths.dir} removed; {WRITTEN} {what}"


def _snapshot(layout: Layout, paths: Paths, state: dict) -> None:
    """What finish writes, kept as a git tree object of the series repository (state["backup"])."""
    with gitrepo.temp_index() as env:
        present = [name for name in WRITTEN_PATHS if (layout.root / name).exists()]
        gitrepo.git(layout.root, "add", "-A", "-f", "--", *present, env=env)
        state["backup"] = gitrepo.git(layout.root, "write-tree", env=env).stdout.strip()
    _save(paths, state)


def _restore(layout: Layout, paths: Paths) -> bool:
    """Put back what a finish had begun to write (its snapshot); False if there is none."""
    state = _load(paths) or {}
    if not state.get("backup"):
        return False
    for name in WRITTEN_PATHS:
        if (layout.root / name).is_dir():
            shutil.rmtree(layout.root / name)
        (layout.root / name).unlink(missing_ok=True)
    with gitrepo.temp_index() as env:
        gitrepo.git(layout.root, "read-tree", state["backup"], env=env)
        gitrepo.git(layout.root, "checkout-index", "-a", "-f", env=env)
    del state["backup"]
    _save(paths, state)
    return True


def finish(layout: Layout, paths: Paths, state: dict) -> tuple[int, str]:
    """Write the port (patches/, vllm_overlay/, pins.env, README.md) and check it: all of it, or nothing."""
    rows = classify(paths, state)
    regenerate = {r["key"] for r in rows if r["status"] in (MERGED, HAND)}
    to = state["to"]
    _snapshot(layout, paths, state)
    try:
        progress.say("rebase", "rewriting patches/ and vllm_overlay/ from the rebased commits ...")
        report = buildtree.refresh(Layout(root=layout.root, build=paths.repo), regenerate=regenerate)
        changed_pins = update_pins(layout.root, {k: v for k, v in to.items() if v and v != "unknown"})
        if (layout.root / "README.md").is_file() and readme.update(layout.root):
            report.append("README.md: series table rewritten")
        findings = lint.lint(layout)
    except BaseException as exc:
        _restore(layout, paths)
        kept = f"{WRITTEN} restored as they were; {paths.dir} kept"
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(f"{kept}: `make rebase CONTINUE=1` finishes again, ABORT=1 drops it") from None
        if isinstance(exc, SeriesError):
            raise SeriesError(f"finishing the rebase failed; {kept}:\n{exc}\nFix that, then "
                              "`make rebase CONTINUE=1` (or ABORT=1)") from None
        raise
    check_line = lint.summary(layout, findings)
    if findings:
        check_line += ": " + "; ".join(findings)
    table = render_table(state, rows, check_line)
    table_file = layout.build.parent / f"rebase-{to['VLLM_VERSION']}.md"
    table_file.write_text(table)
    _drop(paths)
    out = [table, *report,
           f"pins.env: {', '.join(changed_pins) or 'unchanged'}",
           f"wrote {table_file}; {paths.dir} removed. build/vllm is still the old tree: "
           "`make apply` rebuilds it on the new pin."]
    if findings:
        out.append(f"The port is written ({WRITTEN}); `make check` found {len(findings)} finding(s), "
                   "listed in the table above: fix them, and `make check` again, before committing the port.")
    return (1 if findings else 0), "\n".join(out)
