"""make check: upstream's pre-commit hooks on the Python files the series adds or changes.

pre-commit itself cannot run here (it clones each hook's repository), so this does what
``pre-commit run --hook-stage manual`` would, from the pinned tree's config: local hooks run
their entry, the remote hooks in REMOTE_HOOKS their PyPI package at the config's rev, each
in a cached venv of its dependencies (SERIES_HOOK_ENVS, default <cache>/pre-commit-envs/).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from . import SeriesError, gitrepo, progress
from .sdist import cache_dir

CONFIG = ".pre-commit-config.yaml"
STAGE = "manual"  # what upstream's CI runs
PYTHON_TAGS = {".py": "python", ".pyi": "pyi"}
MAX_OUTPUT_LINES = 40

# (repo, hook id) -> (entry, PyPI package, types, types_or, default args), from each
# repository's .pre-commit-hooks.yaml (astral-sh/ruff-pre-commit, crate-ci/typos).
RUFF = "https://github.com/astral-sh/ruff-pre-commit"
REMOTE_HOOKS = {
    (RUFF, "ruff-check"): ("ruff check --force-exclude", "ruff", [], ["python", "pyi"], []),
    (RUFF, "ruff-format"): ("ruff format --force-exclude", "ruff", [], ["python", "pyi"], []),
    ("https://github.com/crate-ci/typos", "typos"):
        ("typos", "typos", ["text"], [], ["--write-changes", "--force-exclude"]),
}


def rev_version(config_text: str, rev: str) -> str | None:
    """A rev's version: its tag, or the ``# frozen: vX.Y.Z`` comment of a rev frozen to a SHA."""
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev.removeprefix("v")
    frozen = re.search(rf"^\s*rev:\s*['\"]?{rev}['\"]?\s+#\s*frozen:\s*v?(\S+)", config_text, re.M)
    return frozen.group(1) if frozen else None


def load_hooks(tree: Path) -> tuple[list[dict], list[str], str]:
    """(hooks, ids of remote hooks not run here, global exclude); a hook is its config entry
    with pre-commit's defaults, ``entry`` a list, ``requirements`` and ``problem`` (why not runnable)."""
    import yaml

    text = (tree / CONFIG).read_text()
    config = yaml.safe_load(text)
    hooks, skipped = [], []
    for repo in config.get("repos", []):
        for raw in repo.get("hooks", []):
            hook = {"stages": config.get("default_stages") or [STAGE], "types": ["file"], "problem": "",
                    "files": "", "exclude": "^$", "types_or": [], "exclude_types": [], "args": [], **raw}
            if repo["repo"] == "local":
                hook["requirements"] = list(raw.get("additional_dependencies", []))
            elif (repo["repo"], raw["id"]) in REMOTE_HOOKS:
                entry, package, types, types_or, args = REMOTE_HOOKS[(repo["repo"], raw["id"])]
                version = rev_version(text, str(repo["rev"]))
                hook.update(language="python", entry=entry, requirements=[f"{package}=={version}"] if version else [],
                            types=raw.get("types", types or ["file"]), types_or=raw.get("types_or", types_or),
                            args=raw.get("args", args))
                if not version:
                    hook["problem"] = (f"its rev {repo['rev']} is a commit SHA with no '# frozen: vX.Y.Z' "
                                       "comment naming the version to install")
            else:
                skipped.append(raw["id"])
                continue
            hook["entry"] = shlex.split(hook["entry"]) + [str(a) for a in hook["args"]]
            hooks.append(hook)
    return hooks, skipped, config.get("exclude", "^$")


def selected(hook: dict, files: list[str], global_exclude: str) -> list[str]:
    out = []
    for path in files:
        suffix = Path(path).suffix
        tags = {"file", "text", PYTHON_TAGS[suffix]} if suffix in PYTHON_TAGS else {"file"}
        if (re.search(global_exclude, path) or not re.search(hook["files"], path)
                or re.search(hook["exclude"], path) or set(hook["exclude_types"]) & tags):
            continue
        if set(hook["types"]) <= tags and (not hook["types_or"] or set(hook["types_or"]) & tags):
            out.append(path)
    return out


