"""make report turns pytest-benchmark JSON into tables, plots and the README section."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_report  # noqa: E402


def _case(kernel, case, nbytes, ours, base, copy):
    return {"name": f"test_{case}", "extra_info": {
        "kernel": kernel, "case": case, "nbytes": nbytes, "graph": False, "shapes": {},
        "results": {"ours": {"us": ours, "gbps": nbytes / ours / 1e3},
                    "baseline": {"us": base, "gbps": nbytes / base / 1e3},
                    "copy": {"us": copy, "gbps": nbytes / copy / 1e3}},
        "speedup": base / ours, "frac_copy": copy / ours}}


def _write(path, when, commit, cases):
    path.write_text(json.dumps({"datetime": when, "machine_info": {"series": {
        "device": "NVIDIA H200", "commit": commit, "torch": "2.11", "triton": "3.6"}},
        "benchmarks": cases}))


def test_report_uses_newest_file_and_writes_table_and_plot(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "old.json", "2026-11-01T00:00:00", "aaa",
           [_case("fetch_kv", "h8_32k", 1 << 27, 100.0, 200.0, 90.0)])
    _write(results / "new.json", "2026-11-30T00:00:00", "bbb",
           [_case("fetch_kv", "h8_32k", 1 << 27, 40.0, 100.0, 36.0),
            _case("fetch_kv", "h1_4k", 1 << 20, 5.0, 10.0, 4.0)])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench_report.BEGIN}\nstale\n{bench_report.END}\noutro\n")
    details = tmp_path / "RESULTS.md"
    assert bench_report.main(["--results", str(results), "--readme", str(readme),
                              "--details", str(details)]) == 0
    text = readme.read_text()
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| fetch_kv | NVIDIA H200 | 2 | 2.00–2.50× | 80–90% | [`new.json`]" in text
    table = details.read_text()
    assert "| h8_32k | 40.0 | 100.0 | 36.0 | 2.50× |" in table and "commit bbb" in table
    assert "aaa" not in table
    png = results / "plots" / "fetch_kv-nvidia-h200.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_report_reads_only_committed_results(tmp_path):
    """A file a benchmark run just wrote, or one edited since its commit, does not reach the README."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    results = tmp_path / "results"
    results.mkdir()
    _write(results / "committed.json", "2026-11-01T00:00:00", "aaa",
           [_case("fetch_kv", "h8_32k", 1 << 27, 100.0, 200.0, 90.0)])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench_report.BEGIN}\nstale\n{bench_report.END}\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "results")
    _write(results / "untracked.json", "2026-11-30T00:00:00", "bbb",
           [_case("fetch_kv", "h8_32k", 1 << 27, 10.0, 200.0, 9.0)])
    _write(results / "committed.json", "2026-11-01T00:00:00", "aaa",          # edited after its commit
           [_case("fetch_kv", "h8_32k", 1 << 27, 50.0, 200.0, 45.0)])
    assert bench_report.main(["--results", str(results), "--readme", str(readme),
                              "--details", str(tmp_path / "RESULTS.md")]) == 0
    text = readme.read_text()
    assert "[`committed.json`]" in text and "untracked.json" not in text
    assert "| fetch_kv | NVIDIA H200 | 1 | 2.00–2.00× | 90–90% |" in text    # HEAD's numbers, not the edit
