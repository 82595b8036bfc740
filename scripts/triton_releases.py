"""``install(VERSION)``: the ``triton==VERSION`` wheel (no dependencies) in
``<series cache>/triton/<VERSION>``, for the tests that load the launcher on each release
(tests/launcher); put the folder first on PYTHONPATH to run on that Triton."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seriestool.sdist import cache_dir  # noqa: E402


def install(version: str) -> Path:
    """The folder holding ``triton==version``, installed on first use (through a
    ``.partial`` folder, so an interrupted install is redone)."""
    target = cache_dir() / "triton" / version
    if (target / "triton" / "__init__.py").is_file():
        return target
    partial = target.with_name(f"{version}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"triton-releases: installing triton=={version} into {target} ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(partial), f"triton=={version}"],
                   check=True)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
