"""Build the patched tree (make apply) and save edits back (make refresh).

The history of ``build/vllm`` *is* the series:

    <root>   vLLM X.Y.Z pristine (sdist sha256 ...)
    <1>      Series overlay: N new files            (only if vllm_overlay/ has files)
    <2..n>   one commit per patch of patches/series, message = its header

``.git/series-state.json`` records the HEAD and the input hash that the last
apply/refresh produced, so apply can tell "up to date", "rebuild" and "someone
has work here" apart, and never clobbers the last one without ``--force``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import SeriesError, gitrepo, patchfile, sdist
from .pins import load_pins

STATE_FILE = "series-state.json"
OVERLAY_SUBJECT = "Series overlay: new files at their upstream paths"
_IGNORED_OVERLAY_PARTS = ("__pycache__",)


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
    return sorted(
        p.relative_to(layout.overlay).as_posix() for p in layout.overlay.rglob("*")
        if p.is_file() and not any(part in _IGNORED_OVERLAY_PARTS for part in p.parts)
        and p.suffix != ".pyc")


def series_patches(layout: Layout) -> list[patchfile.Patch]:
    patches = []
    for name in patchfile.read_series(layout.patches):
        path = layout.patches / name
        if not path.is_file():
            raise SeriesError(f"patches/series lists {name}, but patches/{name} does not exist")
        patches.append(patchfile.parse(path))
    return patches


def inputs_hash(layout: Layout) -> str:
    """Everything the build tree is made from, in one digest."""
    digest = hashlib.sha256()
    digest.update((layout.root / "pins.env").read_bytes())
    for rel in overlay_files(layout):
        digest.update(b"overlay\0" + rel.encode() + b"\0" + (layout.overlay / rel).read_bytes())
    for name in patchfile.read_series(layout.patches):
        path = layout.patches / name
        digest.update(b"patch\0" + name.encode() + b"\0" +
                      (path.read_bytes() if path.exists() else b"<missing>"))
    return digest.hexdigest()


def _state_path(build: Path) -> Path:
    return build / ".git" / STATE_FILE


def read_state(build: Path) -> dict:
    path = _state_path(build)
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(build: Path, **state: str | None) -> None:
    _state_path(build).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")


def _how_to_keep(build: Path) -> str:
    return (f"To keep this work: commit it in {build} and run `make refresh` (it becomes patches).\n"
            f"To discard it: `make apply FORCE=1`.")


def guard_existing(build: Path) -> None:
    """Refuse when build/vllm holds work the series does not have."""
    if not gitrepo.is_repo(build):
        raise SeriesError(f"{build} exists but is not a tree made by `make apply` (no .git).\n"
                          f"Move it away, or `make apply FORCE=1` to replace it.")
    state = read_state(build)
    changes = gitrepo.dirty(build)
    if changes:
        shown = "\n".join("  " + c for c in changes[:10])
        more = f"\n  ... and {len(changes) - 10} more" if len(changes) > 10 else ""
        raise SeriesError(f"{build} has uncommitted changes:\n{shown}{more}\n" + _how_to_keep(build))
    current = gitrepo.head(build)
    if state.get("head") != current:
        base = state.get("head")
        extra = ""
        if base and gitrepo.git(build, "cat-file", "-e", f"{base}^{{commit}}", check=False).returncode == 0:
            extra = gitrepo.out(build, "log", "--oneline", f"{base}..HEAD")
        listing = "\n".join("  " + ln for ln in extra.splitlines()[:10]) or "  (history rewritten)"
        raise SeriesError(f"{build} has commits that are not in the series:\n{listing}\n" + _how_to_keep(build))


def _hunk_failure(patch: patchfile.Patch, stderr: str) -> str:
    """Turn git apply's complaint into: which file, which hunk."""
    failed = re.search(r"patch failed: (.+):(\d+)", stderr)
    if failed:
        path, line = failed.group(1), int(failed.group(2))
        for file, index, header in patch.hunks():
            start = re.match(r"^@@ -(\d+)", header)
            if file == path and start and int(start.group(1)) == line:
                return f"hunk #{index} of {path} ({header.split('@@')[1].strip()}) does not match"
        return f"a hunk of {path} at line {line} does not match"
    missing = re.search(r"error: (.+?): (No such file or directory|does not exist in index)", stderr)
    if missing:
        return f"{missing.group(1)} does not exist in the tree"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else "git apply failed"


