"""make validate-rocm (scripts/validate_rocm.py): the claims registry, the verdicts read from
pytest's own JUnit XML, the roofline of docs/roofline-amd.md, and the verb on this machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_rocm as vr  # noqa: E402

CLAIMS = tomllib.loads(vr.CLAIMS.read_text())["claim"]
# Docs that name ROCm hardware or the ROCm tier but make no claim a ROCm run can check.
UNCLAIMED = {"docs/rebase-0.32.0.md", "docs/rebase-0.34.0.md", "docs/prs-wheels-image.md",
             "docs/benchmarks.md", "docs/e2e-cpu.md"}
ROCM_WORDS = re.compile(r"on ROCm|MI300|MI355|gfx942|gfx950|ROCm tier|`rocm`")


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c["id"])
def test_each_claim_quotes_its_doc_and_names_checks_that_exist(claim):
    assert set(claim) == {"id", "doc", "quote", "claim", "checks"}
    doc = " ".join((ROOT / claim["doc"]).read_text().split())
    assert " ".join(claim["quote"].split()) in doc, f"{claim['doc']} no longer says it"
    for check in claim["checks"]:
        kind, _, arg = check.partition(":")
        assert kind in ("test", "part", "e2e", "bench", "roofline"), check
        if kind == "test":
            path, _, name = arg.partition("::")
            assert (ROOT / path).is_file(), check
            assert not name or f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), check
        assert kind != "part" or arg in vr.PARTS, check
        assert kind != "e2e" or arg in vr.RECIPES, check


def test_claim_ids_are_unique_and_every_doc_with_rocm_claims_has_some():
    assert len({c["id"] for c in CLAIMS}) == len(CLAIMS)
    claimed = {c["doc"] for c in CLAIMS}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel = str(path.relative_to(ROOT))
        if ROCM_WORDS.search(path.read_text()) and rel not in UNCLAIMED:
            assert rel in claimed, f"{rel} speaks of ROCm but claims.toml has no claim from it"


def test_checks_are_judged_from_pytests_own_junit_xml(tmp_path):
    (tmp_path / "tests" / "mla").mkdir(parents=True)
    (tmp_path / "tests" / "mla" / "test_x.py").write_text(
        "import pytest\n@pytest.mark.parametrize('p', ['auto', 'fp8'])\ndef test_a(p):\n"
        "    assert p == 'auto', 'fp8 differs'\nclass TestB:\n    def test_c(self):\n"
        "        pytest.skip('needs ROCm with AITER')\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests",
                    f"--junitxml={tmp_path / 'rocm-tests.xml'}"], cwd=tmp_path, timeout=300)
    ran = {"rocm-tests": 1, "kernels": 1, "compile": "not asked for (PARTS=)"}
    prefix = "test:tests/mla/test_x.py::"
    assert [vr.judge(prefix + c, ran, tmp_path, "gfx942") for c in (
        "test_a[auto]", "test_a", "TestB", "test_")] == [
        ("passed", "1 passed"), ("failed", "1 of 2 failed: AssertionError: fp8 differs"),
        ("not run", "needs ROCm with AITER"),
        ("not run", "not in rocm-tests's results (rocm-tests.log)")]
    assert vr.judge("test:tests/compile/test_compile_tier.py", ran, tmp_path, None) == (
        "not run", "compile: not asked for (PARTS=)")
    assert vr.judge("part:kernels", ran, tmp_path, None) == (
        "failed", "kernels exited 1 (its log: kernels.log)")


def test_bench_cases_against_the_roofline_of_docs_roofline_amd(tmp_path):
    results = ROOT / "benchmarks/results/20261201-1039-nvidia-h200-98d223cb1f.json"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / results.name).write_text(results.read_text())
    [case] = [c for c in vr.bench_cases(tmp_path) if c["case"] == "nhd_bf16_h1_d128_b16_4k"]
    # docs/roofline-amd.md: 4.0 MiB, MI300X bound 0.791 µs, MI355X 0.524 µs; measured 3.56 µs.
    assert "| nhd_bf16_h1_d128_b16_4k | 4.0 MiB | — | — | 0.791 mem | 0.524 mem |" in (
        ROOT / "docs/roofline-amd.md").read_text()
    assert vr.fraction_of_bound(case, "gfx942") == pytest.approx(0.791 / 3.56, rel=2e-3)
    ran = {"bench": 0}
    assert vr.judge("roofline:*", ran, tmp_path, "gfx942")[0] == "passed"
    assert vr.judge("roofline:*", ran, tmp_path, "sm_90")[0] == "not run"
    assert vr.judge("bench:fetch_kv>=1.0", ran, tmp_path, "gfx942")[0] == "passed"
    assert vr.judge("bench:fetch_kv>=9.0", ran, tmp_path, "gfx942")[0] == "failed"


def test_a_rocm_run_judges_every_claim(tmp_path, monkeypatch):
    """A stand-in MI300X whose parts exit 0 and write nothing: no claim holds on a test."""
    pin = vr.pins()
    monkeypatch.setattr(vr, "probe", lambda: {
        "device": "AMD Instinct MI300X", "arch": "gfx942", "hip": "7.0", "torch": "2.9",
        "triton": pin["TRITON_VERSION"], "aiter": pin["AITER_REF"][1:], "commit": "0123"})
    monkeypatch.setattr(vr, "TREE", ROOT / "vllm_overlay")  # a tree with vllm/
    monkeypatch.setattr(vr, "run", lambda argv, extra, log: log.write_text("stub") and 0)
    assert vr.main(["--parts", "rocm-tests,bench", "--out", str(tmp_path)]) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    verdict = {c["id"]: c["verdict"] for c in results["claims"]}
    assert verdict["rocm-tier-real-op"] == "held" and verdict["roofline-floor"] == "failed"
    assert verdict["fakes-behave-like-aiter"] == verdict["engine-e2e-rocm"] == "not run"
    assert "| held | the ROCm tier (tests marked rocm) passes |" in (
        tmp_path / "REPORT.md").read_text()


def test_the_verb_on_this_machine_says_what_is_missing_and_runs_nothing(tmp_path):
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "validate-rocm",
                           "PARTS=kernels,bench", f"VALIDATE_OUT={tmp_path / 'out'}",
                           f"GPU_PYTHON={sys.executable}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kernels: no GPU visible to torch" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
