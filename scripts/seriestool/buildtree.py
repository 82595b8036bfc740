"""Build the patched tree (make apply) and save edits back (make refresh).

build/vllm's history is the series: pristine vLLM, the overlay commit, one commit per patch.
``.git/series-state.json`` records what the last apply/refresh produced, so apply tells "up
to date", "rebuild" and "someone has work here" apart.  Apply builds in ``build/.vllm.new``
and renames it into place when complete: an interrupt leaves the previous tree or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import Interrupted, SeriesError, gitrepo, patchfile, progress, sdist
from .pins import load_pins

STATE_FILE = "series-state.json"
OVERLAY_SUBJECT = "Series overlay: new files at their upstream paths"


@dataclass
class Layout:
    root: Path                     # the series repository
    build: Path                    # build/vllm

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def overlay(self) -> Path:
        return self.root / "vllm_overlay"


def overlay_files(layout: Layout) -> list[str]:
    if not layout.overlay.is_dir():
        return []
    return sorted(p.relative_to(layout.overlay).as_posix() for p in layout.overlay.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def series_patches(layout: Layout) -> list[patchfile.Patch]:
    patches = []
    for name in patchfile.read_series(layout.patches):
        if not (layout.patches / name).is_file():
            raise SeriesError(f"patches/series lists {name}, but patches/{name} does not exist")
        patches.append(patchfile.parse(layout.patches / name))
    return patches


def inputs_hash(layout: Layout) -> str:
    """Everything the build tree is made from, in one digest."""
    digest = hashlib.sha256((layout.root / "pins.env").read_bytes())
    for rel in overlay_files(layout):
        digest.update(b"overlay\0" + rel.encode() + b"\0" + (layout.overlay / rel).read_bytes())
    for name in patchfile.read_series(layout.patches):
        path = layout.patches / name
        digest.update(b"patch\0" + name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"-"))
    return digest.hexdigest()


def read_state(build: Path) -> dict:
    path = build / ".git" / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(build: Path, inputs: str | None) -> None:
    state = {"head": gitrepo.head(build), "inputs": inputs}
    (build / ".git" / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")


def guard_existing(build: Path) -> None:
    """Refuse when build/vllm holds work the series does not have."""
    keep = (f"To keep this work: commit it in {build} and run `make refresh` (it becomes patches).\n"
            f"To discard it: `make apply FORCE=1`.")
    if not gitrepo.is_repo(build):
        raise SeriesError(f"{build} exists but is not a tree made by `make apply` (no .git).\n"
                          f"Move it away, or `make apply FORCE=1` to replace it.")
    changes = gitrepo.dirty(build)
    if changes:
        raise SeriesError(f"{build} has uncommitted changes:\n" + "\n".join("  " + c for c in changes[:10])
                          + ("\n  ..." if len(changes) > 10 else "") + f"\n{keep}")
    base = read_state(build).get("head")
    if base != gitrepo.head(build):
        known = base and gitrepo.git(build, "cat-file", "-e", f"{base}^{{commit}}", check=False).returncode == 0
        extra = gitrepo.out(build, "log", "--oneline", f"{base}..HEAD") if known else ""
        listing = "\n".join("  " + ln for ln in extra.splitlines()[:10]) or "  (history rewritten)"
        raise SeriesError(f"{build} has commits that are not in the series:\n{listing}\n{keep}")


class PatchFailed(SeriesError):
    """A patch of the series does not apply (one line); the tree is the series up to the patch before."""


def apply_error(stderr: str) -> str:
    """git apply's complaint in one line (which file, at which line)."""
    errors = [ln.removeprefix("error: ") for ln in stderr.splitlines() if ln.startswith("error: ")]
    return "; ".join(errors) or stderr.strip() or "git apply failed"


def apply_patch(build: Path, patch: patchfile.Patch) -> str:
    """Apply one patch with zero fuzz and no whitespace errors (all of it or nothing), then commit it."""
    proc = gitrepo.git(build, "apply", "--index", "--whitespace=error-all", "-p1", str(patch.path), check=False)
    if proc.returncode:
        raise PatchFailed(f"patches/{patch.name} does not apply: {apply_error(proc.stderr)}")
    return gitrepo.commit_all(build, patch.commit_message(), paths=[])


def pristine_message(pins: dict[str, str]) -> str:
    return (f"vLLM {pins['VLLM_VERSION']} pristine (upstream {pins['VLLM_COMMIT']})\n\n"
            f"From the PyPI sdist, sha256 {pins['VLLM_SDIST_SHA256']}.\n")


