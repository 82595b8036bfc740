"""The Ray sweep: config expansion and its errors (no Ray); a local Ray (2 CPUs, token auth
off) running fake cells (ok, failing, a dying worker, one no node can hold), resume, the
report; an e2e cell running scripts/e2e.py with stand-in installs (tests/e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import e2e_standin  # noqa: E402
from sweep import config, run  # noqa: E402
from sweep.config import SweepError  # noqa: E402
from sweep.run import run_cell  # noqa: E402

YAML = """
name: demo
installs: {upstream: /opt/up/bin/python, patched: docker exec vllm-patched python3}
defaults: {gpus: 1, env: {VLLM_ROCM_USE_AITER: "1"}}
matrix:
  - kind: e2e
    recipe: throughput
    model: org/m
    axes:
      lengths: ["2048/16", "8192/16"]
      env: [{}, {VLLM_ROCM_USE_AITER_MHA: "0"}]
  - kind: fake
    axes:
      size: [{size: 1, gpus: 0.5}, {size: 2, gpus: 0}]
"""

def _load(tmp_path: Path, text: str):
    (tmp_path / "demo.yaml").write_text(text)
    return config.load(tmp_path / "demo.yaml")


def test_matrix_expansion_and_keys(tmp_path):
    _, cells = _load(tmp_path, YAML)
    assert [c["label"] for c in cells] == [
        "e2e recipe=throughput model=org/m lengths=2048/16 VLLM_ROCM_USE_AITER=1",
        "e2e recipe=throughput model=org/m lengths=2048/16 VLLM_ROCM_USE_AITER=1 "
        "VLLM_ROCM_USE_AITER_MHA=0",
        "e2e recipe=throughput model=org/m lengths=8192/16 VLLM_ROCM_USE_AITER=1",
        "e2e recipe=throughput model=org/m lengths=8192/16 VLLM_ROCM_USE_AITER=1 "
        "VLLM_ROCM_USE_AITER_MHA=0",
        "fake size=1 VLLM_ROCM_USE_AITER=1", "fake size=2 VLLM_ROCM_USE_AITER=1"]
    assert [(c["gpus"], c["params"]) for c in cells[4:]] == [(0.5, {"size": 1}), (0, {"size": 2})]
    assert len({c["key"] for c in cells}) == 6
    # The key is what defines the result: not the timeout, not the order of the keys.
    reordered = YAML.replace("defaults: {gpus: 1,", "defaults: {timeout_s: 9, gpus: 1,").replace(
        "recipe: throughput\n    model: org/m", "model: org/m\n    recipe: throughput")
    _, again = _load(tmp_path, reordered)
    assert [c["key"] for c in again] == [c["key"] for c in cells]


@pytest.mark.parametrize("text, message", [
    ("matrix:\n  - kind: nope\n", "kind must be fake or e2e"),
    ("matrix:\n  - kind: e2e\n    recipe: mixed\n    model: m\n", "run the upstream and"),
    ("matrix:\n  - kind: e2e\n    model: m\n", "needs `recipe` and `model`"),
    ("matrix:\n  - kind: fake\n  - kind: fake\n", "in the matrix twice"),
    ("matrix:\n  - kind: fake\n    gpus: -1\n", "gpus must be a number >= 0"),
    ("matrix:\n  - kind: fake\n    axes: {size: 3}\n", "must be a non-empty list"),
    ("matrix:\n  - kind: fake\n    env: [a]\n", "env must map variable names"),
    ("name: x/y\nmatrix:\n  - kind: fake\n", "plain folder name"),
    ("matrx: []\n", "unknown top-level key"),
    ("matrix: [a: b\n", "ParserError"),
])
def test_config_errors_are_clear(tmp_path, text, message):
    with pytest.raises(SweepError, match=message):
        _load(tmp_path, text)


def test_make_sweep_then_make_sweep_report(tmp_path):
    """The make verbs on ci/sweeps/smoke-fake.yaml: a local Ray of their own (this test runs
    before the module's Ray starts); one cell fails on purpose, so make says Error 1."""
    pytest.importorskip("ray", reason="the sweep needs ray in the venv")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = tmp_path / "smoke"
    sweep = subprocess.run(["make", "sweep", "CONFIG=ci/sweeps/smoke-fake.yaml",
                            f"SWEEP_OUT={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert sweep.returncode == 2 and "[sweep] 3 ok, 1 failed" in sweep.stdout, sweep.stderr
    report = subprocess.run(["make", "sweep-report", f"DIR={out}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0
    assert "| fake sleep_s=1 size=4 | ok | tokens_per_second=100 | fake |" in report.stdout


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="the sweep's Ray tests need ray in the venv")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns token auth on for a local Ray
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env=run.RUNTIME_ENV)
    yield
    ray.shutdown()
    os.environ.pop("RAY_AUTH_MODE")


def test_sweep_records_every_cell_resumes_and_reports(local_ray, tmp_path):
    data = {"name": "fakes", "defaults": {"cpus": 1}, "matrix": [
        {"kind": "fake", "numbers": {"tokens_per_s": 125.0}, "axes": {"size": [1, 2]}},
        {"kind": "fake", "raise": "boom: this cell always fails"},
        {"kind": "fake", "crash": 1},
        {"kind": "fake", "gpus": 1}]}
    cells = config.expand(data)
    out = tmp_path / "out"
    assert run.run(data, cells, out, log=lambda _: None) == {
        "cells": 5, "skipped": 0, "ok": 2, "error": 3}
    records = {r["label"]: r for r in run.records(out).values()}
    assert records["fake size=2"]["metrics"] == {"tokens_per_s": 125.0}
    boom = records["fake raise=boom: this cell always fails"]["error"]
    assert boom["message"] == "boom: this cell always fails" and "run_fake" in boom["traceback"]
    assert "worker" in str(records["fake crash=1"]["error"]).lower()
    assert "no node of the cluster has 1 GPU(s)" in records["fake"]["error"]["message"]
    ok_files = {p: p.read_bytes() for p in out.glob("fake-size*.json")}
    assert run.run(data, cells, out, log=lambda _: None) == {   # the failed cells run again
        "cells": 5, "skipped": 2, "ok": 0, "error": 3}
    assert all(p.read_bytes() == text for p, text in ok_files.items())   # not run again
    assert len(list(out.glob("*.json"))) == 6        # five cells and sweep.json
    report = run.render(out)
    assert "| fake size=1 | ok | tokens_per_s=125 | fake |" in report
    assert "| fake raise=boom: this cell always fails | error | RuntimeError: boom" in report


def test_e2e_cell_runs_both_installs_and_keeps_the_ratios(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    installs = {"upstream": e2e_standin.install(tmp_path, rate=2.0, acc=0.8),
                "patched": e2e_standin.install(tmp_path, rate=3.0, acc=0.8)}
    [cell] = config.expand({"name": "t", "installs": installs, "matrix": [
        {"kind": "e2e", "recipe": "throughput", "model": "org/m", "lengths": ["128/4", "64/4"],
         "num_prompts": 8, "timeout_s": 60}]})
    record = run_cell(cell, "abc", installs)
    assert record["status"] == "ok", record.get("error")
    assert record["metrics"]["128/4 requests_per_second ratio"] == pytest.approx(1.5)
    assert record["metrics"]["64/4 requests_per_second ratio"] == pytest.approx(1.5)
    assert record["device"] == "Stand-in MI300X"
    assert record["e2e"]["benchmarks"][0]["extra_info"]["params"]["num_prompts"] == 8
    record = run_cell(cell, "abc", {**installs, "patched": "/no/such/python"})
    assert record["status"] == "error" and "e2e preflight failed" in record["error"]["message"]
