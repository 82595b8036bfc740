"""Where a benchmark result comes from: the series commit and whether the tree was clean.

One definition, used by ``make bench`` (scripts/run_bench.py, which records
the state once and passes it on) and by the pytest hook that writes
``machine_info.series`` (benchmarks/conftest.py), and read back by
``make report`` (scripts/bench_report.py).

* ``commit``: ``SERIES_COMMIT`` when set, else ``git rev-parse HEAD``.  The GPU
  machine gets a copy of the working tree whose ``.git`` can be an older
  snapshot than the files beside it, so there the commit must be passed.
* ``dirty``: ``SERIES_DIRTY`` (``0``/``1``) when set, else whether git shows
  changes to what is measured (``MEASURED_PATHS``, result files excluded);
  ``"unknown"`` when neither can tell (SERIES_COMMIT without SERIES_DIRTY, or
  no git).  Only ``dirty is False`` results back claims.

``make bench`` also seals the file it writes (a sha256 of its content,
scripts/seriestool/results.py), so ``make report`` can tell a result written
by the tool from one edited afterwards.

Plain Python (stdlib only): importable without torch.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What decides a measurement: the kernels, the series, the suites and the runner.
MEASURED_PATHS = ("patches", "vllm_overlay", "benchmarks", "pins.env", "scripts/run_bench.py")
# ... except what the runs themselves write.
NOT_MEASURED = ("benchmarks/results", "benchmarks/notes", "benchmarks/RESULTS.md")

_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _git(repo: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_dirty(value: str | None) -> bool | str:
    """SERIES_DIRTY's value: True / False, or "unknown" for anything else (or unset)."""
    text = (value or "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return "unknown"


def git_dirty(repo: Path) -> bool | str:
    """Uncommitted changes (untracked files included) to MEASURED_PATHS, per git."""
    status = _git(repo, "status", "--porcelain", "--untracked-files=all", "--", *MEASURED_PATHS,
                  *(f":(exclude){p}" for p in NOT_MEASURED))
    return bool(status) if status is not None else "unknown"


def series_state(repo: Path = REPO, env: dict | None = None) -> dict:
    """{"commit": ..., "dirty": True | False | "unknown"} for a run in ``repo``."""
    env = os.environ if env is None else env
    commit = (env.get("SERIES_COMMIT") or "").strip()
    if commit:  # a copied tree: its .git (if any) is not the files' commit
        return {"commit": commit, "dirty": parse_dirty(env.get("SERIES_DIRTY"))}
    dirty = git_dirty(repo)
    if env.get("SERIES_DIRTY"):  # an explicit "this tree is dirty" also wins over git
        dirty = True if parse_dirty(env["SERIES_DIRTY"]) is True else dirty
    return {"commit": _git(repo, "rev-parse", "HEAD") or "unknown", "dirty": dirty}
