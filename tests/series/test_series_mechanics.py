"""make apply / check / refresh on a fake upstream (fast, offline)."""

from __future__ import annotations

import pytest
from fake_upstream import ENVS_PY, UPSTREAM, commit_message, envs_edit_1, envs_edit_2, make_patch, ok


def _subjects(fs) -> list[str]:
    return fs.git("log", "--reverse", "--format=%s").splitlines()


def test_apply_history_is_the_series_reproducibly(fake_series):
    fs = fake_series
    ok(fs.run("apply"))
    assert _subjects(fs) == ["vLLM 9.9.9 pristine (upstream gfake)",
                             "Series overlay: new files at their upstream paths", "Add SERIES_FLAG", "Comment sub"]
    assert fs.git("show", "HEAD~3:vllm/envs.py") + "\n" == ENVS_PY
    assert "SERIES_FLAG = True" in (fs.build / "vllm/envs.py").read_text()
    assert (fs.build / "vllm/ops/new_kernel.py").read_text() == "def kernel():\n    return 42\n"
    assert "Series-Patch: 0001-add-series-flag.patch" in fs.git("log", "-1", "--format=%B", "HEAD~1")
    head = fs.git("rev-parse", "HEAD")
    assert "up to date" in ok(fs.run("apply")).stdout
    ok(fs.run("apply", "--force"))  # a rebuild from scratch gives the same commit ids
    assert fs.git("rev-parse", "HEAD") == head
    fs.add_patch("0003-other-flag.patch", make_patch("Add OTHER_FLAG", "vllm/envs.py", ENVS_PY, envs_edit_2(ENVS_PY)))
    ok(fs.run("apply"))
    assert _subjects(fs)[-1] == "Add OTHER_FLAG" and fs.git("status", "--porcelain") == ""


@pytest.mark.parametrize("base, new, why", [
    (ENVS_PY.replace("VALUE_14 = 14", "VALUE_14 = 1400"), None, "patch failed: vllm/envs.py:"),
    (envs_edit_1(ENVS_PY), envs_edit_1(ENVS_PY).replace("VALUE_18 = 18\n", "VALUE_18 = 18  \n"), "whitespace"),
])
def test_zero_fuzz_a_patch_that_does_not_apply_exactly_stops_there(fake_series, base, new, why):
    """One changed context line, or added trailing whitespace, refuses the patch."""
    fs = fake_series
    fs.add_patch("0003-bad.patch", make_patch("Bad", "vllm/envs.py", base, new or envs_edit_2(base)))
    proc = fs.run("apply")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "patches/0003-bad.patch does not apply" in proc.stderr and why in proc.stderr.lower()
    assert "last good commit" in proc.stderr and _subjects(fs)[-1] == "Comment sub"


def test_apply_never_clobbers_local_work_until_forced(fake_series):
    fs = fake_series
    ok(fs.run("apply"))
    tree = fs.tree()
    edited = fs.build / "vllm/utils.py"
    edited.write_text(edited.read_text() + "# my local work\n")
    (fs.patches / "series").write_text("0001-add-series-flag.patch\n")   # the series changes too
    proc = fs.run("apply")
    assert proc.returncode == 2 and "uncommitted changes" in proc.stderr and "vllm/utils.py" in proc.stderr
    assert "make refresh" in proc.stderr and "FORCE=1" in proc.stderr
    assert edited.read_text().endswith("# my local work\n")
    fs.git("commit", "-qam", "My experiment")
    proc = fs.run("apply")
    assert proc.returncode == 2 and "commits that are not in the series" in proc.stderr
    assert _subjects(fs)[-1] == "My experiment"
    (fs.patches / "series").write_text("0001-add-series-flag.patch\n0002-check-sub.patch\n")
    ok(fs.run("apply", "--force"))
    assert fs.tree() == tree


