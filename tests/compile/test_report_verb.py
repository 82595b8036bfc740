"""make compile-report end to end (scripts/compile_tier.py report), on a clone of this checkout.

The verb runs in a ``git clone --shared`` of the repository with the working tree's
uncommitted changes applied, so this checkout is never written.  It must finish, write
roofline-amd.md's region from the committed results, touch nothing but its generated files,
give byte-identical files when run again (no times, no HEAD in them) and leave no scratch
folder in the temp directory.  The kernels' facts come from the same cache as
test_compile_tier.py (seconds after it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.compile

GENERATED = {"benchmarks/results/compile/gfx942.json", "benchmarks/results/compile/gfx950.json",
             "benchmarks/results/compile/sm_90.json", "docs/compile-tier.md", "docs/roofline-amd.md"}


def _git(repo: Path, *args: str, **kw) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, **kw).stdout


def _no_backends() -> str:
    try:
        from triton.backends import backends
    except ImportError:
        return "no triton"
    missing = {"amd", "nvidia"} - set(backends)
    return f"triton has no {sorted(missing)} backend" if missing else ""


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """This checkout as it is now (HEAD + uncommitted and untracked files), in tmp_path."""
    dest = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(dest)], check=True)
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], check=True,
                          capture_output=True).stdout
    if diff:
        subprocess.run(["git", "-C", str(dest), "apply", "--binary", "-"], input=diff, check=True)
    for rel in _git(REPO, "ls-files", "--others", "--exclude-standard").splitlines():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel, follow_symlinks=False)
    return dest


def _changed(repo: Path) -> set[str]:
    return {line[3:] for line in _git(repo, "status", "--porcelain", "--untracked-files=all").splitlines()}


def _report(repo: Path, tmpdir: Path, **env) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmpdir), **env}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, str(repo / "scripts" / "compile_tier.py"), "report"],
                            cwd=repo, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_compile_report_runs_end_to_end_and_leaves_only_its_files(clone, tmp_path):
    if reason := _no_backends():
        pytest.skip(reason)
    ours = _changed(REPO)
    before = _changed(clone)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = _report(clone, tmpdir)
    out, err = proc.communicate(timeout=3600)
    assert proc.returncode == 0, out + err
    assert "[compile-tier] kernels for gfx942, gfx950, sm_90: facts cached in" in err
    assert "[compile-report] " in out and "docs/roofline-amd.md" in out, out
    assert _changed(clone) - before <= GENERATED, _changed(clone) - before
    roofline = (clone / "docs" / "roofline-amd.md").read_text()
    region = roofline.split("<!-- roofline:begin")[1].split("<!-- roofline:end -->")[0]
    assert "### fetch_kv" in region and "### paged_context" in region and "MI300X bound µs" in region
    assert list(tmpdir.iterdir()) == [], "scratch folder left behind"
    first = {rel: (clone / rel).read_text() for rel in GENERATED}

    again = _report(clone, tmpdir)
    out, err = again.communicate(timeout=3600)
    assert again.returncode == 0, out + err
    assert {rel: (clone / rel).read_text() for rel in GENERATED} == first, "a rerun changed its files"
    assert out.count("[compile-report] unchanged ") == len(GENERATED), out
    assert _changed(REPO) == ours, "the test wrote into the checkout"
