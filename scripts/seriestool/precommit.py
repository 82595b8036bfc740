"""make check: upstream's pre-commit hooks on the files the series adds or changes.

Upstream runs ``pre-commit run --hook-stage manual`` on every PR. This module does what
pre-commit would do on the series' Python files, from the pinned tree's own
``.pre-commit-config.yaml`` and ``tools/pre_commit/``:

* a hook runs when its stages include ``manual`` (upstream's CI stage) and its
  ``files``/``exclude``/``types``/``types_or``/``exclude_types`` select one of the
  files (``always_run`` hooks always), as pre-commit selects them;
* ``repo: local`` hooks run their ``entry`` + ``args`` (+ the files unless
  ``pass_filenames: false``) from the tree's root; ``language: python`` ones in a
  virtual environment holding exactly their ``additional_dependencies``, so
  ``python`` and ``mypy`` there are the hook's own, as under pre-commit;
* the remote hooks that check Python files (ruff-check, ruff-format, typos) run the
  PyPI package of the same version as the config's ``rev`` (a rev frozen to a commit
  SHA names its tag in a ``# frozen: vX.Y.Z`` comment), with the entry their
  repository's ``.pre-commit-hooks.yaml`` gives (REMOTE_HOOKS);
* a hook fails when it exits non-zero or changes a file (pre-commit's rule): hooks
  run on a scratch tree, so a fixing hook (``ruff check --fix``, the SPDX hook)
  only shows what it would change; a hook whose environment cannot be made is a
  finding too, and the other hooks still run.

Hook environments are cached outside the tree (SERIES_HOOK_ENVS, default
``~/.cache/vllm-aiter-series/pre-commit-envs/``), one per requirement set, like
pre-commit's own cache; the first ``make check`` on a machine installs them from PyPI.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import SeriesError, progress
from .sdist import cache_dir

CONFIG = ".pre-commit-config.yaml"
STAGE = "manual"  # what upstream's CI runs; default_stages of 0.34.0 include it
PYTHON_SUFFIXES = {".py": "python", ".pyi": "pyi"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_OUTPUT_LINES = 40


@dataclass(frozen=True)
class Remote:
    """A remote hook's definition (its repository's .pre-commit-hooks.yaml) and PyPI package."""

    entry: str
    package: str
    types: tuple[str, ...] = ()
    types_or: tuple[str, ...] = ()
    args: tuple[str, ...] = ()


# astral-sh/ruff-pre-commit .pre-commit-hooks.yaml: entry "ruff check --force-exclude" /
# "ruff format --force-exclude", types_or [python, pyi]; the package is ruff at the rev.
# crate-ci/typos .pre-commit-hooks.yaml (id typos, language python): entry "typos",
# args [--write-changes, --force-exclude] (upstream's config replaces the args), types [text].
REMOTE_HOOKS = {
    ("https://github.com/astral-sh/ruff-pre-commit", "ruff-check"):
        Remote("ruff check --force-exclude", "ruff", types_or=("python", "pyi")),
    ("https://github.com/astral-sh/ruff-pre-commit", "ruff-format"):
        Remote("ruff format --force-exclude", "ruff", types_or=("python", "pyi")),
    ("https://github.com/crate-ci/typos", "typos"):
        Remote("typos", "typos", types=("text",), args=("--write-changes", "--force-exclude")),
}


@dataclass
class Hook:
    id: str
    entry: list[str]
    language: str
    requirements: list[str]
    files: str = ""
    exclude: str = "^$"
    types: tuple[str, ...] = ("file",)
    types_or: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    pass_filenames: bool = True
    always_run: bool = False
    stages: list[str] = field(default_factory=list)
    problem: str = ""  # why its environment cannot be made (a finding when it is selected)


def file_tags(path: str) -> set[str]:
    """identify's tags for the files make check passes (Python sources)."""
    suffix = Path(path).suffix
    return {"file", "text", PYTHON_SUFFIXES[suffix]} if suffix in PYTHON_SUFFIXES else {"file"}


