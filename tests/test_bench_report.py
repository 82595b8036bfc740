"""make report: every figure shown, generated from committed, clean result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_report  # noqa: E402
from seriestool import results  # noqa: E402

ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1"}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env=ENV).stdout.strip()


def fetch_case(heads: int, speedup: float, frac: float, mode: str = "cold") -> dict:
    ours = 10.0
    return {"kernel": "fetch_kv", "case": f"nhd_bf16_h{heads}_d128_b16_32k", "mode": mode,
            "buffer_sets": 4 if mode == "cold" else 1, "graph": True, "nbytes": heads << 24,
            "shapes": {"tokens": 32768, "layout": "NHD", "head_size": 128, "num_kv_heads": heads,
                       "cache_dtype": "torch.bfloat16", "out_dtype": "torch.bfloat16"},
            "results": {"ours": {"us": ours, "gbps": 1.0}, "baseline": {"us": ours * speedup},
                        "copy": {"us": ours * frac}},
            "speedup": speedup, "frac_copy": frac}


def paged_case(reqs: int, context: int, new: int, ours: float, base: float, fa2: float) -> dict:
    return {"kernel": "paged_context", "case": f"r{reqs}_ctx{context // 1024}k_new{new}", "mode": "cold",
            "buffer_sets": 2, "graph": True, "nbytes": 1 << 26,
            "shapes": {"requests": reqs, "context": context, "new_tokens": new},
            "results": {"ours": {"us": ours}, "baseline": {"us": base}, "gather_fa2": {"us": fa2},
                        "gather_only": {"us": base / 10}, "copy": {"us": 1.0}},
            "speedup": base / ours, "frac_copy": 1.0 / ours}


def write(root: Path, name: str, when: str, commit: str, cases: list[dict], *, dirty=False,
          note: str | None = None, seal: bool = True) -> dict:
    series = {"device": "NVIDIA H200", "commit": commit, "dirty": dirty, "torch": "2.11", "triton": "3.6",
              "cuda": "13.0", "hip": None}
    if note:
        series["commit_note"] = note
    data = {"datetime": when, "machine_info": {"series": series},
            "benchmarks": [{"name": f"test_{c['case']}", "extra_info": c} for c in cases]}
    data = results.seal(data) if seal else data
    path = root / "benchmarks" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


README = """# Series

Intro without figures.

<!-- gen:status -->
stale
<!-- /gen:status -->
"""

DOCS = """# Benchmarks

<!-- gen:bench-summary -->
old table
<!-- /gen:bench-summary -->
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "series"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "0250-paged.patch").write_text(
        'Subject: x\n---\n+        os.getenv("VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS", "512")\n')
    (root / "README.md").write_text(README)
    (root / "docs").mkdir()
    (root / "docs" / "benchmarks.md").write_text(DOCS)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "series")
    commit = git(root, "rev-parse", "HEAD")
    write(root, "20261101-old.json", "2026-11-01T00:00:00", commit,
          [fetch_case(8, 1.5, 0.5)])
    write(root, "20261120-new.json", "2026-11-20T00:00:00", commit,
          [fetch_case(1, 2.04, 0.894), fetch_case(4, 2.27, 0.90), fetch_case(8, 2.35, 0.901)]
          + [paged_case(1, 8192, 128, 70.0, 100.0, 250.0), paged_case(4, 32768, 128, 800.0, 950.0, 1100.0),
             paged_case(1, 8192, 1024, 460.0, 520.0, 480.0)])
    # Newer files that may not back claims:
    write(root, "20261121-dirty.json", "2026-11-21T00:00:00", commit, [fetch_case(1, 7.0, 0.7)], dirty=True)
    write(root, "20261122-noted.json", "2026-11-22T00:00:00", commit, [fetch_case(1, 7.1, 0.7)],
          note="corrected after the run")
    edited = write(root, "20261123-edited.json", "2026-11-23T00:00:00", commit, [fetch_case(1, 7.2, 0.7)])
    edited["benchmarks"][0]["extra_info"]["speedup"] = 7.3
    (root / "benchmarks" / "results" / "20261123-edited.json").write_text(json.dumps(edited))
    write(root, "20261124-elsewhere.json", "2026-11-24T00:00:00", "1" * 40, [fetch_case(1, 7.4, 0.7)])
    git(root, "add", "-A")
    git(root, "commit", "-qm", "results")
    write(root, "20261130-uncommitted.json", "2026-11-30T00:00:00", commit, [fetch_case(1, 7.5, 0.7)])
    return root


