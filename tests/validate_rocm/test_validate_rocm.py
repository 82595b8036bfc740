"""make validate-rocm (scripts/validate_rocm.py): the claims registry against the docs, the
verdicts read from pytest's own JUnit XML and from e2e's results, and the verb here."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_rocm as vr  # noqa: E402

CLAIMS = [(doc, quote, checks) for doc, quotes in tomllib.loads(vr.CLAIMS.read_text()).items()
          for quote, checks in quotes.items()]
# Docs naming ROCm that make no claim a ROCm run checks (roofline, benchmarks: make bench's).
UNCLAIMED = {"docs/rebase-0.32.0.md", "docs/rebase-0.34.0.md", "docs/prs-wheels-image.md",
             "docs/benchmarks.md", "docs/e2e-cpu.md", "docs/roofline-amd.md"}
ROCM_WORDS = re.compile(r"on ROCm|MI300|MI355|gfx942|gfx950|ROCm tier|`rocm`")


@pytest.mark.parametrize("doc, quote, checks", CLAIMS, ids=lambda x: str(x)[:30])
def test_each_claim_quotes_its_doc_and_names_checks_that_exist(doc, quote, checks):
    assert " ".join(quote.split()) in " ".join((ROOT / doc).read_text().split()), doc
    for check in checks:
        kind, _, arg = check.partition(":")
        if check.startswith("tests/"):
            path, _, name = check.partition("::")
            assert f"def {name.split('[')[0]}" in (ROOT / path).read_text(), check
        else:
            assert arg in {"part": vr.PARTS, "e2e": ("throughput", "mixed", "serve", "gsm8k")}[kind]


def test_every_doc_that_speaks_of_rocm_has_a_claim():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel = str(path.relative_to(ROOT))
        if ROCM_WORDS.search(path.read_text()) and rel not in UNCLAIMED:
            assert rel in {doc for doc, _, _ in CLAIMS}, f"{rel} speaks of ROCm; no claim from it"


def test_checks_are_judged_from_pytests_own_junit_xml(tmp_path):
    (tmp_path / "tests" / "kernels").mkdir(parents=True)
    (tmp_path / "tests" / "kernels" / "test_x.py").write_text(
        "import pytest\n@pytest.mark.parametrize('p', ['auto', 'fp8'])\ndef test_a(p):\n"
        "    assert p == 'auto', 'fp8 differs'\nclass TestB:\n    def test_c(self):\n"
        "        pytest.skip('needs ROCm with AITER')\n")
    argv, _ = vr.command("kernels", tmp_path, None)  # pytest ... tests/kernels
    subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=300)
    ran = {"kernels": 1, "compile": "a stand-in reason"}
    prefix = "tests/kernels/test_x.py::"
    assert [vr.judge(prefix + c, ran, tmp_path) for c in (
        "test_a[auto]", "test_a", "TestB", "test_z")] == [
        ("passed", "1 passed"), ("failed", "1 of 2 failed: AssertionError: fp8 differs"),
        ("not run", "needs ROCm with AITER"),
        ("not run", "not in kernels's results (kernels.log)")]
    assert vr.judge("tests/compile/test_compile_tier.py", ran, tmp_path) == (
        "not run", "compile: a stand-in reason")
    assert vr.judge("part:kernels", ran, tmp_path) == (
        "failed", "kernels exited 1 (its log: kernels.log)")
    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "x-mixed.json").write_text('{"failed": null}')
    (tmp_path / "e2e" / "x-gsm8k.json").write_text('{"failed": ["gate failed: patched >= ..."]}')
    ran["e2e"] = 1
    assert vr.judge("e2e:mixed", ran, tmp_path) == ("passed", "x-mixed.json: nothing failed")
    assert vr.judge("e2e:gsm8k", ran, tmp_path) == ("failed", "gate failed: patched >= ...")
    assert vr.judge("e2e:serve", ran, tmp_path)[0] == "failed"  # e2e wrote no serve result


def test_a_rocm_run_judges_every_claim(tmp_path, monkeypatch):
    """A stand-in MI300X whose parts write nothing, kernels exits 1; no MODEL: no e2e."""
    monkeypatch.setattr(vr, "probe", lambda cmd, env: {
        "device": "AMD Instinct MI300X", "hip": "7.0", "torch": "2.9", "gpus": 1,
        "aiter": vr.load_pins(ROOT)["AITER_REF"][1:], "found": ["pytest"]})
    monkeypatch.setattr(vr, "TREE", ROOT / "vllm_overlay")  # a tree with vllm/
    monkeypatch.setattr(vr, "run_logged", lambda argv, env, log: int("tests/kernels" in argv))
    monkeypatch.chdir(ROOT)  # main() moves there; restored after the test
    assert vr.main(["--out", str(tmp_path)]) == 1  # a part failed
    report = (tmp_path / "REPORT.md").read_text()
    assert report.count("\n| ") == len(CLAIMS) + 1  # and the head row
    assert "\n| held | docs/rocm.md | “the real AITER op vs the Triton kernel” |" in report
    assert "\n| failed | README.md | “the Triton kernels are compiled for gfx942" in report
    assert "\n| not run | README.md | “AITER's op on ROCm" in report  # no JUnit XML written
    assert "\n| not run | docs/rocm.md | “engine end to end on ROCm” |" in report


def test_the_verb_on_this_machine_says_what_is_missing_and_runs_nothing(tmp_path):
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "validate-rocm",
                           f"VALIDATE_OUT={tmp_path / 'out'}", f"GPU_PYTHON={sys.executable}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "is not a ROCm build" in proc.stderr, proc.stderr
    assert "Nothing was run" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