def rev_version(config_text: str, rev: str) -> str | None:
    """The version a remote hook's rev names: its tag (v0.14.0), or for a rev frozen to a
    commit SHA (``pre-commit autoupdate --freeze``) the tag of the ``# frozen: v0.17.2``
    comment on its line (YAML drops comments, so the raw text is read); None without one."""
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev.removeprefix("v")
    frozen = re.search(rf"^\s*rev:\s*['\"]?{rev}['\"]?\s+#\s*frozen:\s*v?(\S+)", config_text, re.MULTILINE)
    return frozen.group(1) if frozen else None


def load_hooks(tree: Path) -> tuple[list[Hook], list[str], str]:
    """(hooks to run, notes on remote hooks that cannot run here, global exclude)."""
    import yaml

    text = (tree / CONFIG).read_text()
    config = yaml.safe_load(text)
    default_stages = config.get("default_stages") or [STAGE]
    hooks, skipped = [], []
    for repo in config.get("repos", []):
        for raw in repo.get("hooks", []):
            problem = ""
            if repo["repo"] == "local":
                language = raw["language"]
                entry = shlex.split(raw["entry"])
                requirements = list(raw.get("additional_dependencies", []))
                types, types_or = tuple(raw.get("types", ["file"])), tuple(raw.get("types_or", []))
            else:
                remote = REMOTE_HOOKS.get((repo["repo"], raw["id"]))
                if remote is None:
                    skipped.append(raw["id"])
                    continue
                language = "python"
                entry = shlex.split(remote.entry)
                version = rev_version(text, str(repo["rev"]))
                requirements = [f"{remote.package}=={version}"] if version else []
                if not version:
                    problem = (f"its rev {repo['rev']} is a commit SHA with no '# frozen: vX.Y.Z' "
                               "comment naming the version to install")
                types = tuple(raw.get("types", remote.types or ("file",)))
                types_or = tuple(raw.get("types_or", remote.types_or))
                raw = {"args": list(remote.args), **raw}
            hooks.append(Hook(
                id=raw["id"], entry=entry + [str(a) for a in raw.get("args", [])], language=language,
                requirements=requirements, files=raw.get("files", ""), exclude=raw.get("exclude", "^$"),
                types=types, types_or=types_or, exclude_types=tuple(raw.get("exclude_types", [])),
                pass_filenames=raw.get("pass_filenames", True), always_run=raw.get("always_run", False),
                stages=raw.get("stages", default_stages), problem=problem))
    return hooks, skipped, config.get("exclude", "^$")


def selected(hook: Hook, files: list[str], global_exclude: str) -> list[str]:
    out = []
    for path in files:
        tags = file_tags(path)
        if re.search(global_exclude, path) or not re.search(hook.files, path) or re.search(hook.exclude, path):
            continue
        if not set(hook.types) <= tags or (hook.types_or and not set(hook.types_or) & tags):
            continue
        if set(hook.exclude_types) & tags:
            continue
        out.append(path)
    return out


def envs_dir() -> Path:
    if os.environ.get("SERIES_HOOK_ENVS"):
        return Path(os.environ["SERIES_HOOK_ENVS"])
    return cache_dir() / "pre-commit-envs"


def hook_env(requirements: list[str]) -> Path:
    """A virtual environment holding exactly these requirements (made once, then reused)."""
    key = "\n".join(sorted(requirements))
    env = envs_dir() / hashlib.sha256(key.encode()).hexdigest()[:16]
    stamp = env / "requirements.txt"
    if stamp.is_file() and stamp.read_text() == key:
        return env
    shutil.rmtree(env, ignore_errors=True)  # an interrupted earlier build (no stamp)
    env.parent.mkdir(parents=True, exist_ok=True)
    # Made in place (a venv's scripts name its path); the stamp, written last, marks it complete.
    with progress.stage("check", f"hook environment: {', '.join(requirements) or 'python only'}"):
        made = subprocess.run([sys.executable, "-m", "venv", str(env)], capture_output=True, text=True)
        if made.returncode == 0 and requirements:
            made = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                                   "--disable-pip-version-check", *requirements],
                                  capture_output=True, text=True)
    if made.returncode != 0:
        shutil.rmtree(env, ignore_errors=True)
        raise SeriesError(f"could not make the hook environment for {', '.join(requirements)}: "
                          + ((made.stderr or made.stdout).strip().splitlines() or ["no output"])[-1])
    stamp.write_text(key)
    return env


