"""The Makefile's verbs: narrow test runs, GPU verbs without torch, output folders."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Not the variables of a make that runs this test (`make test TESTS=...` hands them down).
    base = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TESTS",
                                                              "PYTEST_ARGS", "BENCH_OUT", "SWEEP_OUT")}
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=120)


def _recipe_line(dry_run: str, needle: str) -> str:
    return next(line for line in dry_run.splitlines() if needle in line)


def test_make_test_runs_only_the_named_folders():
    out = _make("-n", "test", "TESTS=tests/series tests/order", "PYTEST_ARGS=-x -k rebase").stdout
    line = _recipe_line(out, "-m pytest")
    assert line.endswith("-m pytest -q -p no:cacheprovider tests/series tests/order -x -k rebase")
    default = _recipe_line(_make("-n", "test").stdout, "-m pytest")
    assert default.endswith("-m pytest -q -p no:cacheprovider tests ")


def test_gpu_verbs_without_torch_say_what_is_missing():
    # -S: no site-packages, so no torch, triton or pytest, on any machine.
    for verb in ("test-gpu", "bench", "test-gpu-backend", "test-gpu-mla"):
        proc = _make(verb, f"GPU_PYTHON={sys.executable} -S")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        ours = [ln for ln in proc.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\* ", ln)]
        assert len(ours) == 1 and ours[0].startswith(f"make {verb}: ") and "lacks torch, triton, pytest" in ours[0]
        assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_result_writing_verbs_default_to_ignored_folders():
    bench_host = _recipe_line(_make("-n", "bench-host").stdout, "run_bench.py")
    assert "--out build/results " in bench_host
    assert "--out keep/here " in _recipe_line(_make("-n", "bench-host", "BENCH_OUT=keep/here").stdout, "run_bench.py")
    sweep = _recipe_line(_make("-n", "sweep", "CONFIG=ci/sweeps/smoke-fake.yaml").stdout, "sweep.py run")
    assert "--out build/sweeps/smoke-fake " in sweep
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "build/results/x.json",
                              "build/sweeps/smoke-fake/x.json", "build/rebase-0.32.0.md"],
                             capture_output=True, text=True)
    assert len(ignored.stdout.splitlines()) == 3


def test_make_clean_removes_build_outputs_and_keeps_the_rest(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for folder in ("build/vllm", "dist/fetch-kv", ".venv/bin", "patches", "scripts"):
        (tmp_path / folder).mkdir(parents=True)
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(tmp_path), "clean"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "build").exists() and not (tmp_path / "dist").exists()
    assert all((tmp_path / f).is_dir() for f in (".venv/bin", "patches", "scripts"))


def test_make_bench_host_writes_a_sealed_result_where_asked(tmp_path):
    proc = _make("bench-host", f"BENCH_OUT={tmp_path}",
                 "PYTEST_ARGS=-k 'cpu_order_host_cost and 8' --benchmark-max-time=0.01")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = tmp_path.glob("*.json")
    data = json.loads(result.read_text())
    names = sorted(b["name"] for b in data["benchmarks"])
    assert len(names) == 2 and all(n.startswith("test_cpu_order_host_cost[") for n in names)
    assert data["machine_info"]["series"]["run"]["pytest_exit"] == 0
    assert (tmp_path / "logs" / f"{result.stem}.bench.log").is_file()
