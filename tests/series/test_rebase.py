"""make rebase on a fake upstream: clean, merged, dropped, conflict + CONTINUE, ABORT."""

from __future__ import annotations

import hashlib
import sys

from fake_upstream import ENVS_PY, REPO, UPSTREAM, envs_edit_2, make_patch, ok, write_sdist

sys.path.insert(0, str(REPO / "scripts"))
from seriestool import readme, rebase  # noqa: E402
from seriestool.buildtree import Layout  # noqa: E402

NEXT = "9.10.0"
# The next fake release. envs.py gains 5 lines at the top (0001's hunk moves) and edits the
# first context line of 0003's hunk (zero fuzz refuses it, a three-way merge does not);
# utils.py changes the very line 0002 changes (a conflict); README.md already has 0005's
# change (the commit becomes empty); vllm/__init__.py is untouched (0004 is clean).
NEXT_ENVS = "# new upstream header\n" * 5 + ENVS_PY.replace("VALUE_14 = 14\n", "VALUE_14 = 14  # upstream note\n")
NEXT_UPSTREAM = {
    **UPSTREAM,
    "vllm/envs.py": NEXT_ENVS,
    "vllm/utils.py": UPSTREAM["vllm/utils.py"].replace("return a - b", "return a - b  # upstream"),
    "README.md": "fake upstream, patched\n",
    "vllm/_version.py": "__version__ = version = '9.10.0'\n__commit_id__ = commit_id = 'gnext1234'\n",
    "docker/Dockerfile.rocm_base": 'ARG BASE_IMAGE=x\nARG AITER_BRANCH="v0.0.2"\n',
}
RESOLVED = "return a - b  # upstream, checked"


def _prepare(fs) -> str:
    """Three more patches, the series committed, the next release's sdist in the cache."""
    fs.add_patch("0003-other-flag.patch",
         make_patch("Add OTHER_FLAG", "vllm/envs.py", ENVS_PY, envs_edit_2(ENVS_PY)))
    init = UPSTREAM["vllm/__init__.py"]
    fs.add_patch("0004-init-marker.patch",
         make_patch("Mark the package", "vllm/__init__.py", init, init + "SERIES = True\n"))
    fs.add_patch("0005-readme.patch",
         make_patch("README note", "README.md", UPSTREAM["README.md"], "fake upstream, patched\n"))
    (fs.root / "README.md").write_text(f"# Fake series\n\n{readme.BEGIN}\n{readme.END}\n")
    ok(fs.run("readme"))
    fs.commit("the series")
    sdist = fs.cache / f"vllm-{NEXT}.tar.gz"
    write_sdist(sdist, NEXT_UPSTREAM, version=NEXT)
    return hashlib.sha256(sdist.read_bytes()).hexdigest()


