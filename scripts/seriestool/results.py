"""Committed benchmark results: which files may back a claim, and the newest of each kernel.

Shared by ``make report`` (scripts/bench_report.py) and ``make pr`` (seriestool/export.py).
Only ``benchmarks/results/*.json`` as committed at HEAD count, and only a file the tool
wrote for a clean, known commit: ``machine_info.series.dirty`` is ``false``, its series
commit is an ancestor of HEAD, and nobody edited it afterwards (no ``commit_note``; a
``series_seal``, written by ``make bench``, that matches).  Every other file is skipped
with the reasons, which the tools print.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from . import gitrepo

RESULTS_DIR = "benchmarks/results"
SEAL_KEY = "series_seal"


def _digest(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(data: dict) -> dict:
    """``data`` with a seal over everything else in it."""
    return {**data, SEAL_KEY: {"by": "scripts/run_bench.py", "sha256": _digest(data)}}


@dataclass
class ResultFile:
    path: str  # relative to the repository root
    data: dict

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def series(self) -> dict:
        info = self.data.get("machine_info")
        series = info.get("series", info) if isinstance(info, dict) else {}
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

    def _infos(self) -> list[dict]:
        return [b["extra_info"] for b in self.data.get("benchmarks", [])
                if isinstance(b, dict) and isinstance(b.get("extra_info"), dict)]

    def kernels(self) -> list[str]:
        return sorted({i["kernel"] for i in self._infos() if isinstance(i.get("kernel"), str)})

    def cases(self, kernel: str) -> list[dict]:
        """extra_info of the kernel's timed cases (device suites: with ``results``)."""
        return [i for i in self._infos() if i.get("kernel") == kernel and "results" in i]

    def has(self, kernel: str) -> bool:
        return kernel in self.kernels()


def committed(root: Path) -> list[ResultFile]:
    """Every ``benchmarks/results/*.json`` committed at HEAD, as committed (sorted by path)."""
    proc = gitrepo.git(root, "ls-tree", "--name-only", "HEAD", "--", f"{RESULTS_DIR}/", check=False)
    out = []
    for path in sorted(proc.stdout.splitlines() if proc.returncode == 0 else []):
        if path.endswith(".json"):
            try:
                data = json.loads(gitrepo.git(root, "show", f"HEAD:{path}", check=False).stdout)
            except ValueError:
                continue
            if isinstance(data, dict):
                out.append(ResultFile(path, data))
    return out


def commit_problem(root: Path, commit: str) -> str | None:
    """Why ``commit`` cannot be a result's commit here, or None."""
    if not commit or commit == "unknown":
        return "no series commit recorded"
    if gitrepo.git(root, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode:
        return f"series commit {commit} is not in this repository"
    if gitrepo.git(root, "merge-base", "--is-ancestor", commit, "HEAD", check=False).returncode:
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
    if problem := commit_problem(root, result.commit):
        out.append(problem)
    if "commit_note" in result.series:
        out.append("its commit was edited after the run (machine_info.series.commit_note)")
    mark = result.data.get(SEAL_KEY)
    if isinstance(mark, dict) and mark.get("sha256") != _digest(result.data):
        out.append("edited after the run (series_seal does not match the content)")
    return out


@dataclass
class Selection:
    usable: list[ResultFile]
    skipped: list[tuple[ResultFile, list[str]]]

    def latest(self, kernel: str, device: str | None = None) -> ResultFile | None:
        """The newest usable file with cases of ``kernel`` (on ``device`` when given)."""
        having = [f for f in self.usable if f.has(kernel) and device in (None, f.device)]
        return max(having, key=lambda f: (f.when, f.path)) if having else None

    def devices(self, kernel: str) -> list[str]:
        return sorted({f.device for f in self.usable if f.has(kernel)})

    def notes(self) -> list[str]:
        return [f"{f.path}: not used ({'; '.join(reasons)})" for f, reasons in self.skipped]


def select(root: Path) -> Selection:
    usable, skipped = [], []
    for result in committed(root):
        reasons = problems(root, result)
        if reasons:
            skipped.append((result, reasons))
        else:
            usable.append(result)
    return Selection(usable, skipped)