def apply_patch(build: Path, patch: patchfile.Patch) -> str:
    """Apply one patch with zero fuzz and no whitespace errors, then commit it."""
    rel = f"patches/{patch.name}"
    check = gitrepo.git(build, "apply", "--check", "--verbose", "--whitespace=error-all", "-p1",
                        str(patch.path), check=False)
    if check.returncode != 0:
        raise SeriesError(f"{rel} does not apply: {_hunk_failure(patch, check.stderr)}")
    gitrepo.git(build, "apply", "--index", "--whitespace=error-all", "-p1", str(patch.path))
    return gitrepo.commit_all(build, patch.commit_message(), paths=[])


def build_tree(layout: Layout, sdist_file: Path, pins: dict[str, str],
               record_state: bool = True) -> str:
    """Create layout.build from scratch; return its HEAD. Stops at a failing patch."""
    build = layout.build
    sdist.unpack(sdist_file, build)
    gitrepo.git(build, "init", "-q", "-b", "main")
    gitrepo.commit_all(build, f"vLLM {pins['VLLM_VERSION']} pristine (upstream {pins['VLLM_COMMIT']})\n\n"
                              f"From the PyPI sdist, sha256 {pins['VLLM_SDIST_SHA256']}.\n")
    files = overlay_files(layout)
    if files:
        pristine = gitrepo.files_at(build, "HEAD")
        shadowing = [f for f in files if f in pristine]
        if shadowing:
            raise SeriesError("vllm_overlay/ must only add files; these already exist upstream "
                              "(edit them with a patch instead):\n" +
                              "\n".join(f"  vllm_overlay/{f}" for f in shadowing))
        for rel in files:
            dest = build / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(layout.overlay / rel, dest)
            dest.chmod((layout.overlay / rel).stat().st_mode)
        gitrepo.commit_all(build, f"{OVERLAY_SUBJECT}\n\n" + "\n".join(files) + "\n", paths=files)
    inputs = inputs_hash(layout)
    try:
        for patch in series_patches(layout):
            apply_patch(build, patch)
    except SeriesError as exc:
        if record_state:
            write_state(build, head=gitrepo.head(build), inputs=None)
        last = gitrepo.out(build, "log", "-1", "--format=%h %s")
        raise SeriesError(f"{exc}\n{build} is left at the last good commit: {last}") from None
    if record_state:
        write_state(build, head=gitrepo.head(build), inputs=inputs)
    return gitrepo.head(build)


def apply(layout: Layout, force: bool = False) -> str:
    pins = load_pins(layout.root)
    sdist_file = sdist.fetch(pins, sdist.cache_dir())
    build = layout.build
    if build.exists():
        if not force:
            guard_existing(build)
            if read_state(build).get("inputs") == inputs_hash(layout):
                print(f"{build} is up to date (tree {gitrepo.tree_of(build)})")
                return gitrepo.head(build)
        shutil.rmtree(build)
    build.parent.mkdir(parents=True, exist_ok=True)
    head = build_tree(layout, sdist_file, pins)
    count = len(patchfile.read_series(layout.patches))
    print(f"{build}: pristine vLLM {pins['VLLM_VERSION']} + {len(overlay_files(layout))} overlay files "
          f"+ {count} patches (tree {gitrepo.tree_of(build)})")
    return head