def build_tree(layout: Layout, sdist_file: Path, pins: dict[str, str], verb: str = "apply") -> None:
    """Create layout.build from scratch; PatchFailed stops it at the first patch that does not apply.

    A git repository from its first moment (``git init`` before the sdist is unpacked
    into it), so no git command run there falls through to an enclosing repository."""
    build = layout.build
    build.mkdir(parents=True)
    gitrepo.git(build, "init", "-q", "-b", "main")
    progress.say(verb, f"unpacking {sdist_file.name} ...")
    sdist.unpack(sdist_file, build)
    progress.say(verb, f"committing pristine vLLM {pins['VLLM_VERSION']} ...")
    gitrepo.commit_all(build, pristine_message(pins))
    files = overlay_files(layout)
    shadowing = sorted(set(files) & gitrepo.files_at(build, "HEAD"))
    if shadowing:
        raise SeriesError("vllm_overlay/ must only add files; these already exist upstream "
                          "(edit them with a patch instead):\n"
                          + "\n".join(f"  vllm_overlay/{f}" for f in shadowing))
    if files:
        progress.say(verb, f"overlay: {len(files)} new files ...")
        for rel in files:
            (build / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(layout.overlay / rel, build / rel)
        gitrepo.commit_all(build, f"{OVERLAY_SUBJECT}\n\n" + "\n".join(files) + "\n", paths=files)
    patches = series_patches(layout)
    for i, patch in enumerate(patches, 1):
        progress.say(verb, f"patch {i}/{len(patches)} {patch.name} ...")
        apply_patch(build, patch)


# --- make apply: build in a scratch directory, then swap it in -----------------

def _after_interrupt(build: Path, scratch: Path, existed: bool, swapping: bool) -> str:
    """One line on what an interrupted apply left."""
    if swapping and not gitrepo.is_repo(build):
        return f"{build} is absent (never half a tree); a plain `make apply` builds it again"
    if swapping and not scratch.exists():
        return f"{build} is the new tree (what is left of the previous one goes with the next `make apply`)"
    return (f"{build} untouched" if existed else f"no {build} was made") + "; a plain `make apply` starts again"


def apply(layout: Layout, force: bool = False) -> None:
    pins = load_pins(layout.root)
    sdist_file = sdist.fetch(pins, sdist.cache_dir())
    build = layout.build
    scratch = build.parent / f".{build.name}.new"
    retired = build.parent / f".{build.name}.old"
    build.parent.mkdir(parents=True, exist_ok=True)
    # Left by an interrupted run; both are apply's own (a retired tree passed the checks below, or FORCE=1).
    removed = [path.name for path in (scratch, retired) if path.exists()]
    for name in removed:
        shutil.rmtree(build.parent / name)
    if removed:
        progress.say("apply", f"removed what an interrupted run left: {', '.join(removed)}")
    inputs = inputs_hash(layout)
    existed = build.exists()
    if existed and not force:
        guard_existing(build)
        if read_state(build).get("inputs") == inputs:
            print(f"{build} is up to date (tree {gitrepo.out(build, 'rev-parse', 'HEAD^{tree}')})")
            return
    swapping = False
    failure = None
    try:
        try:
            build_tree(Layout(layout.root, scratch), sdist_file, pins)
        except PatchFailed as exc:
            failure = exc           # a valid tree up to the patch before: it replaces build/vllm
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        write_state(scratch, None if failure else inputs)
        swapping = True
        progress.say("apply", f"moving the new tree to {build}")
        # Between the two renames build/vllm is absent (never half a tree).
        if build.exists():
            os.rename(build, retired)
        os.rename(scratch, build)
        shutil.rmtree(retired, ignore_errors=True)
    except KeyboardInterrupt:
        raise Interrupted(_after_interrupt(build, scratch, existed, swapping)) from None
    if failure:
        last = gitrepo.out(build, "log", "-1", "--format=%h %s")
        raise SeriesError(f"{failure}\n{build} is left at the last good commit: {last}")
    tree = gitrepo.out(build, "rev-parse", "HEAD^{tree}")
    print(f"{build}: pristine vLLM {pins['VLLM_VERSION']} + {len(overlay_files(layout))} overlay files + "
          f"{len(patchfile.read_series(layout.patches))} patches (tree {tree})")


# --- make refresh -----------------------------------------------------------------

def _still_exact(build: Path, path: Path, header: list[str], commit: str, owned: list[str]) -> bool:
    """Does the existing patch file, applied to commit^, give exactly commit (owned files)?

    Topics are made against pristine upstream so that each applies alone; in the full
    series they apply at line offsets.  Regenerating them would churn line numbers,
    so an unchanged patch is kept byte for byte."""
    patch = patchfile.parse(path)
    if patch.header != header or sorted(patch.files()) != owned:
        return False
    with gitrepo.temp_index() as env:
        gitrepo.git(build, "read-tree", f"{commit}^", env=env)
        if gitrepo.git(build, "apply", "--cached", "-p1", str(path), check=False, env=env).returncode:
            return False
        tree = gitrepo.git(build, "write-tree", env=env).stdout.strip()
    return gitrepo.git(build, "diff", "--quiet", tree, commit, "--", *owned, check=False).returncode == 0


def _series_commits(build: Path, root: str, pristine: set[str]) -> list[tuple[str, list[str], list[str], str | None]]:
    """(commit, files upstream owns that it changes, header, patch name from its trailer) of every
    commit after the pristine root except apply's overlay commit, oldest first.  A commit that
    changes only new files becomes overlay files; its message must be a complete header too."""
    out = []
    for commit in gitrepo.out(build, "rev-list", "--reverse", f"{root}..HEAD").split():
        message = gitrepo.out(build, "log", "-1", "--format=%B", commit)
        changed = gitrepo.out(build, "diff", "--name-only", "--no-renames", f"{commit}^", commit).split()
        owned = sorted(p for p in changed if p in pristine)
        if owned or not message.startswith(OVERLAY_SUBJECT):
            out.append((commit, owned, *patchfile.header_from_commit_message(message)))
    return out


def refresh(layout: Layout, regenerate: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Regenerate patches/ and vllm_overlay/ from the build tree's commits.

    A patch file that still gives its commit exactly is kept byte for byte,
    unless its name is in ``regenerate`` (make rebase: hunks that moved)."""
    build = layout.build
    if not gitrepo.is_repo(build):
        raise SeriesError(f"{build} does not exist: run `make apply` first")
    changes = gitrepo.dirty(build)
    if changes:
        raise SeriesError(f"{build} has uncommitted changes; commit them first "
                          f"(each commit becomes one patch):\n" + "\n".join("  " + c for c in changes[:10]))
    root = gitrepo.root_commit(build)
    pristine = gitrepo.files_at(build, root)
    commits = _series_commits(build, root, pristine)
    bad = [f"  {c[:10]} {h[0].removeprefix('Subject:').strip()!r}: {'; '.join(patchfile.header_problems(h))}"
           for c, _, h, _ in commits if patchfile.header_problems(h)]
    if bad:
        raise SeriesError("refresh: these commits' messages are not complete patch headers (subject, "
                          f"blank line, {', '.join(patchfile.HEADER_FIELDS[1:])}):\n" + "\n".join(bad)
                          + f"\nReword them in {build} (git commit --amend) and refresh again. Nothing was written.")
    report: list[str] = []
    new_files = sorted(gitrepo.files_at(build, "HEAD") - pristine)
    for rel in new_files:
        blob = gitrepo.git(build, "show", f"HEAD:{rel}").stdout
        dest = layout.overlay / rel
        if not dest.exists() or dest.read_text() != blob:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(blob)
            report.append(f"overlay: wrote vllm_overlay/{rel}")
    for rel in sorted(set(overlay_files(layout)) - set(new_files)):
        (layout.overlay / rel).unlink()
        report.append(f"overlay: removed vllm_overlay/{rel}")

    old_names = patchfile.read_series(layout.patches)
    next_number = max([int(n[:4]) for n in old_names if n[:4].isdigit()] or [0]) + 1
    names: list[str] = []
    for commit, owned, header, name in commits:
        if not owned:
            continue
        if not name:  # a commit made by hand: reuse the file an earlier refresh wrote for it
            name = next((old for old in old_names if old not in names and (layout.patches / old).exists()
                         and _still_exact(build, layout.patches / old, header, commit, owned)), None)
        if not name:
            name = f"{next_number:04d}-{patchfile.slug(header[0].removeprefix('Subject:'))}.patch"
            next_number += 1
        names.append(name)
        path = layout.patches / name
        if name not in regenerate and path.exists() and _still_exact(build, path, header, commit, owned):
            continue   # kept byte for byte (line offsets and all)
        diff = patchfile.strip_index_lines(gitrepo.diff(build, f"{commit}^", commit, owned))
        text = "\n".join(header) + "\n---\n" + diff
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            report.append(f"patch: wrote patches/{name}")
    for old in old_names:
        if old not in names and (layout.patches / old).exists():
            (layout.patches / old).unlink()
            report.append(f"patch: removed patches/{old}")
    if names != old_names:
        patchfile.write_series(layout.patches, names)
        report.append("series: rewritten")
    write_state(build, inputs_hash(layout))
    return report
