"""make apply / check / refresh on a fake upstream (fast, offline)."""

from __future__ import annotations

import json

from fake_upstream import ENVS_PY, UPSTREAM, commit_message, envs_edit_1, envs_edit_2, make_patch


def _ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _subjects(fs) -> list[str]:
    return fs.git("log", "--reverse", "--format=%s").splitlines()


# --- apply -----------------------------------------------------------------

def test_apply_history_is_the_series(fake_series):
    fs = fake_series
    _ok(fs.run("apply"))
    assert _subjects(fs) == [
        "vLLM 9.9.9 pristine (upstream gfake)",
        "Series overlay: new files at their upstream paths",
        "Add SERIES_FLAG",
        "Comment sub",
    ]
    root = fs.git("rev-list", "--max-parents=0", "HEAD")
    assert fs.git("show", f"{root}:vllm/envs.py") + "\n" == ENVS_PY
    assert "SERIES_FLAG = True" in (fs.build / "vllm/envs.py").read_text()
    assert (fs.build / "vllm/ops/new_kernel.py").read_text() == "def kernel():\n    return 42\n"
    body = fs.git("log", "-1", "--format=%B", "HEAD~1")
    assert "Topic: mla-fusion" in body and "Series-Patch: 0001-add-series-flag.patch" in body
    assert fs.git("status", "--porcelain") == ""


def test_apply_is_idempotent_and_reproducible(fake_series):
    fs = fake_series
    _ok(fs.run("apply"))
    tree, head = fs.tree(), fs.git("rev-parse", "HEAD")
    second = _ok(fs.run("apply"))
    assert "up to date" in second.stdout
    assert (fs.tree(), fs.git("rev-parse", "HEAD")) == (tree, head)
    _ok(fs.run("apply", "--force"))  # a rebuild from scratch, not the shortcut
    assert (fs.tree(), fs.git("rev-parse", "HEAD")) == (tree, head)


def test_apply_rebuilds_when_a_patch_changes(fake_series):
    fs = fake_series
    _ok(fs.run("apply"))
    (fs.patches / "0003-other-flag.patch").write_text(
        make_patch("Add OTHER_FLAG", "vllm/envs.py", envs_edit_1(ENVS_PY),
                   envs_edit_2(envs_edit_1(ENVS_PY))))
    with open(fs.patches / "series", "a") as f:
        f.write("0003-other-flag.patch\n")
    _ok(fs.run("apply"))
    assert _subjects(fs)[-1] == "Add OTHER_FLAG"
    assert "OTHER_FLAG = 1" in (fs.build / "vllm/envs.py").read_text()


def test_patch_with_stale_context_stops_at_that_patch(fake_series):
    """Zero fuzz: one changed context line is enough to refuse the hunk."""
    fs = fake_series
    stale_base = ENVS_PY.replace("VALUE_14 = 14", "VALUE_14 = 1400")
    (fs.patches / "0003-other-flag.patch").write_text(
        make_patch("Add OTHER_FLAG", "vllm/envs.py", stale_base, envs_edit_2(stale_base)))
    with open(fs.patches / "series", "a") as f:
        f.write("0003-other-flag.patch\n")
    proc = fs.run("apply")
    assert proc.returncode == 2
    err = proc.stderr
    assert "patches/0003-other-flag.patch does not apply" in err
    assert "hunk #1 of vllm/envs.py" in err and "does not match" in err
    assert "Traceback" not in err
    assert _subjects(fs)[-1] == "Comment sub"  # the last good commit
    assert fs.git("status", "--porcelain") == ""
    assert "last good commit" in err