def test_rebase_reports_the_conflict_resumes_and_classifies_every_patch(fake_series):
    fs = fake_series
    sha = _prepare(fs)
    ok(fs.run("apply"))
    build_head = fs.git("rev-parse", "HEAD")
    pins_before = (fs.root / "pins.env").read_text()
    kept = (fs.patches / "0004-init-marker.patch").read_bytes()

    proc = fs.run("rebase", "--version", NEXT, "--sha256", sha)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    rebase_tree = fs.root / "build" / "rebase" / "vllm"
    # Patches are counted without the overlay commit; the only line numbers are the file's own.
    assert out.startswith("rebase: conflict in patches/0002-check-sub.patch (patch 2 of 5, vLLM 9.9.9 -> 9.10.0)\n"
                          "  Drop when: never\n"
                          "  vllm/utils.py: both changed it; conflict markers at lines 6-12 of "
                          f"{rebase_tree / 'vllm/utils.py'}\n"
                          "    patch hunk #1 changes:\n"
                          "      -    return a - b\n"
                          "      +    return a - b  # checked\n"
                          "    upstream (9.9.9 -> 9.10.0) changed there:\n"
                          "      -    return a - b\n"
                          "      +    return a - b  # upstream\n"), out
    assert "@@" not in out and "make rebase CONTINUE=1" in out and "make rebase ABORT=1" in out
    lines = (rebase_tree / "vllm/utils.py").read_text().splitlines()
    assert lines[5].startswith("<<<<<<< ") and lines[11].startswith(">>>>>>> ") and "||||||| " in lines[7]
    # Nothing of the checkout moved while the rebase waits.
    assert (fs.root / "pins.env").read_text() == pins_before and fs.git("status", "--porcelain", cwd=fs.root) == ""

    # A file that still has markers is refused, naming it.
    proc = fs.run("rebase", "--continue")
    assert proc.returncode == 2 and "conflict markers are still there" in proc.stderr
    assert "vllm/utils.py:" in proc.stderr

    (rebase_tree / "vllm/utils.py").write_text(
        UPSTREAM["vllm/utils.py"].replace("return a - b", RESOLVED))
    out = ok(fs.run("rebase", "--continue")).stdout
    rows = {line.split(" | ")[1]: line for line in out.splitlines() if line.startswith("| ")}
    assert rows["`overlay`"] == "| – | `overlay` | clean |  |"
    assert rows["`0001-add-series-flag.patch`"].startswith("| 1 | `0001-add-series-flag.patch` | merged |")
    assert rows["`0002-check-sub.patch`"] == ("| 2 | `0002-check-sub.patch` | resolved by hand | "
                                              "conflict in vllm/utils.py |")
    assert "| merged |" in rows["`0003-other-flag.patch`"] and "| clean |" in rows["`0004-init-marker.patch`"]
    assert "| dropped: upstream has it | became empty on vLLM 9.10.0 |" in rows["`0005-readme.patch`"]
    assert "`make check` on the result: series OK (4 patches, 1 overlay files)" in out
    table = (fs.root / "build" / f"rebase-{NEXT}.md").read_text()
    assert table.startswith("# Rebase of the series: vLLM 9.9.9 -> 9.10.0")

    # The checkout now holds the port: pins, refreshed patches, the dropped patch gone.
    pins = (fs.root / "pins.env").read_text()
    assert f"VLLM_VERSION={NEXT}\n" in pins and f"VLLM_SDIST_SHA256={sha}\n" in pins
    assert "VLLM_COMMIT=gnext1234\n" in pins and "AITER_REF=v0.0.2\n" in pins and "# fake pins\n" in pins
    assert (fs.patches / "series").read_text().split() == [
        "#", "The", "fake", "series.", "0001-add-series-flag.patch", "#", "utils", "0002-check-sub.patch",
        "0003-other-flag.patch", "0004-init-marker.patch"]
    assert not (fs.patches / "0005-readme.patch").exists()
    # README's series table follows: no link to the dropped patch, nothing left to remedy.
    text = (fs.root / "README.md").read_text()
    assert readme.render(fs.root, text) == text and "0005-readme.patch" not in text
    assert "README.md: series table rewritten" in out
    assert (fs.patches / "0004-init-marker.patch").read_bytes() == kept        # clean: byte for byte
    assert "@@ -9,6 +9,7 @@" in (fs.patches / "0001-add-series-flag.patch").read_text()  # renumbered
    assert f"+    {RESOLVED}" in (fs.patches / "0002-check-sub.patch").read_text()
    assert not (fs.root / "build" / "rebase").exists()
    assert fs.git("rev-parse", "HEAD") == build_head     # build/vllm untouched until make apply

    ok(fs.run("apply"))
    assert fs.git("log", "--reverse", "--format=%s").splitlines()[0] == f"vLLM {NEXT} pristine (upstream gnext1234)"
    assert RESOLVED in (fs.build / "vllm/utils.py").read_text()
    assert "OTHER_FLAG = 1" in (fs.build / "vllm/envs.py").read_text()


