#!/usr/bin/env python3
"""make test-upstream: upstream's own tests on the patched tree, against the pristine record.

The files of ``tests/upstream/upstream_tests.toml`` run (in ``--python``) on the patched tree
and, for the upstream test files the series edits, the series' versions of them.  Pristine
vLLM is a function of the pin alone: ``--record`` runs it once per pin into
``tests/upstream/pristine.json`` (named by sdist sha256 and the toml's files; another pin's
record is refused, exit 2).  Verdict: every difference between the record and patched is
listed under ``[[differs]]`` and every listed one happens; a test failing on both trees
matches an ``[[environment]]`` entry; the series' own tests pass.  Otherwise exit 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_engine  # noqa: E402

HERE = ROOT / "tests" / "upstream"
CONFIG = HERE / "upstream_tests.toml"
WORK = ROOT / "build" / "upstream-tests"
RECORD = HERE / "pristine.json"
RECORD_COMMAND = "make test-upstream RECORD=1"
MODELS = HERE / "models"
FAILED = ("failed", "error")
# A revision for the hand-made hub snapshots (the hub cache wants one).
SNAPSHOT_REV = "0" * 40


class SetupError(RuntimeError):
    pass


@dataclass
class Expectations:
    files: list[str]
    differs: dict[str, dict]
    environment: list[dict]
    timeout_s: float = 1200.0

    @classmethod
    def load(cls, path: Path) -> Expectations:
        data = tomllib.loads(path.read_text())
        for entry in data.get("differs", []):
            if not all(entry.get(k) for k in ("test", "pristine", "patched", "patch", "why")):
                raise SetupError(f"{path}: [[differs]] entry {entry} needs test, pristine, patched, patch and why")
        for entry in data.get("environment", []):
            if not entry.get("tests") or not entry.get("reason"):
                raise SetupError(f"{path}: [[environment]] entry {entry} needs tests and reason")
            entry["used"] = 0
        differs = {entry["test"]: entry for entry in data.get("differs", [])}
        if len(differs) < len(data.get("differs", [])):
            raise SetupError(f"{path}: a test is listed twice under [[differs]]")
        if not data.get("files"):
            raise SetupError(f"{path}: no files to run")
        return cls(data["files"], differs, data.get("environment", []), float(data.get("timeout_s", 1200)))

    def environment_reason(self, test: str, message: str = "") -> str | None:
        """The reason of the first [[environment]] entry matching ``test`` (its
        ``tests`` patterns, and ``message`` if the entry has one), else None."""
        for entry in self.environment:
            if not any(fnmatch.fnmatchcase(test, pattern) for pattern in entry["tests"]):
                continue
            if entry.get("message") and entry["message"] not in message:
                continue
            entry["used"] += 1
            return entry["reason"]
        return None


def hf_home(dest: Path) -> Path:
    """An HF cache (hub layout) holding tests/upstream/models/<org>/<name>/config.json."""
    hub = dest / "hub"
    for config in sorted(MODELS.glob("*/*/config.json")):
        org, name = config.parent.parent.name, config.parent.name
        repo = hub / f"models--{org}--{name}"
        snapshot = repo / "snapshots" / SNAPSHOT_REV
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(SNAPSHOT_REV)
        shutil.copy2(config, snapshot / "config.json")
    return dest


def series_edited_tests(tree: Path, root: str, files: list[str]) -> list[str]:
    """Those of ``files`` that the series edits (differ between root and the working tree)."""
    out = subprocess.run(["git", "-C", str(tree), "diff", "--name-only", root, "--", *files],
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if f in out]


def prepare(tree: Path, work: Path, python: str, names: list[str]) -> tuple[dict, Path]:
    """The test trees ``names`` (pristine, patched, series) and the HF cache under ``work``."""
    if not (tree / ".git").exists():
        raise SetupError(f"{tree} is not a build tree (run make apply)")
    try:
        so_dir = cpu_engine.compiled_libs(python)
    except cpu_engine.CpuEngineError as exc:
        raise SetupError(str(exc)) from exc
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = cpu_engine.root_commit(tree)
    trees = {}
    for name in {"pristine", "patched"} & set(names):
        # The pristine or the patched package, with upstream's tests beside it.
        trees[name] = cpu_engine.export_tree(tree, work / name, so_dir, rev=root if name == "pristine" else None,
                                             paths=("vllm",), python=python)
        _archive(tree, root, ("tests", "pyproject.toml"), trees[name])
    if "series" in names:
        # The patched package with the series' own versions of upstream's test files.
        trees["series"] = cpu_engine.export_tree(tree, work / "series", so_dir, rev=None,
                                                 paths=("vllm", "tests", "pyproject.toml"), python=python)
    return trees, hf_home(work / "hf_home")


def files_hash(files: list[str]) -> str:
    """What the record depends on in the toml: the selected test files."""
    return hashlib.sha256("\n".join(files).encode()).hexdigest()


def pin_key() -> dict[str, str]:
    """The pin a pristine record belongs to (pins.env, read through the series tooling)."""
    pins = cpu_engine.load_pins(ROOT)
    return {"vllm_version": pins["VLLM_VERSION"], "sdist_sha256": pins["VLLM_SDIST_SHA256"]}


def load_record(path: Path, files: list[str]) -> dict:
    """The committed pristine run, refused when it is not this pin's or this selection's."""
    if not path.is_file():
        raise SetupError(f"no pristine record {path}: run `{RECORD_COMMAND}` (several minutes)")
    record = json.loads(path.read_text())
    want = {**pin_key(), "files_sha256": files_hash(files)}
    stale = [f"{k}: record {record.get(k)!r}, now {v!r}" for k, v in want.items() if record.get(k) != v]
    if stale:
        raise SetupError(f"{path} is not the pristine run of this pin and test selection ("
                         + "; ".join(stale) + f"): regenerate it with `{RECORD_COMMAND}`")
    return record


def _archive(tree: Path, rev: str, paths: tuple[str, ...], dest: Path) -> None:
    data = subprocess.run(["git", "-C", str(tree), "archive", rev, *paths],
                          capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=data, check=True)


def run_pytest(name: str, tree: Path, files: list[str], python: str, hf: Path, timeout_s: float) -> dict:
    """pytest on ``files`` in ``tree`` (log in WORK/logs/); the upstream_report plugin's report."""
    report, log = WORK / f"{name}.json", WORK / "logs" / f"{name}.log"
    env = cpu_engine.engine_env(f"{tree}{os.pathsep}{HERE}", HF_HOME=str(hf), UPSTREAM_REPORT=str(report),
                                OMP_NUM_THREADS="2", PYTHONDONTWRITEBYTECODE="1")
    env.pop("HF_HUB_CACHE", None)
    cmd = [python, "-m", "pytest", "-q", "-p", "upstream_report", "-p", "no:cacheprovider",
           "-o", "addopts=", "--rootdir", str(tree), *files]
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SetupError(f"{name}: pytest ran past {timeout_s:.0f} s (log {log})") from None
    if not report.is_file():
        raise SetupError(f"{name}: pytest exited {proc.returncode} without a report (log {log}):\n"
                         + log.read_text()[-3000:])
    print(f"[test-upstream] {name}: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads(report.read_text())


def counts(result: dict) -> dict[str, int]:
    out = dict(Counter(result["tests"].values()))
    if result["collect_errors"]:
        out["collect errors"] = len(result["collect_errors"])
    return out


def compare(pristine: dict, patched: dict, series: dict | None,
            exp: Expectations) -> tuple[list[str], dict]:
    """(problems, summary) of the three runs against the expectations."""
    problems: list[str] = []
    a, b = pristine["tests"], patched["tests"]
    diffs = {t: (a.get(t, "absent"), b.get(t, "absent")) for t in sorted(a.keys() | b.keys())
             if a.get(t) != b.get(t)}
    for test, (was, now) in diffs.items():
        entry = exp.differs.get(test)
        if entry is None:
            why = patched["messages"].get(test) or pristine["messages"].get(test) or ""
            problems.append(f"unexpected difference: {test}: pristine {was}, patched {now}"
                            + (f"\n      {why}" if why else ""))
        elif (entry["pristine"], entry["patched"]) != (was, now):
            problems.append(f"{test}: pristine {was}, patched {now}; the expectations say "
                            f"pristine {entry['pristine']}, patched {entry['patched']}")
    for test, entry in exp.differs.items():
        if test not in diffs:
            problems.append(f"expected difference did not happen: {test} ({entry['patch']}): "
                            f"pristine {a.get(test, 'absent')}, patched {b.get(test, 'absent')}")
    environment: dict[str, list[str]] = {}
    both = [t for t in a if a[t] in FAILED and b.get(t) in FAILED]
    collect = sorted(pristine["collect_errors"].keys() | patched["collect_errors"].keys())
    for test in both + collect:
        msg = pristine["messages"].get(test) or pristine["collect_errors"].get(test) or ""
        reason = exp.environment_reason(test, msg)
        if reason is None:
            problems.append(f"fails on both trees and is not listed under [[environment]]: {test}\n      {msg}")
        else:
            environment.setdefault(reason, []).append(test)
    if series is not None:
        for test, outcome in sorted(series["tests"].items()):
            msg = series["messages"].get(test, "")
            if outcome in FAILED + ("xpassed",) and exp.environment_reason(test, msg) is None:
                problems.append(f"series' own test {outcome}: {test}\n      {msg}")
        for path, msg in series["collect_errors"].items():
            if exp.environment_reason(path, msg) is None:
                problems.append(f"series' own test file does not collect: {path}: {msg}")
    stale = [e["reason"] for e in exp.environment if not e["used"]]
    summary = {"differences": {t: list(v) for t, v in diffs.items()},
               "environment": {r: len(ts) for r, ts in environment.items()},
               "unused_environment_entries": stale}
    return problems, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=ROOT / "build" / "vllm")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="the environment the tests run in (default .venv/bin/python)")
    p.add_argument("--record", action="store_true",
                   help=f"run the pristine tree only and write {RECORD.relative_to(ROOT)}")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        exp = Expectations.load(CONFIG)
        files = exp.files
        record = None if args.record else load_record(RECORD, exp.files)
        # A relative --python (make passes .venv/bin/python) must survive the
        # runs' cwd, which is each tree.
        if os.sep in args.python:
            args.python = str(Path(args.python).absolute())  # not resolve(): a venv python may be a symlink
        edited = [] if args.record else series_edited_tests(
            args.tree, cpu_engine.root_commit(args.tree), files)
        names = ["pristine"] if args.record else ["patched"] + (["series"] if edited else [])
        trees, hf = prepare(args.tree.resolve(), WORK, args.python, names)
        print(f"[test-upstream] {len(files)} upstream test files on {names[0]}"
              + (f", then the {len(edited)} the series edits" if edited else "")
              + f"; logs in {WORK / 'logs'}", flush=True)
        results = {name: run_pytest(name, trees[name], edited if name == "series" else files, args.python,
                                    hf, exp.timeout_s) for name in names}
    except (SetupError, subprocess.CalledProcessError) as exc:
        print(f"error: test-upstream: {exc}", file=sys.stderr)
        return 2
    if args.record:
        result = results["pristine"]
        RECORD.write_text(json.dumps(
            {"command": RECORD_COMMAND, **pin_key(), "files_sha256": files_hash(exp.files),
             **{key: result[key] for key in ("tests", "messages", "collect_errors")}},
            indent=0, sort_keys=True) + "\n")
        print(f"[test-upstream] wrote {RECORD}: pristine {counts(result)}")
        return 0
    problems, summary = compare(record, results["patched"], results.get("series"), exp)
    for name, result in {f"pristine (recorded, {RECORD.name})": record, **results}.items():
        print(f"[test-upstream] {name}: {counts(result)}")
    for test, (was, now) in summary["differences"].items():
        patch = exp.differs.get(test, {}).get("patch", "NOT EXPECTED")
        print(f"  differs: {test}: pristine {was}, patched {now} -- {patch}")
    for reason, n in summary["environment"].items():
        print(f"  fails on both trees, not counted ({n}): {reason}")
    for reason in summary["unused_environment_entries"]:
        print(f"  note: no test matched the [[environment]] entry {reason!r}")
    elapsed = time.monotonic() - t0
    if problems:
        print(f"[test-upstream] FAILED ({len(problems)} problem(s), {elapsed:.0f} s):", file=sys.stderr)
        print("\n".join(f"  - {problem}" for problem in problems), file=sys.stderr)
        return 1
    print(f"[test-upstream] OK: {len(summary['differences'])} differences, all expected ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