def hook_env(requirements: list[str]) -> Path:
    """A virtual environment holding exactly these requirements (made once, then reused)."""
    key = "\n".join(sorted(requirements))
    base = Path(os.environ.get("SERIES_HOOK_ENVS") or cache_dir() / "pre-commit-envs")
    env = base / hashlib.sha256(key.encode()).hexdigest()[:16]
    stamp = env / "requirements.txt"   # written last: marks the environment complete
    if stamp.is_file() and stamp.read_text() == key:
        return env
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    with progress.stage("check", f"hook environment: {', '.join(requirements) or 'python only'}"):
        made = subprocess.run([sys.executable, "-m", "venv", str(env)], capture_output=True, text=True)
        if made.returncode == 0 and requirements:
            made = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                                   "--disable-pip-version-check", *requirements], capture_output=True, text=True)
    if made.returncode != 0:
        shutil.rmtree(env, ignore_errors=True)
        raise SeriesError(f"could not make the hook environment for {', '.join(requirements)}: "
                          + ((made.stderr or made.stdout).strip().splitlines() or ["no output"])[-1])
    stamp.write_text(key)
    return env


def run_hook(tree: Path, hook: dict, files: list[str]) -> list[str]:
    """Run one hook as pre-commit would; its failure as finding lines (none when it passes)."""
    if hook["problem"]:
        raise SeriesError(hook["problem"])
    env = dict(os.environ)
    command = list(hook["entry"])
    if hook["language"] == "python":
        bin_dir = hook_env(hook["requirements"]) / "bin"
        env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent))
        name = "python" if command[0] == "python3" else command[0]
        if (bin_dir / name).exists():
            command[0] = str(bin_dir / name)
    elif hook["language"] == "script":
        command[0] = str(tree / command[0])
    elif hook["language"] != "system":
        return [f"pre-commit hook {hook['id']}: language {hook['language']!r} is not run by make check"]
    before = gitrepo.out(tree, "status", "--porcelain")
    proc = subprocess.run(command + (files if hook.get("pass_filenames", True) else []), cwd=tree, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    changed = gitrepo.out(tree, "status", "--porcelain") != before
    if proc.returncode == 0 and not changed:
        return []
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr).replace(f"{tree}/", "")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if changed:
        lines += gitrepo.out(tree, "diff", "--stat").splitlines()
    why = f"exit {proc.returncode}" + (", files were modified by this hook" if changed else "")
    more = [f"  ... {len(lines) - MAX_OUTPUT_LINES} more lines"] if len(lines) > MAX_OUTPUT_LINES else []
    return [f"pre-commit hook {hook['id']} failed ({why}):"] + ["  " + ln for ln in lines[:MAX_OUTPUT_LINES]] + more


def run_hooks(tree: Path, base: str) -> tuple[list[str], list[str]]:
    """(findings, notes): upstream's hooks on the series' Python files in the scratch tree."""
    if not (tree / CONFIG).is_file():
        return [], [f"note: the pinned tree has no {CONFIG}; no pre-commit hook ran"]
    changed = gitrepo.out(tree, "diff", "--name-only", "--no-renames", "--diff-filter=d", base, "HEAD").split()
    files = [f for f in changed if Path(f).suffix in PYTHON_TAGS]
    hooks, skipped, global_exclude = load_hooks(tree)
    findings, ran = [], []
    for hook in hooks:
        chosen = selected(hook, files, global_exclude)
        if STAGE not in hook["stages"] or not (chosen or hook.get("always_run")):
            continue
        with progress.stage("check", f"pre-commit hook {hook['id']} on {len(chosen)} file(s)"):
            try:
                findings += run_hook(tree, hook, chosen)
            except SeriesError as exc:  # its environment could not be made
                findings.append(f"pre-commit hook {hook['id']} not run: {exc}")
                continue
        ran.append(hook["id"])
    notes = [f"note: pre-commit hooks run on {len(files)} Python file(s) of the series: {', '.join(ran)}"]
    if skipped:
        notes.append(f"note: not run, hooks of other file types: {', '.join(dict.fromkeys(skipped))}")
    return findings, notes
