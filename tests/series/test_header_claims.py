"""make check: patch headers carry no figure and name only committed result files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fake_upstream import ENVS_PY, make_patch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import figures, lint  # noqa: E402
from seriestool.buildtree import Layout  # noqa: E402

FIGURES = [  # (text, the figures it carries)
    ("at 32K tokens it is 2.28-3.51x upstream", ["2.28-3.51x"]),
    ("3.49–4.82× at 1 x 128 new tokens", ["3.49–4.82×"]),
    ("≥ 1.25× for short extends", ["1.25×"]),
    ("2 × faster", ["2 ×"]),
    ("about 45% of a same-bytes copy", ["45%"]),
    ("92-94 % of copy", ["92-94 %"]),
    ("the plan builder costs 2.2-3.7 us per step", ["2.2-3.7 us"]),
    ("17µs, 1.5ms and 40 ns", ["17µs", "1.5ms", "40 ns"]),
    ("cut off by a 170 s limit after 5.9 minutes", ["170 s", "5.9 minutes"]),
    ("runs at 5.4 TB/s, copy 900 GB/s, 3 TFLOPS, 120 tok/s", ["5.4 TB/s", "900 GB/s", "3 TFLOPS", "120 tok/s"]),
    ("worst error 2.0 units of roundoff, 3 ulp", ["2.0 units of roundoff", "3 ulp"]),
    ("457 passed, 110 skipped", ["457 passed", "110 skipped"]),
    ("test_scheduler.py: 215 pass, 66 fail", ["215 pass", "66 fail"]),
    ("upstream test_batch_reordering.py 16/16", [".py 16/16"]),
    ("13/13 tests", ["13/13 tests"]),
    ("MRv2 moves 46 -> 0, V1 swaps 43 → 42", ["46 -> 0", "43 → 42"]),
    ("host time, min µs at 8/64/256 requests: 48/59/51", ["µs"]),
]
NOT_FIGURES = [
    "vllm#25763 (merged v0.11.1), vllm#27367",
    "vLLM 0.33.0, AITER v0.1.26 (v0.1.20-46, snapshot e4048607)",
    "fp8 e4m3 / e4m3fn / e5m2, gfx942 is e4m3fnuz, gfx950",
    "H200 (torch 2.11, CUDA 13, triton 3.6), Python 3.11, cp312 wheels, sm_90",
    "bf16, D 128, block 16/32, GQA 8/4, 32K tokens, 2,000 random mixes, 1,500-token prompt",
    "a cache past 2**31 elements, >= 32,768 blocks, bytes < 0x7f",
    "1 x 128 new tokens, a 4x4 tile, [Hq, T], x = 16 / element size",
    "default 512, 0 disables; split 1 decode / 0 extends / 2 prefills; 1/1/1",
    "the wrapper's RoPE called 0 vs 1 times; rotated part within one ulp",
    "the H200's L2 holds 60 MB; 16 MB of K/V",
    "decode -> extend -> prefill, rows #1 and #2",
]


@pytest.mark.parametrize("text,expected", FIGURES, ids=[t for t, _ in FIGURES])
def test_figures_are_found(text, expected):
    assert [f.text for f in figures.find_figures(text)] == expected


@pytest.mark.parametrize("text", NOT_FIGURES)
def test_identifiers_shapes_and_sizes_are_not_figures(text):
    assert figures.find_figures(text) == []


def test_hand_typed_skips_generated_regions_and_code():
    text = ("Intro: 2.3x faster.\n"
            "<!-- gen:status -->\n| a | 4.8× |\n<!-- /gen:status -->\n"
            "Inline <!-- fig:fetch_kv.speedup_32k -->2.2–2.4×<!-- /fig --> and `make bench  # 3 ms`.\n"
            "```\n45% in a code block\n```\n"
            "Last: 17 µs.\n")
    found = [(line, f.text) for line, f in figures.hand_typed(text)]
    assert found == [(1, "2.3x"), (9, "17 µs")]


def _layout(fake_series) -> Layout:
    return Layout(root=fake_series.root, build=fake_series.build)


def _set_tested_on(fake_series, name: str, text: str) -> None:
    path = fake_series.patches / name
    path.write_text(path.read_text().replace("Tested on: CPU (fake tree)", f"Tested on: {text}"))


def test_a_header_figure_and_a_missing_result_file_are_findings(fake_series):
    fs = fake_series
    assert lint.lint_header_claims(_layout(fs)) == []
    _set_tested_on(fs, "0001-add-series-flag.patch",
                   "CPU; H200: 2.28-3.51x upstream at 92-94% of copy\n"
                   "  (benchmarks/results/20261130-0604-nvidia-h200-297bfc9903.json)")
    findings = lint.lint_header_claims(_layout(fs))
    assert findings == [
        "patches/0001-add-series-flag.patch:8: header carries a figure (ratio) '2.28-3.51x': "
        "name the result file or test instead",
        "patches/0001-add-series-flag.patch:8: header carries a figure (percent) '92-94%': "
        "name the result file or test instead",
        "patches/0001-add-series-flag.patch:9: header names "
        "benchmarks/results/20261130-0604-nvidia-h200-297bfc9903.json, which is not a committed "
        "result file"]


def test_a_committed_result_file_may_be_named(fake_series):
    fs = fake_series
    results = fs.root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "run.json").write_text("{}\n")
    (results / "untracked.json").write_text("{}\n")
    fs.git("add", "benchmarks/results/run.json", cwd=fs.root)
    fs.git("commit", "-qm", "a result", cwd=fs.root)
    _set_tested_on(fs, "0002-check-sub.patch",
                   "H200 (`benchmarks/results/run.json`, benchmarks/results/untracked.json).")
    assert lint.lint_header_claims(_layout(fs)) == [
        "patches/0002-check-sub.patch:8: header names benchmarks/results/untracked.json, which is "
        "not a committed result file"]


def test_make_check_fails_on_a_header_figure(fake_series):
    fs = fake_series
    name = "0003-fast.patch"
    text = make_patch("Faster flag", "vllm/envs.py", ENVS_PY,
                      ENVS_PY.replace("VALUE_9 = 9\n", "VALUE_9 = 9\nFAST = 1\n"))
    (fs.patches / name).write_text(text.replace("Tested on: CPU (fake tree)",
                                                "Tested on: CPU (fake tree), 457 passed"))
    with open(fs.patches / "series", "a") as f:
        f.write(name + "\n")
    proc = fs.run("check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("patches/0003-fast.patch:8: header carries a figure (test count) '457 passed'"
            in proc.stdout)


def test_a_header_longer_than_fifteen_lines_is_a_finding(fake_series):
    fs = fake_series
    name = "0001-add-series-flag.patch"
    path = fs.patches / name
    text = path.read_text()
    header_lines = text.split("\n---\n", 1)[0].count("\n") + 1
    assert header_lines == 8 and lint.lint_header_claims(_layout(fs)) == []
    longer = "\n".join(f"  continued why, line {i}." for i in range(15 - header_lines))
    path.write_text(text.replace("  on two lines.", "  on two lines.\n" + longer))
    assert lint.lint_header_claims(_layout(fs)) == []  # 15 lines: fine
    path.write_text(text.replace("  on two lines.", "  on two lines.\n" + longer + "\n  one more."))
    assert lint.lint_header_claims(_layout(fs)) == [
        f"patches/{name}: header has 16 lines, more than 15: keep Subject/Topic/Why/How/Upstream/"
        "Drop when/Tested on to the stable facts"]
