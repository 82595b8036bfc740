#!/usr/bin/env python3
"""make bench: run the kernel benchmark suites on the GPU at hand, one JSON per run.

Writes ``<out>/<YYYYmmdd-HHMM>-<device>-<commit>.json`` (pytest-benchmark's
format; per-case numbers in ``extra_info``, device/versions/commit in
``machine_info.series``).  ``--out`` defaults to benchmarks/results/.  Needs only
torch, triton, pytest and pytest-benchmark; run it with the overlay on
PYTHONPATH (the Makefile does).  ``--suite NAME`` (repeatable) runs only
benchmarks/bench_NAME.py; other arguments go to pytest (e.g. ``-k fetch_kv``).

On a machine that gets a copy of the tree (without .git, or with a stale one),
pass the commit: ``SERIES_COMMIT=$(git rev-parse HEAD) SERIES_DIRTY=0 make bench``.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu"


def _commit() -> str:
    # An explicit SERIES_COMMIT wins: a copied tree's .git can be stale.
    if os.environ.get("SERIES_COMMIT"):
        return os.environ["SERIES_COMMIT"][:10]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str]) -> int:
    out = ROOT / "benchmarks" / "results"
    suites: list[str] = []
    while argv[:1] in (["--out"], ["--suite"]):
        if argv[0] == "--out":
            out = Path(argv[1])
        else:
            suites.append(str(ROOT / "benchmarks" / f"bench_{argv[1]}.py"))
        argv = argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    slug = re.sub(r"[^a-z0-9]+", "-", _device().lower()).strip("-")
    path = out / f"{stamp}-{slug}-{_commit()}.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           *(suites or [str(ROOT / "benchmarks")]), f"--benchmark-json={path}", "--benchmark-columns=median,rounds",
           *argv]
    print(f"[bench] device: {_device()}; results -> {path}", flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    print(f"[bench] wrote {path}" if path.exists() else "[bench] no results written", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