def test_patch_adding_trailing_whitespace_is_refused(fake_series):
    fs = fake_series
    (fs.patches / "0003-ws.patch").write_text(
        make_patch("Whitespace", "vllm/envs.py", envs_edit_1(ENVS_PY),
                   envs_edit_1(ENVS_PY).replace("VALUE_18 = 18\n", "VALUE_18 = 18  \n")))
    with open(fs.patches / "series", "a") as f:
        f.write("0003-ws.patch\n")
    proc = fs.run("apply")
    assert proc.returncode == 2
    assert "0003-ws.patch does not apply" in proc.stderr and "whitespace" in proc.stderr.lower()


def test_apply_refuses_to_clobber_uncommitted_edits(fake_series):
    fs = fake_series
    _ok(fs.run("apply"))
    edited = fs.build / "vllm/utils.py"
    edited.write_text(edited.read_text() + "# my local work\n")
    proc = fs.run("apply")
    assert proc.returncode == 2
    assert "uncommitted changes" in proc.stderr and "vllm/utils.py" in proc.stderr
    assert "make refresh" in proc.stderr and "FORCE=1" in proc.stderr
    assert edited.read_text().endswith("# my local work\n")  # nothing lost
    # The patch set changing does not make it any less refused.
    (fs.patches / "series").write_text("0001-add-series-flag.patch\n0002-check-sub.patch\n")
    assert fs.run("apply").returncode == 2
    assert edited.read_text().endswith("# my local work\n")


def test_apply_refuses_to_clobber_unsaved_commits_until_forced(fake_series):
    fs = fake_series
    _ok(fs.run("apply"))
    pristine_tree = fs.tree()
    (fs.build / "vllm/utils.py").write_text("changed\n")
    fs.git("commit", "-qam", "My experiment")
    proc = fs.run("apply")
    assert proc.returncode == 2
    assert "commits that are not in the series" in proc.stderr and "My experiment" in proc.stderr
    assert _subjects(fs)[-1] == "My experiment"
    _ok(fs.run("apply", "--force"))
    assert fs.tree() == pristine_tree


# --- sdist pin -------------------------------------------------------------

def test_wrong_sha256_is_refused_and_nothing_deleted(fake_series):
    fs = fake_series
    _ok(fs.run("apply"))
    tree = fs.tree()
    pins = (fs.root / "pins.env").read_text()
    good = [ln.split("=", 1)[1] for ln in pins.splitlines() if ln.startswith("VLLM_SDIST_SHA256=")][0]
    bad = "0" * 64
    (fs.root / "pins.env").write_text(pins.replace(good, bad))
    proc = fs.run("apply")
    assert proc.returncode == 2
    assert str(fs.sdist) in proc.stderr and good in proc.stderr and bad in proc.stderr
    assert "Traceback" not in proc.stderr
    assert fs.sdist.exists() and fs.tree() == tree  # cache and build tree untouched