def test_a_wrong_sha256_or_no_sdist_is_one_clear_error(fake_series, tmp_path):
    fs = fake_series
    pins = (fs.root / "pins.env").read_text()
    good = [ln.split("=", 1)[1] for ln in pins.splitlines() if ln.startswith("VLLM_SDIST_SHA256=")][0]
    (fs.root / "pins.env").write_text(pins.replace(good, "0" * 64))
    proc = fs.run("apply")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(fs.sdist) in proc.stderr and good in proc.stderr and "0" * 64 in proc.stderr
    assert fs.sdist.exists()   # nothing deleted
    (fs.root / "pins.env").write_text(pins)
    empty = tmp_path / "empty-cache"
    proc = fs.run("apply", env={"SERIES_CACHE": str(empty), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                                "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot get vllm==9.9.9" in proc.stderr and f"No cached copy at {empty}" in proc.stderr
    assert not fs.build.exists()


def test_refresh_round_trip_keeps_patches_byte_for_byte(fake_series):
    """Patches made against pristine upstream (as topics are) apply at an offset: kept as they are."""
    fs = fake_series
    fs.add_patch("0003-other-flag.patch", make_patch("Add OTHER_FLAG", "vllm/envs.py", ENVS_PY, envs_edit_2(ENVS_PY)))
    fs.commit()
    ok(fs.run("apply"))
    assert "nothing changed" in ok(fs.run("refresh")).stdout
    ok(fs.run("check"))
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""   # apply, refresh, check: the checkout stays clean


def test_refresh_saves_new_commits_as_patches_and_overlay(fake_series):
    fs = fake_series
    fs.commit()
    ok(fs.run("apply"))
    (fs.build / "vllm/utils.py").write_text((fs.build / "vllm/utils.py").read_text() + "\n\nMUL = 3\n")
    (fs.build / "vllm/ops/another.py").write_text("X = 1\n")
    fs.git("add", "-A")
    fs.git("commit", "-qm", "Add MUL constant\n\nTopic: misc\nWhy: a reason.\nUpstream: none")
    proc = fs.run("refresh")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'Add MUL constant': lacks the header field(s) How, Drop when, Tested on" in proc.stderr
    assert "unknown Topic 'misc'" in proc.stderr and "Nothing was written." in proc.stderr
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""
    fs.git("commit", "-q", "--amend", "-m", commit_message("Add MUL constant"))
    edited_tree = fs.tree()
    report = ok(fs.run("refresh")).stdout
    assert "patches/0003-add-mul-constant.patch" in report and "vllm_overlay/vllm/ops/another.py" in report
    new_patch = (fs.patches / "0003-add-mul-constant.patch").read_text()
    assert new_patch.startswith("Subject: Add MUL constant\nTopic: fetch-kv\nWhy: because the test says so,\n"
                                "  on two lines.\n")
    assert "\n---\ndiff --git a/vllm/utils.py b/vllm/utils.py\n" in new_patch and "\nindex " not in new_patch
    series = (fs.patches / "series").read_text()
    assert series.splitlines()[-1] == "0003-add-mul-constant.patch" and "# utils" in series
    assert "nothing changed" in ok(fs.run("refresh")).stdout       # deterministic
    assert "up to date" in ok(fs.run("apply")).stdout
    ok(fs.run("apply", "--force"))
    assert fs.tree() == edited_tree
    assert "series OK (3 patches, 2 overlay files)" in ok(fs.run("check")).stdout


def test_check_reports_every_finding(fake_series):
    fs = fake_series
    assert "series OK (2 patches, 1 overlay files)" in ok(fs.run("check")).stdout
    assert not fs.build.exists()  # check never touches build/vllm
    (fs.patches / "series").write_text(
        "0001-add-series-flag.patch\n0001-add-series-flag.patch\n0009-missing.patch\n")
    text = (fs.patches / "0001-add-series-flag.patch").read_text()
    (fs.patches / "0001-add-series-flag.patch").write_text(
        text.replace("Drop when: never\n", "").replace("Topic: mla-fusion", "Topic: misc")
        .replace("--- a/vllm/envs.py", "index 1234567..89abcde 100644\n--- a/vllm/envs.py"))
    (fs.root / "vllm_overlay/vllm/utils.py").write_text("shadow\n")
    out = fs.run("check").stdout
    assert "0001-add-series-flag.patch is listed 2 times" in out
    assert "0009-missing.patch is listed but patches/0009-missing.patch does not exist" in out
    assert "patches/0002-check-sub.patch: not listed in patches/series" in out
    assert "0001-add-series-flag.patch: lacks the header field(s) Drop when" in out
    assert "unknown Topic 'misc'" in out and "0001-add-series-flag.patch: has 'index' lines" in out
    assert "vllm_overlay/vllm/utils.py: shadows a file upstream has" in out
    assert "not run: the zero-fuzz apply, topic-alone and pre-commit hook checks, because vllm_overlay/" in out
    proc = fs.run("apply")
    assert proc.returncode == 2 and "vllm_overlay/vllm/utils.py" in proc.stderr and "patch instead" in proc.stderr


FAILING_HOOK = """\
repos:
- repo: local
  hooks:
  - id: always-fails
    name: fails on any Python file
    entry: "false"
    language: system
    types: [python]
"""


def test_check_runs_every_check_past_a_finding(fake_series):
    """Past a broken doc link and a patch that does not apply, each topic is tried alone; with
    the series applying, upstream's hooks run (this config's one hook fails on any file)."""
    fs = fake_series
    fs.upstream({**UPSTREAM, ".pre-commit-config.yaml": FAILING_HOOK})
    (fs.root / "docs").mkdir()
    (fs.root / "docs/topics.md").write_text("[the design](missing.md), `[code](not/a/link)`\n")
    fs.git("add", "docs/topics.md", cwd=fs.root)
    proc = fs.run("check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "docs/topics.md:1: link 'missing.md' names no file" in proc.stdout
    assert "pre-commit hook always-fails failed (exit 1):" in proc.stdout
    assert "make check: 2 finding(s)" in proc.stdout
    text = (fs.patches / "0002-check-sub.patch").read_text()
    (fs.patches / "0002-check-sub.patch").write_text(text.replace(" def sub(a, b):", " def sub(x, y):"))
    out = fs.run("check").stdout
    assert "patches/0002-check-sub.patch does not apply: patch failed: vllm/utils.py:" in out
    assert "topic fetch-kv: patches/0002-check-sub.patch does not apply on pristine upstream" in out
    assert "not run: the pre-commit hooks, because patches/0002-check-sub.patch does not apply" in out
