"""The claims registry (scripts/validate_rocm/claims.toml): every entry points at words its doc
still says and names checks the kit can judge; every doc that makes ROCm claims has entries."""

from __future__ import annotations

import re

import pytest
from rocm_standin import ROOT
from validate_rocm import claims
from validate_rocm.parts import PARTS

CLAIMS = claims.load()

# Docs that name ROCm hardware or the ROCm tier but make no claim a ROCm run can check.
UNCLAIMED = {
    "docs/rebase-0.32.0.md": "the record of a past rebase",
    "docs/rebase-0.34.0.md": "the record of a past rebase (its ROCm claims are rocm.md's)",
    "docs/prs-wheels-image.md": "how PRs, wheels and the image are made (the image recipe is "
                                "checked statically, tests/test_image_recipe.py)",
    "docs/benchmarks.md": "how to read the suites; the AMD bound is docs/roofline-amd.md's claim",
    "docs/e2e-cpu.md": "the CPU engine",
}
ROCM_WORDS = re.compile(r"on ROCm|MI300|MI355|gfx942|gfx950|ROCm tier|`rocm`")


def test_ids_are_unique_and_fields_complete():
    ids = [c["id"] for c in CLAIMS]
    assert len(ids) == len(set(ids))
    for c in CLAIMS:
        assert set(c) == {"id", "doc", "quote", "claim", "checks"}, c["id"]
        assert c["checks"], c["id"]


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c["id"])
def test_quote_is_still_in_its_doc(claim):
    assert claims.quote_found(ROOT, claim), (
        f"{claim['doc']} no longer says {claim['quote']!r}: update claims.toml ({claim['id']})")


def test_every_check_is_one_the_kit_judges():
    for c in CLAIMS:
        for spec in c["checks"]:
            kind, _, arg = spec.partition(":")
            assert kind in claims.CHECK_KINDS and arg, spec
            if kind == "part":
                assert arg in PARTS, spec
            if kind == "facts":
                assert arg in ("spills", "match", "waves"), spec
            if kind == "test":
                path = arg.split("::")[0]
                assert (ROOT / path).is_file(), spec
                name = arg.split("::")[1].split("[")[0] if "::" in arg else None
                assert name is None or f"def {name}(" in (ROOT / path).read_text(), spec
            # Every check judges "not run" when nothing ran.
            assert claims.check(spec, {})[0] == "not run", spec


def test_every_doc_with_rocm_claims_has_entries():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    claimed = {c["doc"] for c in CLAIMS}
    for path in docs:
        rel = str(path.relative_to(ROOT))
        if ROCM_WORDS.search(path.read_text()) and rel not in UNCLAIMED:
            assert rel in claimed, f"{rel} speaks of ROCm but claims.toml has no claim from it"
    assert not set(UNCLAIMED) & claimed


def test_verdicts():
    parts = {
        "rocm-tests": {"status": "passed", "tests": [
            {"test": "tests/mla/x.py::test_a[auto]", "outcome": "passed", "message": ""},
            {"test": "tests/mla/x.py::test_a[fp8]", "outcome": "failed", "message": "boom"},
            {"test": "tests/mla/x.py::test_b", "outcome": "skipped", "message": "needs ROCm"}]},
        "conformance": {"status": "failed", "conformance": {"fakes": {
            "a": {"compared": 3, "disagreed": 0}, "b": {"compared": 2, "disagreed": 1},
            "c": {"compared": 0, "disagreed": 0}}}},
        "bench": {"status": "passed", "cases": [
            {"kernel": "k", "case": "1", "vs_upstream": 1.5, "fraction_of_bound": 0.5},
            {"kernel": "k", "case": "2", "vs_upstream": 0.9, "fraction_of_bound": 1.2}]},
    }
    assert claims.check("test:tests/mla/x.py::test_a[auto]", parts)[0] == "held"
    assert claims.check("test:tests/mla/x.py::test_a", parts)[0] == "failed"
    assert claims.check("test:tests/mla/x.py::test_b", parts) == ("not run",
                                                                 "tests/mla/x.py::test_b: skipped (needs ROCm)")
    assert claims.check("conformance:a", parts)[0] == "held"
    assert claims.check("conformance:*", parts) == ("failed", "1 calls disagree: b")
    assert claims.check("conformance:c", parts)[0] == "not run"
    assert claims.check("bench:k", parts)[0] == "held"
    assert claims.check("bench:k>=1.0", parts)[0] == "failed"
    assert claims.check("roofline:*", parts)[0] == "failed"
    assert claims.check("part:kernels", {"kernels": {"status": "skipped", "reason": "no"}}) == (
        "not run", "kernels: no")
    judged = claims.judge({"id": "x", "doc": "d", "quote": "q", "claim": "c",
                           "checks": ["conformance:a", "conformance:c"]}, parts)
    assert judged["verdict"] == "not run"
    assert [k["verdict"] for k in judged["checks"]] == ["held", "not run"]
