"""make report: every figure shown, generated from committed, clean result files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_report  # noqa: E402
from seriestool import figures, results  # noqa: E402

README = "# Series\n\nIntro without figures.\n\n<!-- gen:status -->\nstale\n<!-- /gen:status -->\n"
DOCS = "# Benchmarks\n\nHand-written prose.\n"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def fetch_case(heads: int, speedup: float, frac: float) -> dict:
    return {"kernel": "fetch_kv", "case": f"nhd_bf16_h{heads}_d128_b16_32k", "mode": "cold", "buffer_sets": 4,
            "shapes": {"tokens": 32768, "layout": "NHD", "head_size": 128, "num_kv_heads": heads,
                       "cache_dtype": "torch.bfloat16", "out_dtype": "torch.bfloat16"},
            "results": {"ours": {"us": 10.0, "gbps": 1.0}, "baseline": {"us": 10.0 * speedup},
                        "copy": {"us": 10.0 * frac}}, "speedup": speedup, "frac_copy": frac}


def paged_case(reqs: int, context: int, new: int, ours: float, base: float, fa2: float) -> dict:
    return {"kernel": "paged_context", "case": f"r{reqs}_ctx{context // 1024}k_new{new}", "mode": "cold",
            "buffer_sets": 2, "shapes": {"requests": reqs, "context": context, "new_tokens": new},
            "results": {"ours": {"us": ours}, "baseline": {"us": base}, "gather_fa2": {"us": fa2},
                        "copy": {"us": 1.0}}, "speedup": base / ours, "frac_copy": 1.0 / ours}


def write(root: Path, name: str, commit: str, cases: list[dict], **series) -> None:
    data = results.seal({"datetime": name[:8], "benchmarks": [{"extra_info": c} for c in cases],
                         "machine_info": {"series": {"device": "NVIDIA H200", "commit": commit, "dirty": False,
                                                     "torch": "2.11", "triton": "3.6", **series}}})
    (root / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    (root / "benchmarks" / "results" / name).write_text(json.dumps(data))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path
    (root / "patches").mkdir()
    (root / "patches" / "0250-paged.patch").write_text(
        '+        os.getenv("VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS", "512")\n')
    (root / "README.md").write_text(README)
    (root / "docs").mkdir()
    (root / "docs" / "benchmarks.md").write_text(DOCS)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "series")
    commit = git(root, "rev-parse", "HEAD")
    write(root, "20261101-old.json", commit, [fetch_case(8, 1.5, 0.5)])
    write(root, "20261120-new.json", commit, [fetch_case(1, 2.04, 0.894), fetch_case(8, 2.35, 0.901),
                                              paged_case(1, 8192, 128, 70.0, 100.0, 250.0),
                                              paged_case(4, 32768, 128, 800.0, 950.0, 1100.0),
                                              paged_case(1, 8192, 1024, 460.0, 520.0, 480.0)])
    write(root, "20261121-dirty.json", commit, [fetch_case(1, 7.0, 0.7)], dirty=True)
    write(root, "20261122-noted.json", commit, [fetch_case(1, 7.0, 0.7)], commit_note="fixed by hand")
    write(root, "20261123-edited.json", commit, [fetch_case(1, 7.0, 0.7)])
    edited = root / "benchmarks" / "results" / "20261123-edited.json"
    edited.write_text(edited.read_text().replace('"speedup": 7.0', '"speedup": 7.3'))
    write(root, "20261124-elsewhere.json", "1" * 40, [fetch_case(1, 7.0, 0.7)])
    git(root, "add", "-A")
    git(root, "commit", "-qm", "results")
    write(root, "20261130-uncommitted.json", commit, [fetch_case(1, 7.0, 0.7)])
    return root


def test_report_writes_status_and_results_md_from_clean_committed_results(repo, capsys):
    assert bench_report.main(["--root", str(repo)]) == 0
    out = capsys.readouterr().out
    status = (repo / "README.md").read_text().split("<!-- gen:status -->\n")[1].split("\n<!--")[0].splitlines()
    fetch = next(row for row in status if row.startswith("| `fetch-kv` |"))
    # Rounded from the newest clean file only: speedups 2.04/2.35, copy 0.894/0.901; routed
    # (<= 512 new tokens): ours 70/800 us vs gather + FA2 250/1100 us.
    assert (" | CPU tier; NVIDIA H200 (benchmarks); ROCm: not run | 2.0–2.4× upstream's gather, 89–90% of copy "
            "(32K tokens, cold L2); ≤ 512 new tokens: 1.4–3.6× gather + FA2, 1.2–1.4× gather + same kernel | "
            "[fetch_kv](benchmarks/RESULTS.md#fetch_kv-on-nvidia-h200), ") in fetch
    assert "| no clean result yet | n/a |" in next(row for row in status if "`mla-fusion`" in row)
    details = (repo / "benchmarks" / "RESULTS.md").read_text()
    for name, reason in (("dirty", "from a dirty tree"), ("noted", "its commit was edited after the run"),
                         ("edited", "edited after the run (series_seal does not match"),
                         ("elsewhere", f"series commit {'1' * 40} is not in HEAD's history")):
        assert f"{name}.json`: {reason}" in details
        assert f"{name}.json: not used ({reason}" in out
    assert "uncommitted" not in details and "7.00×" not in details and "1.50×" not in details
    assert ("1.4–3.6× the speed of gather + FlashAttention-2 and 1.2–1.4× that of gather + the same "
            "Triton kernel, 1 of 2 cases at ≥ 1.25× (8K–32K cached tokens") in details
    assert "| r1_ctx8k_new128 | cold ×2 | 70.0 | 100.0 | 250.0 | 1.0 | 1.43× | 3.57× | n/a | 1% |" in details
    pages = {p: p.read_text() for p in [repo / "README.md", *repo.glob("*/*.md")]}  # docs/, benchmarks/
    assert bench_report.main(["--root", str(repo)]) == 0
    assert {p: p.read_text() for p in pages} == pages


def test_an_unknown_region_stops_the_report_before_writing(repo, capsys):
    (repo / "docs" / "benchmarks.md").write_text(DOCS + "<!-- gen:bench-summary -->\n<!-- /gen:bench-summary -->\n")
    assert bench_report.main(["--root", str(repo)]) == 2
    assert "unknown generated block 'bench-summary'" in capsys.readouterr().err
    assert "stale" in (repo / "README.md").read_text() and not (repo / "benchmarks" / "RESULTS.md").exists()


def test_hand_typed_figures_are_warned_about(repo, capsys):
    (repo / "docs" / "benchmarks.md").write_text(DOCS.replace("prose", "prose: fetch_kv is 2.3x upstream"))
    assert bench_report.main(["--root", str(repo)]) == 0
    assert "warning: docs/benchmarks.md:3: hand-typed figure '2.3x'" in capsys.readouterr().out


def test_the_committed_pages_are_what_the_committed_results_give():
    for path, text in bench_report.render(REPO, results.select(REPO)).items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run `make report`"
        assert path.name == "RESULTS.md" or not figures.hand_typed(text), path
