"""Committed benchmark results: which files may back a claim, and the cases in them.

Only ``benchmarks/results/*.json`` as committed at HEAD count, and only a file ``make bench``
wrote on a clean tree (``machine_info.series.dirty`` false) at a commit of HEAD's history,
unedited since (no ``commit_note``; its ``series_seal``, if any, matches).  Other files are
skipped with the reasons.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from . import SeriesError, gitrepo

SEAL_KEY = "series_seal"
# Suites that time the host: host µs per call (bench_host_cost.py) and eager wall clock
# of whole steps (bench_eager_step.py); no L2 mode.
HOST_TIMED = {"host_cost": "host", "eager_step": "eager"}


def _digest(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(data: dict) -> dict:
    """``data`` with a seal over everything else in it."""
    return {**data, SEAL_KEY: {"by": "scripts/run_bench.py", "sha256": _digest(data)}}


def timing_mode(case: dict) -> str:
    """host / eager (host-timed suites), else cold / warm as recorded; files from before
    the cold rotation: graph replays were warm, the rest ``do_bench`` with its L2 flush."""
    for prefix, mode in HOST_TIMED.items():
        if str(case.get("kernel", "")).startswith(prefix):
            return mode
    return case.get("mode") or ("warm" if case.get("graph") else "flushed")


class ResultFile:
    def __init__(self, path: str, data: dict):
        self.path = path  # relative to the repository root
        self.data = data
        self.name = Path(path).name
        self.series = data.get("machine_info", {}).get("series", {})
        self.device = str(self.series.get("device", "unknown device"))
        self.when = str(data.get("datetime", ""))
        self.commit = str(self.series.get("commit") or "")
        self.rocm = bool(self.series.get("hip"))

    def kernels(self) -> list[str]:
        return sorted({b["extra_info"]["kernel"] for b in self.data.get("benchmarks", [])
                       if "kernel" in b.get("extra_info", {})})

    def cases(self, kernel: str) -> list[dict]:
        """extra_info of the kernel's device-timed cases (those with ``results``)."""
        infos = [b.get("extra_info", {}) for b in self.data.get("benchmarks", [])]
        return [i for i in infos if i.get("kernel") == kernel and "results" in i]


def host_cases(data: dict, kernel: str) -> list[dict]:
    """A kernel's host-side (CPU) benchmarks, pytest-benchmark's own median per variant:
    rows of case, before/after µs and before / after as the speedup."""
    by_case: dict[str, dict] = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if info.get("kernel") == kernel and "variant" in info and "results" not in info:
            by_case.setdefault(info.get("case", "?"), {})[info["variant"]] = bench["stats"]["median"] * 1e6
    return [{"case": case, "before_us": v.get("before"), "after_us": v.get("after"),
             "speedup": v["before"] / v["after"] if v.get("before") and v.get("after") else None}
            for case, v in by_case.items()]


def problems(root: Path, result: ResultFile) -> list[str]:
    """Why a result file may not back claims (empty: it may)."""
    out = []
    dirty = result.series.get("dirty")
    if dirty is True:
        out.append("from a dirty tree (machine_info.series.dirty = true)")
    elif dirty is not False:
        out.append(f"tree state not recorded as clean (machine_info.series.dirty = {dirty!r})")
    commit = result.commit or "(none)"
    if gitrepo.git(root, "merge-base", "--is-ancestor", commit, "HEAD", check=False).returncode:
        out.append(f"series commit {commit} is not in HEAD's history")
    if "commit_note" in result.series:
        out.append("its commit was edited after the run (machine_info.series.commit_note)")
    mark = result.data.get(SEAL_KEY)
    if mark is not None and mark.get("sha256") != _digest(result.data):
        out.append("edited after the run (series_seal does not match the content)")
    return out


@dataclass
class Selection:
    usable: list[ResultFile]
    skipped: list[tuple[ResultFile, list[str]]]

    def latest(self, kernel: str, device: str | None = None) -> ResultFile | None:
        """The newest usable file with cases of ``kernel`` (on ``device`` when given)."""
        having = [f for f in self.usable if kernel in f.kernels() and device in (None, f.device)]
        return max(having, key=lambda f: (f.when, f.path)) if having else None

    def devices(self, kernel: str) -> list[str]:
        return sorted({f.device for f in self.usable if kernel in f.kernels()})


def select(root: Path) -> Selection:
    """Every ``benchmarks/results/*.json`` committed at HEAD, as committed, usable or skipped."""
    selection = Selection([], [])
    listed = gitrepo.out(root, "ls-tree", "--name-only", "HEAD", "--", "benchmarks/results/")
    for path in sorted(p for p in listed.splitlines() if p.endswith(".json")):
        try:
            result = ResultFile(path, json.loads(gitrepo.out(root, "show", f"HEAD:{path}")))
        except ValueError as exc:
            raise SeriesError(f"{path} as committed is not JSON: {exc}") from None
        reasons = problems(root, result)
        if reasons:
            selection.skipped.append((result, reasons))
        else:
            selection.usable.append(result)
    return selection