def test_rebase_guards_and_an_all_or_nothing_finish(fake_series):
    fs = fake_series
    sha = _prepare(fs)
    (fs.root / "pins.env").write_text((fs.root / "pins.env").read_text() + "# local edit\n")
    proc = fs.run("rebase", "--version", NEXT, "--sha256", sha)
    assert proc.returncode == 2 and "uncommitted changes: commit or stash them first" in proc.stderr
    fs.git("checkout", "--", "pins.env", cwd=fs.root)
    assert "64-hex-digit sha256" in fs.run("rebase", "--version", NEXT, "--sha256", "abc").stderr
    bad = fs.run("rebase", "--version", NEXT, "--sha256", "0" * 64)
    assert bad.returncode == 2 and "sha256 mismatch" in bad.stderr and "Traceback" not in bad.stderr
    assert not (fs.root / "build" / "rebase").exists()

    assert fs.run("rebase", "--version", NEXT, "--sha256", sha).returncode == 1      # stops at the conflict
    again = fs.run("rebase", "--version", NEXT, "--sha256", sha)
    assert again.returncode == 2 and "a rebase to vLLM 9.10.0 is in progress" in again.stderr
    (fs.patches / "0004-init-marker.patch").write_text("edited while the rebase waits\n")
    changed = fs.run("rebase", "--continue")
    assert changed.returncode == 2 and "changed since the rebase started" in changed.stderr
    fs.git("checkout", "--", "patches", cwd=fs.root)
    tree = fs.root / "build" / "rebase" / "vllm"
    (tree / "vllm/utils.py").write_text(UPSTREAM["vllm/utils.py"].replace("return a - b", RESOLVED))
    sdist = fs.cache / f"vllm-{NEXT}.tar.gz"
    sdist.write_bytes(b"damaged")      # make check cannot run at finish
    for _ in range(2):                 # CONTINUE=1 again fails the same way, from the same checkout
        proc = fs.run("rebase", "--continue")
        assert proc.returncode == 2 and "sha256 mismatch" in proc.stderr, proc.stdout + proc.stderr
        assert ("patches/, vllm_overlay/, pins.env and README.md restored as they were; "
                f"{fs.root / 'build' / 'rebase'} kept") in proc.stderr
        assert fs.git("status", "--porcelain", cwd=fs.root) == "" and (tree / ".git").is_dir()
    # As if finish was killed while it wrote: its snapshot taken, the checkout half written.
    paths = rebase.Paths.of(Layout(fs.root, fs.build))
    rebase._snapshot(Layout(fs.root, fs.build), paths, rebase._load(paths))
    (fs.root / "pins.env").write_text("half written\n")
    (fs.patches / "0005-readme.patch").unlink()
    (fs.patches / "0009-new.patch").write_text("written by the killed finish\n")
    proc = ok(fs.run("rebase", "--abort"))
    assert proc.stdout.startswith("rebase to vLLM 9.10.0 dropped") and proc.stdout.endswith(
        "restored to what they were before an interrupted finish wrote them\n")
    assert fs.git("status", "--porcelain", "--untracked-files=all", cwd=fs.root) == ""
    assert not (fs.root / "build" / "rebase").exists()
    assert "no rebase in progress" in fs.run("rebase", "--continue").stderr
    assert "none in progress" in ok(fs.run("rebase", "--abort")).stdout


def test_rebase_conflict_where_upstream_deleted_a_patched_file(fake_series):
    """The modify/delete help; resolved to no change, the patch is dropped; make check's finding
    (a note's link to the dropped patch) does not undo the port, it is said so."""
    fs = fake_series
    _prepare(fs)
    patch = fs.patches / "0002-check-sub.patch"
    patch.write_text(patch.read_text().replace("Drop when: never", "Drop when: upstream drops vllm/utils.py"))
    (fs.root / "notes.md").write_text("See [the utils patch](patches/0002-check-sub.patch).\n")
    fs.commit("0002's drop condition")
    sdist = fs.cache / f"vllm-{NEXT}.tar.gz"
    write_sdist(sdist, {k: v for k, v in NEXT_UPSTREAM.items() if k != "vllm/utils.py"}, version=NEXT)
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    proc = fs.run("rebase", "--version", NEXT, "--sha256", sha)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    tree = fs.root / "build" / "rebase" / "vllm"
    assert proc.stdout.startswith(
        "rebase: conflict in patches/0002-check-sub.patch (patch 2 of 5, vLLM 9.9.9 -> 9.10.0)\n"
        "  Drop when: upstream drops vllm/utils.py\n"
        "  vllm/utils.py: upstream deleted it (or moved it where git could not follow)\n"
        "    the patch changes it:\n"
        "      -    return a - b\n"
        "      +    return a - b  # checked\n"
        "    to drop the patch's change to it (upstream's deletion stands): "
        f"git -C {tree} rm vllm/utils.py\n"
        "    to restore it (as the patch leaves it; git left that in the tree): leave it, CONTINUE=1 stages it\n"
    ), proc.stdout
    fs.git("rm", "-q", "vllm/utils.py", cwd=tree)
    proc = fs.run("rebase", "--continue")
    out = proc.stdout
    assert "| dropped by hand | conflict in vllm/utils.py; resolved to no change |" in out
    assert "0002-check-sub.patch" not in (fs.patches / "series").read_text()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "`make check` on the result: 1 finding(s): notes.md:1: link 'patches/0002-check-sub.patch'" in out
    assert out.endswith("The port is written (patches/, vllm_overlay/, pins.env and README.md); `make check` "
                        "found 1 finding(s), listed in the table above: fix them, and `make check` again, "
                        "before committing the port.\n")
    assert f"VLLM_VERSION={NEXT}\n" in (fs.root / "pins.env").read_text()
    assert not (fs.root / "build" / "rebase").exists()