def test_report_writes_every_region_from_clean_committed_results(repo, capsys):
    assert bench_report.main(["--root", str(repo)]) == 0
    out = capsys.readouterr().out
    readme = (repo / "README.md").read_text()
    assert "stale" not in readme
    status = readme.split("<!-- gen:status -->\n", 1)[1].split("\n<!-- /gen:status -->", 1)[0]
    assert status.splitlines()[0] == "| topic | what changes | checked on | headline result | details |"
    row = next(ln for ln in status.splitlines() if ln.startswith("| `fetch-kv` |"))
    assert "CPU tier; NVIDIA H200 (benchmarks); ROCm: not run" in row
    # Rounded from the newest clean file: speedups 2.04/2.27/2.35, copy 0.894/0.90/0.901.
    assert "2.0–2.4× upstream's gather, 89–90% of copy (32K tokens, cold L2)" in row
    # Routed (<= 512 new tokens): ours 70/800 vs gather+FA2 250/1100 and gather+same 100/950.
    assert "≤ 512 new tokens: 1.4–3.6× gather + FA2, 1.2–1.4× gather + same kernel" in row
    assert "[fetch_kv](benchmarks/RESULTS.md#fetch_kv-on-nvidia-h200)" in row
    assert "no clean result yet" in next(ln for ln in status.splitlines() if "`mla-fusion`" in ln)
    docs = (repo / "docs" / "benchmarks.md").read_text()
    assert "old table" not in docs
    assert "[`20261120-new.json`](../benchmarks/results/20261120-new.json)" in docs
    details = (repo / "benchmarks" / "RESULTS.md").read_text()
    for name, reason in (("20261121-dirty.json", "from a dirty tree"),
                         ("20261122-noted.json", "its commit was edited after the run"),
                         ("20261123-edited.json", "edited after the run (series_seal does not match"),
                         ("20261124-elsewhere.json", f"series commit {'1' * 40} is not in this repository")):
        assert f"- `benchmarks/results/{name}`: {reason}" in details
        assert f"benchmarks/results/{name}: not used ({reason}" in out
    assert "uncommitted" not in details and "7." not in details
    assert ("1.4–3.6× the speed of gather + FlashAttention-2 and 1.2–1.4× that of gather + the same "
            "Triton kernel, 1 of 2 cases at ≥ 1.25× (8K–32K cached tokens") in details
    assert "## fetch_kv on NVIDIA H200" in details and "| nhd_bf16_h8_d128_b16_32k | cold ×4 |" in details
    assert "| r1_ctx8k_new128 | cold ×2 | 70.0 | 100.0 | 250.0 | 10.0 | 1.0 | 1.43× | 3.57× |" in details
    assert "From `benchmarks/results/20261120-new.json`" in details and "1.50×" not in details
    # Run again: nothing changes (the regions are rewritten in place).
    before = {p: p.read_text() for p in (repo / "README.md", repo / "docs" / "benchmarks.md")}
    assert bench_report.main(["--root", str(repo)]) == 0
    assert {p: p.read_text() for p in before} == before


def test_an_unknown_region_stops_the_report_before_writing(repo, capsys):
    readme = repo / "README.md"
    readme.write_text(README + "<!-- gen:tables -->\n<!-- /gen:tables -->\n")
    assert bench_report.main(["--root", str(repo)]) == 2
    assert "unknown generated block 'tables'" in capsys.readouterr().err
    assert "stale" in readme.read_text() and not (repo / "benchmarks" / "RESULTS.md").exists()


def test_hand_typed_figures_are_warned_about_and_strict_fails(repo, capsys):
    readme = repo / "README.md"
    readme.write_text(README.replace("Intro without figures.", "Intro: fetch_kv is 2.3x upstream."))
    assert bench_report.main(["--root", str(repo)]) == 0
    assert "README.md:3: hand-typed figure '2.3x'" in capsys.readouterr().out
    assert bench_report.main(["--root", str(repo), "--strict"]) == 1
