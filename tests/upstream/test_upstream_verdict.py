"""make test-upstream's verdict (scripts/upstream_tests.py compare()), on made-up reports.

The real run is ``make test-upstream``; here only the rules: an unlisted
difference fails, a listed one must happen with the listed outcomes, a test
failing on both trees must match an [[environment]] entry (patterns and message),
the series' own tests must pass.  And the committed expectations file parses.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import upstream_tests as ut  # noqa: E402

EXPECTATIONS = textwrap.dedent('''
    files = ["tests/a.py", "tests/b.py"]

    [[differs]]
    test = "tests/a.py::test_order"
    pristine = "passed"
    patched = "failed"
    patch = "0102-x.patch"
    why = "intended"

    [[environment]]
    tests = ["tests/b.py::*"]
    message = "needs torchvision"
    reason = "no torchvision here"
''')


def _report(tests: dict, messages: dict | None = None, collect: dict | None = None) -> dict:
    return {"tests": tests, "messages": messages or {}, "collect_errors": collect or {}}


@pytest.fixture
def exp(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text(EXPECTATIONS)
    return ut.Expectations.load(path)


def test_listed_differences_and_environment_failures_pass(exp):
    env_fail = {"tests/b.py::test_mm": "failed"}
    msg = {"tests/b.py::test_mm": "ValidationError | needs torchvision for llava"}
    pristine = _report({"tests/a.py::test_order": "passed", "tests/a.py::test_ok": "passed",
                        **env_fail}, msg)
    patched = _report({"tests/a.py::test_order": "failed", "tests/a.py::test_ok": "passed",
                       **env_fail}, msg)
    series = _report({"tests/a.py::test_order": "passed"})
    problems, summary = ut.compare(pristine, patched, series, exp)
    assert problems == []
    assert summary["differences"] == {"tests/a.py::test_order": ["passed", "failed"]}
    assert summary["environment"] == {"no torchvision here": 1}


def test_every_other_outcome_is_a_problem(exp):
    pristine = _report({"tests/a.py::test_order": "passed", "tests/a.py::test_new": "passed",
                        "tests/a.py::test_broken": "failed", "tests/b.py::test_mm": "failed"},
                       {"tests/b.py::test_mm": "some other error"})
    patched = _report({"tests/a.py::test_order": "passed", "tests/a.py::test_new": "failed",
                       "tests/a.py::test_broken": "failed", "tests/b.py::test_mm": "failed"})
    series = _report({"tests/a.py::test_order": "failed"}, {"tests/a.py::test_order": "boom"})
    problems, _ = ut.compare(pristine, patched, series, exp)
    text = "\n".join(problems)
    assert "unexpected difference: tests/a.py::test_new: pristine passed, patched failed" in text
    assert "expected difference did not happen: tests/a.py::test_order" in text
    # Failing on both trees: unlisted, or listed but for another reason (message).
    assert "not listed under [[environment]]: tests/a.py::test_broken" in text
    assert "not listed under [[environment]]: tests/b.py::test_mm" in text
    assert "series' own test failed: tests/a.py::test_order" in text
    assert len(problems) == 5


def test_listed_difference_with_other_outcomes_is_a_problem(exp):
    pristine = _report({"tests/a.py::test_order": "passed"})
    patched = _report({"tests/a.py::test_order": "skipped"})
    problems, _ = ut.compare(pristine, patched, None, exp)
    assert problems == ["tests/a.py::test_order: pristine passed, patched skipped; the "
                        "expectations say pristine passed, patched failed"]


def test_the_committed_expectations_load():
    exp = ut.Expectations.load(ut.CONFIG)
    assert exp.files and all((f.startswith("tests/") and f.endswith(".py")) for f in exp.files)
    assert len(set(exp.files)) == len(exp.files)
    patches = {p.name for p in (REPO / "patches").glob("*.patch")}
    for test, entry in exp.differs.items():
        assert entry["patch"] in patches, f"{test}: {entry['patch']} is not a patch of the series"
        assert test.split("::")[0] in exp.files
    for entry in exp.environment:
        assert entry["reason"].strip()


def test_the_committed_pristine_record_is_this_pins_and_selections():
    exp = ut.Expectations.load(ut.CONFIG)
    record = ut.load_record(ut.RECORD, exp.files)
    assert record["tests"] and set(record["tests"].values()) <= set(ut.FAILED) | {"passed", "skipped",
                                                                                  "xfailed", "xpassed"}
    # Every file of the selection ran (or failed to collect) in the recorded run.
    ran = {t.split("::")[0] for t in record["tests"]} | set(record["collect_errors"])
    assert ran == set(exp.files)


def test_a_record_of_another_pin_or_selection_is_refused(tmp_path):
    exp = ut.Expectations.load(ut.CONFIG)
    good = ut.json.loads(ut.RECORD.read_text())
    for key, value in (("sdist_sha256", "0" * 64), ("files_sha256", ut.files_hash(exp.files[1:]))):
        path = tmp_path / "pristine.json"
        path.write_text(ut.json.dumps({**good, key: value}))
        with pytest.raises(ut.SetupError, match=f"{key}: record .*regenerate it with `make test-upstream RECORD=1`"):
            ut.load_record(path, exp.files)
    with pytest.raises(ut.SetupError, match="no pristine record"):
        ut.load_record(tmp_path / "absent.json", exp.files)
