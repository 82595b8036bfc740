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
from fake_upstream import REPO, ok


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
                                        ("moving the new tree", "ctrl-c")])
def test_interrupted_rebuild_leaves_the_previous_tree_or_none(fake_series, slow_git, stage, how):
    fs = fake_series
    ok(fs.run("apply"))
    before = _tree_state(fs)
    status, rest = _interrupt(fs, slow_git, stage, how, "--force")
    assert status in (0, 130) and "Traceback" not in "\n".join(rest)   # 0: the signal came after the end
    assert _tree_state(fs) in (before, None)      # same inputs: a new tree has the same HEAD
    if status == 130:
        assert rest[-1].startswith("apply: interrupted; ") and "`make apply`" in rest[-1], rest
    ok(fs.run("apply"))                          # a plain apply recovers
    assert _tree_state(fs) == before
    assert [p.name for p in fs.build.parent.iterdir()] == ["vllm"]


def test_killed_apply_is_recovered_by_a_plain_apply(fake_series, slow_git):
    """SIGKILL runs no clean-up: the scratch tree stays behind until the next apply removes it,
    also when the kill came between retiring the old tree and renaming the new one in."""
    fs = fake_series
    ok(fs.run("apply"))
    before = _tree_state(fs)
    status, _ = _interrupt(fs, slow_git, "committing pristine", "kill", "--force")
    assert status == -signal.SIGKILL
    assert _tree_state(fs) == before and (fs.build.parent / ".vllm.new").is_dir()
    proc = ok(fs.run("apply"))
    assert "removed what an interrupted run left: .vllm.new" in proc.stderr and "up to date" in proc.stdout
    fs.build.rename(fs.build.parent / ".vllm.old")
    shutil.copytree(fs.build.parent / ".vllm.old", fs.build.parent / ".vllm.new", symlinks=True)
    proc = ok(fs.run("apply"))
    assert "removed what an interrupted run left: .vllm.new, .vllm.old" in proc.stderr
    assert _tree_state(fs) == before and [p.name for p in fs.build.parent.iterdir()] == ["vllm"]