def _still_exact(build: Path, path: Path, header: list[str], commit: str, owned: list[str]) -> bool:
    """Does the existing patch file, applied to commit^, give exactly commit (owned files)?

    Patches of different topics are each made against pristine upstream so
    that a topic applies alone; in the full series they apply at line offsets.
    Regenerating them would churn line numbers, so an unchanged patch is kept.
    """
    patch = patchfile.parse(path)
    if patch.header != header or sorted(patch.files()) != owned:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        env_index = Path(tmp) / "index"
        env = {"GIT_INDEX_FILE": str(env_index)}
        if gitrepo.git(build, "read-tree", f"{commit}^", check=False, env=env).returncode:
            return False
        if gitrepo.git(build, "apply", "--cached", "-p1", str(path), check=False, env=env).returncode:
            return False
        tree = gitrepo.git(build, "write-tree", env=env).stdout.strip()
    return gitrepo.git(build, "diff", "--quiet", tree, commit, "--", *owned, check=False).returncode == 0


def refresh(layout: Layout) -> list[str]:
    """Regenerate patches/ and vllm_overlay/ from the build tree's commits."""
    build = layout.build
    if not gitrepo.is_repo(build):
        raise SeriesError(f"{build} does not exist: run `make apply` first")
    changes = gitrepo.dirty(build)
    if changes:
        raise SeriesError(f"{build} has uncommitted changes; commit them first "
                          f"(each commit becomes one patch):\n" + "\n".join("  " + c for c in changes[:10]))
    root = gitrepo.root_commit(build)
    pristine = gitrepo.files_at(build, root)
    report: list[str] = []

    # Overlay: every file at HEAD that upstream does not have.
    new_files = sorted(gitrepo.files_at(build, "HEAD") - pristine)
    old_overlay = set(overlay_files(layout))
    for rel in new_files:
        blob = gitrepo.git(build, "show", f"HEAD:{rel}").stdout
        dest = layout.overlay / rel
        if not dest.exists() or dest.read_text() != blob:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(blob)
            report.append(f"overlay: wrote vllm_overlay/{rel}")
    for rel in sorted(old_overlay - set(new_files)):
        (layout.overlay / rel).unlink()
        report.append(f"overlay: removed vllm_overlay/{rel}")

    # Patches: one per commit that changes files upstream owns.
    existing = [int(n[:4]) for n in patchfile.read_series(layout.patches) if n[:4].isdigit()]
    next_number = (max(existing) if existing else 0) + 1
    names: list[str] = []
    for commit in gitrepo.out(build, "rev-list", "--reverse", f"{root}..HEAD").split():
        changed = gitrepo.out(build, "diff", "--name-only", "--no-renames", f"{commit}^", commit).splitlines()
        owned = sorted(p for p in changed if p in pristine)
        if not owned:
            continue
        header, name = patchfile.header_from_commit_message(
            gitrepo.out(build, "log", "-1", "--format=%B", commit))
        if not name:  # a commit made by hand: reuse the file an earlier refresh wrote for it
            name = next((old for old in patchfile.read_series(layout.patches)
                         if old not in names and (layout.patches / old).exists()
                         and _still_exact(build, layout.patches / old, header, commit, owned)), None)
        if not name:
            name = f"{next_number:04d}-{patchfile.slug(header[0].removeprefix('Subject:'))}.patch"
            next_number += 1
        path = layout.patches / name
        if path.exists() and _still_exact(build, path, header, commit, owned):
            names.append(name)   # keep the file byte for byte (line offsets and all)
            continue
        diff = patchfile.strip_index_lines(gitrepo.diff(build, f"{commit}^", commit, owned))
        text = patchfile.render(header, diff)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            report.append(f"patch: wrote patches/{name}")
        names.append(name)
    for old in patchfile.read_series(layout.patches):
        if old not in names and (layout.patches / old).exists():
            (layout.patches / old).unlink()
            report.append(f"patch: removed patches/{old}")
    if names != patchfile.read_series(layout.patches):
        patchfile.write_series(layout.patches, names)
        report.append("series: rewritten")
    write_state(build, head=gitrepo.head(build), inputs=inputs_hash(layout))
    return report
