"""The sweep on a local Ray (2 CPUs, token auth off): fake cells, a failing cell, a worker that
dies, resume, the merged report.  Ray starts once for the module; the first sweep runs once and
the tests read its folder in order."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from sweep import config as sweep_config  # noqa: E402
from sweep import driver  # noqa: E402
from sweep.results import MANIFEST, REPORT, index  # noqa: E402


def _config(tmp: Path) -> sweep_config.SweepConfig:
    runs = tmp / "runs.log"
    return sweep_config.parse({
        "name": "fake-matrix",
        "defaults": {"cpus": 1, "timeout_s": 60},
        "matrix": [
            {"kind": "fake", "touch": str(runs), "sleep_s": 0.2,
             "numbers": {"upstream": {"tokens_per_s": 100.0}, "patched": {"tokens_per_s": 125.0}},
             "axes": {"size": [1, 2], "install": ["upstream", "patched"]}},
            {"kind": "fake", "raise": "boom: this cell always fails"},
            {"kind": "fake", "raise_unless_exists": str(tmp / "marker"),
             "numbers": {"tokens_per_s": 7.0}},
            {"kind": "fake", "crash": 3},
        ]})


@pytest.fixture(scope="module")
def local_ray():
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    # Ray 2.60 turns token auth on for a new local cluster unless RAY_AUTH_MODE says otherwise.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    driver.connect(None, num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def first_run(local_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    cfg = _config(tmp)
    out = tmp / "results"
    lines: list[str] = []
    summary = driver.run_sweep(cfg, out, log=lines.append)
    return {"tmp": tmp, "cfg": cfg, "out": out, "summary": summary, "log": lines}


def _records(out: Path) -> dict[str, dict]:
    return {rec["label"]: rec for _, rec in index(out).values()}


def test_every_cell_is_recorded_and_failures_do_not_lose_the_others(first_run):
    summary, out = first_run["summary"], first_run["out"]
    assert summary == {"cells": 7, "skipped": 0, "ok": 4, "error": 3, "out": str(out)}
    records = _records(out)
    assert len(records) == 7
    assert (out / MANIFEST).is_file() and (out / REPORT).is_file()
    ok = [r for r in records.values() if r["status"] == "ok"]
    assert {r["cell"]["install"] for r in ok} == {"upstream", "patched"}
    assert any(line.startswith("[sweep] 7/7") for line in first_run["log"])


def test_failing_cell_keeps_error_and_traceback(first_run):
    records = _records(first_run["out"])
    boom = next(r for r in records.values() if "raise" in r["cell"]["params"])
    assert boom["status"] == "error" and boom["error"]["type"] == "RuntimeError"
    assert boom["error"]["message"] == "boom: this cell always fails"
    assert "run_fake" in boom["error"]["traceback"]
    crash = next(r for r in records.values() if "crash" in r["cell"]["params"])
    assert crash["status"] == "error"
    assert "Worker" in crash["error"]["type"] or "worker" in crash["error"]["message"].lower()


def test_cell_file_has_the_bench_shape(first_run):
    record = next(r for r in _records(first_run["out"]).values()
                  if r["cell"]["install"] == "patched")
    series = record["machine_info"]["series"]
    assert series["device"] == "fake" and series["commit"]
    info = record["benchmarks"][0]["extra_info"]
    assert info["results"] == {"tokens_per_s": 125.0} and record["metrics"] == info["results"]
    assert record["key"] in next(p.name for p in first_run["out"].glob(f"*{record['key']}.json"))
    manifest = json.loads((first_run["out"] / MANIFEST).read_text())
    assert [c["key"] for c in manifest["cells"]] == [c.key for c in first_run["cfg"].cells]


def test_resume_skips_finished_cells_and_retries_failed_ones(first_run):
    tmp, out, cfg = first_run["tmp"], first_run["out"], first_run["cfg"]
    runs = tmp / "runs.log"
    assert len(runs.read_text().splitlines()) == 4
    ok_files = {p: p.read_bytes() for p in out.glob("*.json")
                if json.loads(p.read_text()).get("status") == "ok"}
    (tmp / "marker").touch()                      # the flaky cell succeeds from now on
    summary = driver.run_sweep(cfg, out, log=lambda _line: None)
    assert summary["skipped"] == 4 and summary["ok"] == 1 and summary["error"] == 2
    assert len(runs.read_text().splitlines()) == 4  # finished cells did not run again
    assert all(p.read_bytes() == data for p, data in ok_files.items())
    records = _records(out)
    assert len(records) == 7 and len(list(out.glob("*.json"))) == 8  # 7 cells + manifest
    flaky = next(r for r in records.values() if "raise_unless_exists" in r["cell"]["params"])
    assert flaky["status"] == "ok" and flaky["metrics"] == {"tokens_per_s": 7.0}


def test_merged_report(first_run):
    report = (first_run["out"] / REPORT).read_text()
    assert "# Sweep `fake-matrix`" in report
    assert "cells: 7 — ok 5, failed 2, not run 0" in report
    assert "## upstream vs patched" in report
    row = "| tokens_per_s | 100.0 | 125.0 | 1.25 |"
    pairs = [line for line in report.splitlines() if row in line]
    assert len(pairs) == 2 and "size=1" in pairs[0] and "size=2" in pairs[1]
    assert "## failures" in report and "RuntimeError: boom: this cell always fails" in report
    assert "nothing is estimated" in report
