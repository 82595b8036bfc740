"""Thin, deterministic git plumbing for the build tree."""

from __future__ import annotations

import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from . import SeriesError

# A fixed identity and date: `make apply` reproduces the same commit ids, on any pin.
SERIES_IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-aiter-series",
    "GIT_AUTHOR_EMAIL": "series@localhost",
    "GIT_AUTHOR_DATE": "2026-11-02T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vllm-aiter-series",
    "GIT_COMMITTER_EMAIL": "series@localhost",
    "GIT_COMMITTER_DATE": "2026-11-02T00:00:00+0000",
}
_CONFIG = ("-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "core.quotepath=false",
           "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "core.hooksPath=/dev/null")
# What the series is made of; uncommitted changes here make a build or export "dirty".
SERIES_INPUTS = ("patches", "vllm_overlay", "pins.env")


def git(repo: Path, *args: str, check: bool = True, identity: bool = False,
        input_text: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
    full_env.update(SERIES_IDENTITY if identity else {})
    full_env.update(env or {})
    proc = subprocess.run(["git", *_CONFIG, "-C", str(repo), *args], capture_output=True,
                          text=True, env=full_env, input=input_text)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args[:3])} failed in {repo}: "
                          f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def out(repo: Path, *args: str) -> str:
    return git(repo, *args).stdout.strip()


def is_repo(path: Path) -> bool:
    return (path / ".git").exists()


def root_commit(repo: Path) -> str:
    return out(repo, "rev-list", "--max-parents=0", "HEAD").splitlines()[-1]


def head(repo: Path) -> str:
    return out(repo, "rev-parse", "HEAD")


def dirty(repo: Path) -> list[str]:
    """Uncommitted changes, untracked files included (``git status --porcelain``)."""
    return git(repo, "status", "--porcelain", "--untracked-files=all").stdout.splitlines()


def commit_all(repo: Path, message: str, paths: list[str] | None = None) -> str:
    """Commit with the series identity: every file (paths None), these paths, or the index ([])."""
    if paths is None:
        git(repo, "add", "-A", "-f", ".")
    elif paths:
        git(repo, "add", "-f", "--", *paths)
    git(repo, "commit", "-q", "--allow-empty", "-F", "-", identity=True, input_text=message)
    return head(repo)


def files_at(repo: Path, rev: str) -> set[str]:
    return set(out(repo, "ls-tree", "-r", "--name-only", "-z", rev).split("\0")) - {""}


def diff(repo: Path, a: str, b: str, paths: list[str] | None, context: int = 3) -> str:
    """The series' diff format between two revisions; paths None means every file."""
    return git(repo, "diff", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
               "--diff-algorithm=myers", "--src-prefix=a/", "--dst-prefix=b/", f"-U{context}",
               a, b, "--", *(paths or [])).stdout


def series_inputs_dirty(root: Path) -> bool:
    """Whether the series repository has uncommitted changes to what the series is made of."""
    return bool(git(root, "status", "--porcelain", "--", *SERIES_INPUTS, check=False).stdout.strip())


@contextmanager
def temp_index():
    """The environment of git commands that work in a throw-away index (checkout and HEAD untouched)."""
    with tempfile.TemporaryDirectory(prefix="series-index-") as tmp:
        yield {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
