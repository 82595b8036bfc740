"""make check: patch headers carry no figure, name only committed result files, stay short."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import figures, lint  # noqa: E402
from seriestool.buildtree import Layout  # noqa: E402

FIGURES = [  # (text, the figures it carries)
    ("at 32K tokens it is 2.28-3.51x upstream", ["2.28-3.51x"]),
    ("3.49–4.82× at 1 x 128 new tokens, about 45% of a copy", ["3.49–4.82×", "45%"]),
    ("17µs, 1.5ms and 40 ns; cut off by a 170 s limit", ["17µs", "1.5ms", "40 ns", "170 s"]),
    ("runs at 5.4 TB/s, 120 tok/s, worst error 3 ulp", ["5.4 TB/s", "120 tok/s", "3 ulp"]),
    ("457 passed, 110 skipped; test_scheduler.py: 215 pass", ["457 passed", "110 skipped", "215 pass"]),
    ("MRv2 moves 46 -> 0, V1 swaps 43 → 42", ["46 -> 0", "43 → 42"]),
]
NOT_FIGURES = [
    "vllm#25763 (merged v0.11.1), vLLM 0.33.0, AITER v0.1.26 (v0.1.20-46, snapshot e4048607)",
    "H200 (torch 2.11, CUDA 13, triton 3.6), fp8 e4m3 / e5m2, gfx942, cp312 wheels, sm_90",
    "bf16, D 128, block 16/32, GQA 8/4, 32K tokens, 2,000 random mixes, a 4x4 tile, [Hq, T]",
    "a cache past 2**31 elements, >= 32,768 blocks; split 1 decode / 0 extends / 2 prefills",
]


@pytest.mark.parametrize("text,expected", FIGURES, ids=[t for t, _ in FIGURES])
def test_figures_are_found(text, expected):
    assert [f.text for f in figures.find_figures(text)] == expected


@pytest.mark.parametrize("text", NOT_FIGURES)
def test_identifiers_shapes_and_sizes_are_not_figures(text):
    assert figures.find_figures(text) == []


def _set_tested_on(fake_series, name: str, text: str) -> None:
    path = fake_series.patches / name
    path.write_text(path.read_text().replace("Tested on: CPU (fake tree)", f"Tested on: {text}"))


def test_header_figures_uncommitted_result_files_and_long_headers_are_findings(fake_series):
    fs = fake_series
    layout = Layout(root=fs.root, build=fs.build)
    assert lint.lint_series_files(layout) == []
    results = fs.root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "run.json").write_text("{}\n")
    (results / "untracked.json").write_text("{}\n")
    fs.git("add", "benchmarks/results/run.json", cwd=fs.root)
    fs.git("commit", "-qm", "a result", cwd=fs.root)
    _set_tested_on(fs, "0001-add-series-flag.patch", "CPU; H200: 2.28-3.51x upstream at 92-94% of copy\n"
                   "  (`benchmarks/results/run.json`, benchmarks/results/untracked.json).")
    path = fs.patches / "0002-check-sub.patch"
    text = path.read_text()
    longer = "\n".join(f"  continued why, line {i}." for i in range(7))   # 8 lines + 7 = 15: fine
    path.write_text(text.replace("  on two lines.", "  on two lines.\n" + longer))
    assert lint.lint_series_files(layout) == [
        "patches/0001-add-series-flag.patch:8: header carries a figure (ratio) '2.28-3.51x': "
        "name the result file or test instead",
        "patches/0001-add-series-flag.patch:8: header carries a figure (percent) '92-94%': "
        "name the result file or test instead",
        "patches/0001-add-series-flag.patch:9: header names benchmarks/results/untracked.json, which is "
        "not a committed result file"]
    path.write_text(text.replace("  on two lines.", "  on two lines.\n" + longer + "\n  one more."))
    assert lint.lint_series_files(layout)[-1] == (
        "patches/0002-check-sub.patch: header has 16 lines, more than 15: keep Subject/Topic/Why/How/Upstream/"
        "Drop when/Tested on to the stable facts")
