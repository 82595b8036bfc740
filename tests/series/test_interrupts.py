"""An interrupted make apply leaves the previous tree or none, prints one line, and recovers.

A stand-in ``git`` on PATH sleeps before every call, so each stage of apply lasts
long enough to be hit: the test waits for the stage's progress line on stderr,
then interrupts (Ctrl-C to the process group, SIGTERM to the process, or SIGKILL).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fake_upstream import REPO

STAGES = ("unpacking", "committing pristine", "overlay:", "patch 2/2", "moving the new tree",
          "removing the previous tree")


def _ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture
def slow_git(tmp_path: Path) -> dict[str, str]:
    shim = tmp_path / "slow-git"
    shim.mkdir()
    real = shutil.which("git")
    (shim / "git").write_text(f"#!/bin/sh\nsleep 0.2\nexec {real} \"$@\"\n")
    (shim / "git").chmod(0o755)
    return {"PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}


def _interrupt(fs, env: dict, stage: str, how: str, *args: str) -> tuple[int, list[str]]:
    """Run series.py apply, interrupt it when `stage` starts; (exit status, stderr lines after it)."""
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "series.py"), "--root", str(fs.root),
                             "apply", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SERIES_CACHE": str(fs.cache), **env}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("apply: ") and stage in line:
                break
        else:
            pytest.fail(f"apply ended before stage {stage!r}: {''.join(seen)}")
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)     # what the terminal does: python and its git
        else:
            os.kill(proc.pid, {"term": signal.SIGTERM, "kill": signal.SIGKILL}[how])
        rest = proc.stderr.read().splitlines()
        return proc.wait(timeout=60), rest
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _tree_state(fs) -> str | None:
    if not fs.build.exists():
        return None
    assert (fs.build / ".git").is_dir(), "half a tree: build/vllm without its .git"
    assert fs.git("status", "--porcelain") == "", "half a tree: uncommitted files"
    return fs.git("rev-parse", "HEAD")


@pytest.mark.parametrize("stage, how", [("unpacking", "ctrl-c"), ("patch 2/2", "term"),
                                        ("moving the new tree", "ctrl-c"), ("removing the previous tree", "term")])
def test_interrupted_forced_rebuild_keeps_the_previous_tree_or_none(fake_series, slow_git, stage, how):
    fs = fake_series
    _ok(fs.run("apply"))
    before = _tree_state(fs)
    status, rest = _interrupt(fs, slow_git, stage, how, "--force")
    after = _tree_state(fs)
    if status == 0:        # the signal came after the swap and apply's last line: a finished tree
        assert after == before
    else:
        assert status == 130, rest
        # Under load apply may print later stages' lines before the signal lands: every line
        # after the one waited for is a later stage, the last is the one interrupted line.
        *progressed, said = rest
        assert said.startswith("apply: interrupted; "), rest
        later = STAGES[STAGES.index(stage):]  # a "still running" tick of it, or a later stage
        reached = [stage]
        for line in progressed:
            hit = [s for s in later if line.startswith("apply: ") and s in line]
            assert hit, f"not a later stage's line: {line!r} in {rest}"
            reached.append(hit[0])
        assert after in (before, None)       # same inputs, so the new tree has the same HEAD too
        if after is None:
            assert "is absent (never half a tree); a plain `make apply` builds it again" in said
        else:
            assert "untouched; a plain `make apply` starts again" in said or "is the new tree" in said
        if reached[-1] == "removing the previous tree":
            assert said == (f"apply: interrupted; {fs.build} is the new tree (what is left of the previous "
                            "one goes with the next `make apply`)")
        elif reached[-1] != "moving the new tree":
            assert said == f"apply: interrupted; {fs.build} untouched; a plain `make apply` starts again"
    assert "Traceback" not in "\n".join(rest)
    # A plain apply (no FORCE) recovers: scratch trees gone, the series built.
    _ok(fs.run("apply"))
    assert _tree_state(fs) == before
    assert sorted(p.name for p in fs.build.parent.iterdir()) == [".vllm.lock", "vllm"]


def test_interrupted_first_apply_leaves_no_tree(fake_series, slow_git):
    fs = fake_series
    status, rest = _interrupt(fs, slow_git, "patch 1/2", "ctrl-c")
    assert status == 130 and rest == ["apply: interrupted; no " + str(fs.build) +
                                      " was made; a plain `make apply` starts again"]
    assert not fs.build.exists()
    _ok(fs.run("apply"))
    assert _tree_state(fs) is not None


def test_killed_apply_is_recovered_by_a_plain_apply(fake_series, slow_git):
    """SIGKILL runs no clean-up: the scratch tree stays behind until the next apply removes it."""
    fs = fake_series
    _ok(fs.run("apply"))
    before = _tree_state(fs)
    status, _ = _interrupt(fs, slow_git, "committing pristine", "kill", "--force")
    assert status == -signal.SIGKILL
    assert _tree_state(fs) == before and (fs.build.parent / ".vllm.new").is_dir()
    proc = _ok(fs.run("apply"))
    assert "removed what an interrupted run left: .vllm.new" in proc.stderr
    assert "up to date" in proc.stdout and not (fs.build.parent / ".vllm.new").exists()


def test_a_crash_between_the_two_renames_is_recovered(fake_series):
    """Killed after the old tree was retired and before the new one was renamed in."""
    fs = fake_series
    _ok(fs.run("apply"))
    before = _tree_state(fs)
    fs.build.rename(fs.build.parent / ".vllm.old")
    shutil.copytree(fs.build.parent / ".vllm.old", fs.build.parent / ".vllm.new", symlinks=True)
    proc = _ok(fs.run("apply"))
    assert "removed what an interrupted run left: .vllm.new, .vllm.old" in proc.stderr
    assert _tree_state(fs) == before
    assert sorted(p.name for p in fs.build.parent.iterdir()) == [".vllm.lock", "vllm"]