def test_no_network_and_no_cache_is_one_clear_error(fake_series, tmp_path):
    fs = fake_series
    empty_cache = tmp_path / "empty-cache"
    proc = fs.run("apply", env={"SERIES_CACHE": str(empty_cache),
                                "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                                "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"})
    assert proc.returncode == 2
    assert "cannot get vllm==9.9.9" in proc.stderr
    assert f"No cached copy at {empty_cache}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not fs.build.exists()


# --- refresh -----------------------------------------------------------------

def _commit_repo(fs):
    fs.git("add", "-A", cwd=fs.root)
    fs.git("commit", "-qm", "series", cwd=fs.root)


def test_refresh_round_trip_changes_nothing(fake_series):
    fs = fake_series
    _commit_repo(fs)
    _ok(fs.run("apply"))
    proc = _ok(fs.run("refresh"))
    assert "nothing changed" in proc.stdout
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""


def test_refresh_keeps_patches_that_apply_at_an_offset(fake_series):
    """Two patches made against pristine upstream (as topics are) stay byte for byte."""
    fs = fake_series
    (fs.patches / "0003-other-flag.patch").write_text(
        make_patch("Add OTHER_FLAG", "vllm/envs.py", ENVS_PY, envs_edit_2(ENVS_PY)))
    with open(fs.patches / "series", "a") as f:
        f.write("0003-other-flag.patch\n")
    _commit_repo(fs)
    _ok(fs.run("apply"))
    assert "nothing changed" in _ok(fs.run("refresh")).stdout
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""


def test_refresh_saves_new_commits_as_patches_and_overlay(fake_series):
    fs = fake_series
    _commit_repo(fs)
    _ok(fs.run("apply"))
    (fs.build / "vllm/utils.py").write_text((fs.build / "vllm/utils.py").read_text() + "\n\nMUL = 3\n")
    (fs.build / "vllm/ops/another.py").write_text("X = 1\n")
    fs.git("add", "-A")
    fs.git("commit", "-qm", commit_message("Add MUL constant"))
    edited_tree = fs.tree()
    report = _ok(fs.run("refresh")).stdout
    assert "patches/0003-add-mul-constant.patch" in report
    assert "vllm_overlay/vllm/ops/another.py" in report
    new_patch = (fs.patches / "0003-add-mul-constant.patch").read_text()
    assert new_patch.startswith("Subject: Add MUL constant\nTopic: fetch-kv\nWhy: because the test says so,\n"
                                "  on two lines.\n")
    assert "\n---\ndiff --git a/vllm/utils.py b/vllm/utils.py\n" in new_patch
    assert "\nindex " not in new_patch and "+MUL = 3" in new_patch
    assert (fs.patches / "series").read_text().splitlines()[-1] == "0003-add-mul-constant.patch"
    assert "# utils" in (fs.patches / "series").read_text()  # comments survive
    # The build tree is now in sync: apply keeps it; a forced rebuild reproduces the content.
    assert "up to date" in _ok(fs.run("apply")).stdout
    _ok(fs.run("apply", "--force"))
    assert fs.tree() == edited_tree
    assert "series OK (3 patches, 2 overlay files)" in _ok(fs.run("check")).stdout


def test_refresh_refuses_a_commit_without_header_fields(fake_series):
    """A commit message that is not a patch header is refused before anything is written."""
    fs = fake_series
    _commit_repo(fs)
    _ok(fs.run("apply"))
    (fs.build / "vllm/utils.py").write_text((fs.build / "vllm/utils.py").read_text() + "\nMUL = 3\n")
    (fs.build / "vllm/ops/another.py").write_text("X = 1\n")
    fs.git("add", "-A")
    fs.git("commit", "-qm", "Add MUL constant\n\nTopic: misc\nWhy: a reason.\nUpstream: none")
    proc = fs.run("refresh")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "'Add MUL constant': lacks the header field(s) How, Drop when, Tested on" in err
    assert "unknown Topic 'misc' (one of order-contract, fetch-kv, mla-fusion)" in err
    assert "Topic: order-contract | fetch-kv | mla-fusion" in err and "Nothing was written." in err
    assert "Traceback" not in err
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""   # no patch, no overlay file written
    # Reworded with the full header, the same commit is saved.
    fs.git("commit", "-q", "--amend", "-m", commit_message("Add MUL constant"))
    assert "patches/0003-add-mul-constant.patch" in _ok(fs.run("refresh")).stdout


def test_refresh_refuses_an_overlay_only_commit_without_header_fields(fake_series):
    """A commit that only adds a new file is held to the same header as a patch commit."""
    fs = fake_series
    _commit_repo(fs)
    _ok(fs.run("apply"))
    (fs.build / "vllm/ops/another.py").write_text("X = 1\n")
    fs.git("add", "-A")
    fs.git("commit", "-qm", "wip")
    proc = fs.run("refresh")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "'wip': lacks the header field(s) Topic, Why, How, Upstream, Drop when, Tested on" in proc.stderr
    assert "Nothing was written." in proc.stderr and "Traceback" not in proc.stderr
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""
    assert not (fs.root / "vllm_overlay/vllm/ops/another.py").exists()
    fs.git("commit", "-q", "--amend", "-m", commit_message("Add another op", path="vllm/ops/another.py"))
    assert "vllm_overlay/vllm/ops/another.py" in _ok(fs.run("refresh")).stdout


def test_refresh_is_deterministic(fake_series):
    fs = fake_series
    _commit_repo(fs)
    _ok(fs.run("apply"))
    (fs.build / "vllm/utils.py").write_text("def add(a, b):\n    return b + a\n")
    fs.git("commit", "-qam", commit_message("Swap operands"))
    _ok(fs.run("refresh"))
    first = {p.name: p.read_text() for p in fs.patches.iterdir()}
    state = json.loads((fs.build / ".git/series-state.json").read_text())
    _ok(fs.run("refresh"))
    assert {p.name: p.read_text() for p in fs.patches.iterdir()} == first
    assert json.loads((fs.build / ".git/series-state.json").read_text())["head"] == state["head"]


# --- check -------------------------------------------------------------------

def test_check_passes_on_a_good_series(fake_series):
    proc = fake_series.run("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "series OK (2 patches, 1 overlay files)" in proc.stdout
    assert not fake_series.build.exists()  # check never touches build/vllm


def test_check_reports_every_finding(fake_series):
    fs = fake_series
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
    assert "unknown Topic 'misc'" in out
    assert "0001-add-series-flag.patch: has 'index' lines" in out
    assert "vllm_overlay/vllm/utils.py: shadows a file upstream has" in out
    assert ("not run: the zero-fuzz apply, topic-alone, target-stack and pre-commit hook checks, because "
            "vllm_overlay/ must only add files") in out
    (fs.root / "vllm_overlay/vllm/utils.py").unlink()
    assert ("not run: the zero-fuzz apply, topic-alone, target-stack and pre-commit hook checks, because "
            "patches/series lists 0009-missing.patch, but patches/0009-missing.patch does not exist"
            in fs.run("check").stdout)


def test_check_reports_a_patch_that_does_not_apply(fake_series):
    fs = fake_series
    text = (fs.patches / "0002-check-sub.patch").read_text()
    (fs.patches / "0002-check-sub.patch").write_text(text.replace(" def sub(a, b):", " def sub(x, y):"))
    proc = fs.run("check")
    assert proc.returncode == 1
    assert "patches/0002-check-sub.patch does not apply: hunk #1 of vllm/utils.py" in proc.stdout
    assert "topic fetch-kv: patches/0002-check-sub.patch does not apply on pristine upstream" in proc.stdout
    assert ("not run: the pre-commit hooks, because patches/0002-check-sub.patch does not apply"
            in proc.stdout)


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


def test_a_broken_doc_link_does_not_stop_the_other_checks(fake_series):
    """Every check runs: past a doc-link finding the series is still applied, each topic
    alone, and upstream's hooks run (this config's one hook fails on any file)."""
    fs = fake_series
    fs.upstream({**UPSTREAM, ".pre-commit-config.yaml": FAILING_HOOK})
    (fs.root / "docs").mkdir()
    (fs.root / "docs/topics.md").write_text("[the design](missing.md)\n")
    fs.git("add", "docs/topics.md", cwd=fs.root)
    proc = fs.run("check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "docs/topics.md:1: link 'missing.md': docs/missing.md does not exist" in proc.stdout
    assert "check: topic fetch-kv alone on pristine upstream" in proc.stderr
    assert "pre-commit hook always-fails failed (exit 1):" in proc.stdout
    assert "make check: 2 finding(s)" in proc.stdout


def test_overlay_shadowing_stops_apply(fake_series):
    fs = fake_series
    (fs.root / "vllm_overlay/vllm/envs.py").write_text("shadow\n")
    proc = fs.run("apply")
    assert proc.returncode == 2
    assert "vllm_overlay/vllm/envs.py" in proc.stderr and "patch instead" in proc.stderr
