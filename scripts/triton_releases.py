"""Triton releases beside the venv's own, for tests that load the launcher on each
(tests/launcher): ``install(VERSION)`` puts the
``triton==VERSION`` wheel (no dependencies) into ``<series cache>/triton/<VERSION>``,
reused when there; an interrupted install leaves a ``.partial`` folder, removed by the
next one.  Put the folder first on PYTHONPATH to run on that Triton.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seriestool.sdist import cache_dir  # noqa: E402


def release_dir(version: str) -> Path:
    return cache_dir() / "triton" / version


def install(version: str, python: str = sys.executable) -> Path:
    """The folder holding ``triton==version`` (installed on first use)."""
    target = release_dir(version)
    if (target / "triton" / "__init__.py").is_file():
        return target
    partial = target.with_name(f"{version}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"triton-releases: installing triton=={version} into {target} ...", file=sys.stderr, flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(partial), f"triton=={version}"],
                   check=True)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
