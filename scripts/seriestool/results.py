"""Committed benchmark results: which files may back a claim, and the newest of each kernel.

Shared by ``make report`` (scripts/bench_report.py) and ``make pr``
(seriestool/export.py), so both quote the same file for the same kernel.

Only result files committed at HEAD count (``benchmarks/results/*.json``,
read from HEAD, not the working tree).  A file backs claims only when it is
what the tool wrote for a clean, known commit:

* ``machine_info.series.dirty`` is ``false`` (not ``true``, not ``"unknown"``);
* its series commit is in this repository's history (an ancestor of HEAD);
* nobody edited it afterwards: no ``commit_note`` (a commit corrected by
  hand), and a ``series_seal`` (written by ``make bench``) that matches.

Every other file is skipped with the reasons, which the tools print.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from . import gitrepo

RESULTS_DIR = "benchmarks/results"
SEAL_KEY = "series_seal"
SEALED_BY = "scripts/run_bench.py"


# --- the seal (make bench writes it, make report checks it) ------------------------------

def _canonical(data: dict) -> bytes:
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal(data: dict) -> dict:
    """``data`` with a seal over everything else in it."""
    return {**data, SEAL_KEY: {"by": SEALED_BY, "sha256": hashlib.sha256(_canonical(data)).hexdigest()}}


def seal_state(data: dict) -> str:
    """"sealed" (content as written), "edited" (the seal does not match) or "unsealed"."""
    mark = data.get(SEAL_KEY)
    if not isinstance(mark, dict):
        return "unsealed"
    return "sealed" if mark.get("sha256") == hashlib.sha256(_canonical(data)).hexdigest() else "edited"


# --- result files ------------------------------------------------------------------------

@dataclass
class ResultFile:
    path: str   # relative to the repository root
    data: dict

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def series(self) -> dict:
        info = self.data.get("machine_info", {})
        info = info if isinstance(info, dict) else {}
        series = info.get("series", info)
        return series if isinstance(series, dict) else {}

    @property
    def device(self) -> str:
        return str(self.series.get("device", "unknown device"))

    @property
    def when(self) -> str:
        return str(self.data.get("datetime", ""))

    @property
    def commit(self) -> str:
        return str(self.series.get("commit") or "")

    @property
    def rocm(self) -> bool:
        return bool(self.series.get("hip"))

    def kernels(self) -> list[str]:
        found = [b["extra_info"].get("kernel") for b in self.data.get("benchmarks", [])
                 if isinstance(b, dict) and isinstance(b.get("extra_info"), dict)]
        return sorted({k for k in found if isinstance(k, str)})

    def cases(self, kernel: str) -> list[dict]:
        """extra_info of the kernel's timed cases (device suites: with ``results``)."""
        return [b["extra_info"] for b in self.data.get("benchmarks", [])
                if isinstance(b, dict) and isinstance(b.get("extra_info"), dict)
                and b["extra_info"].get("kernel") == kernel and "results" in b["extra_info"]]

    def has(self, kernel: str) -> bool:
        return kernel in self.kernels()


def committed(root: Path, results_dir: str = RESULTS_DIR) -> list[ResultFile]:
    """Every ``<results_dir>/*.json`` committed at HEAD, as committed (sorted by path)."""
    if not gitrepo.is_repo(root):
        return []
    proc = gitrepo.git(root, "ls-tree", "--name-only", "HEAD", "--", f"{results_dir}/", check=False)
    if proc.returncode:
        return []
    out = []
    for path in sorted(proc.stdout.splitlines()):
        if not path.endswith(".json"):
            continue
        blob = gitrepo.git(root, "show", f"HEAD:{path}", check=False)
        try:
            data = json.loads(blob.stdout)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append(ResultFile(path, data))
    return out


def commit_problem(root: Path, commit: str) -> str | None:
    """Why ``commit`` cannot be a result's commit here, or None."""
    if not commit or commit == "unknown":
        return "no series commit recorded"
    exists = gitrepo.git(root, "cat-file", "-e", f"{commit}^{{commit}}", check=False)
    if exists.returncode:
        return f"series commit {commit} is not in this repository"
    ancestor = gitrepo.git(root, "merge-base", "--is-ancestor", commit, "HEAD", check=False)
    if ancestor.returncode:
        return f"series commit {commit} is not in HEAD's history"
    return None


def problems(root: Path, result: ResultFile) -> list[str]:
    """Why a result file may not back claims (empty: it may)."""
    out = []
    dirty = result.series.get("dirty")
    if dirty is True:
        out.append("from a dirty tree (machine_info.series.dirty = true)")
    elif dirty is not False:
        out.append(f"tree state not recorded as clean (machine_info.series.dirty = {dirty!r})")
    problem = commit_problem(root, result.commit)
    if problem:
        out.append(problem)
    if "commit_note" in result.series:
        out.append("its commit was edited after the run (machine_info.series.commit_note)")
    if seal_state(result.data) == "edited":
        out.append("edited after the run (series_seal does not match the content)")
    return out


@dataclass
class Selection:
    usable: list[ResultFile]
    skipped: list[tuple[ResultFile, list[str]]]

    def latest(self, kernel: str, device: str | None = None) -> ResultFile | None:
        """The newest usable file with cases of ``kernel`` (on ``device`` when given)."""
        having = [f for f in self.usable if f.has(kernel) and (device is None or f.device == device)]
        return max(having, key=lambda f: (f.when, f.path)) if having else None

    def devices(self, kernel: str) -> list[str]:
        return sorted({f.device for f in self.usable if f.has(kernel)})

    def notes(self) -> list[str]:
        return [f"{f.path}: not used ({'; '.join(reasons)})" for f, reasons in self.skipped]


def select(root: Path, results_dir: str = RESULTS_DIR) -> Selection:
    usable, skipped = [], []
    for result in committed(root, results_dir):
        reasons = problems(root, result)
        (skipped.append((result, reasons)) if reasons else usable.append(result))
    return Selection(usable, skipped)