def _changes(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "status", "--porcelain"],
                          capture_output=True, text=True, check=True).stdout


def run_hook(tree: Path, hook: Hook, files: list[str]) -> list[str]:
    """Run one hook as pre-commit would; its failure as finding lines (none when it passes)."""
    if hook.problem:
        raise SeriesError(hook.problem)
    env = dict(os.environ)
    command = list(hook.entry)
    if hook.language == "python":
        bin_dir = hook_env(hook.requirements) / "bin"
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(bin_dir.parent)
        if command[0] in ("python", "python3") or (bin_dir / command[0]).exists():
            command[0] = str(bin_dir / ("python" if command[0] == "python3" else command[0]))
    elif hook.language == "script":
        command[0] = str(tree / command[0])
    elif hook.language != "system":
        return [f"pre-commit hook {hook.id}: language {hook.language!r} is not run by make check"]
    before = _changes(tree)
    proc = subprocess.run(command + (files if hook.pass_filenames else []), cwd=tree, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    changed = _changes(tree) != before
    if proc.returncode == 0 and not changed:
        return []
    why = f"exit {proc.returncode}" + (", files were modified by this hook" if changed else "")
    text = ANSI.sub("", proc.stdout + proc.stderr).replace(f"{tree}/", "")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if changed:
        diff = subprocess.run(["git", "-C", str(tree), "diff", "--stat"], capture_output=True, text=True)
        lines += diff.stdout.rstrip().splitlines()
    shown = lines[:MAX_OUTPUT_LINES] + ([f"... {len(lines) - MAX_OUTPUT_LINES} more lines"]
                                        if len(lines) > MAX_OUTPUT_LINES else [])
    return [f"pre-commit hook {hook.id} failed ({why}):"] + ["  " + line for line in shown]


def changed_files(tree: Path, base: str) -> list[str]:
    """The files the series adds or changes (overlay commit + patch commits) that still exist."""
    out = subprocess.run(["git", "-C", str(tree), "diff", "--name-only", "--no-renames",
                          "--diff-filter=d", base, "HEAD"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def run_hooks(tree: Path, base: str) -> tuple[list[str], list[str]]:
    """(findings, notes): upstream's hooks on the series' Python files in the scratch tree."""
    if not (tree / CONFIG).is_file():
        return [], [f"note: the pinned tree has no {CONFIG}; no pre-commit hook ran"]
    files = [f for f in changed_files(tree, base) if Path(f).suffix in PYTHON_SUFFIXES]
    hooks, skipped, global_exclude = load_hooks(tree)
    findings, ran = [], []
    for hook in hooks:
        if STAGE not in hook.stages:
            continue
        chosen = selected(hook, files, global_exclude)
        if not chosen and not hook.always_run:
            continue
        with progress.stage("check", f"pre-commit hook {hook.id} on {len(chosen)} file(s)"):
            try:
                findings += run_hook(tree, hook, chosen)
            except SeriesError as exc:  # its environment could not be made
                findings.append(f"pre-commit hook {hook.id} not run: {exc}")
                continue
        ran.append(hook.id)
    notes = [f"note: pre-commit hooks run on {len(files)} Python file(s) of the series: {', '.join(ran)}"]
    if skipped:
        notes.append(f"note: not run, hooks of other file types: {', '.join(dict.fromkeys(skipped))}")
    return findings, notes
