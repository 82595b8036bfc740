"""make build: the Python-only wheel of the patched tree (as `make build` builds it off ROCm),
installed with --no-deps into a scratch folder put before this environment's packages, passes
ci/smoke_import.py there and carries the patched files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREE = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm")).resolve()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TREE / ".git").exists(), reason=f"{TREE} not built (run make apply)"),
]


def _run(cmd: list, pythonpath: str = "", **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600,
                          **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _series_files(diff_filter: str, *paths: str) -> list[str]:
    """The files the series adds (A) or adds and changes (AM) in the tree, from its root commit."""
    root = _run(["git", "-C", TREE, "rev-list", "--max-parents=0", "HEAD"]).stdout.split()[-1]
    return _run(["git", "-C", TREE, "diff", "--name-only", "--no-renames",
                 f"--diff-filter={diff_filter}", root, "HEAD", "--", *paths]).stdout.splitlines()


def test_python_only_wheel_installs_and_imports(tmp_path):
    _run([sys.executable, REPO / "scripts/build_wheel.py", "--device", "empty", "--tree", TREE,
          "--dist", tmp_path / "dist"])
    (wheel,) = (tmp_path / "dist").glob("vllm-*.whl")
    assert ".empty-" in wheel.name and "dev" not in wheel.name  # the version: smoke_import

    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index",
          "--target", site, wheel])

    overlay = tmp_path / "overlay"
    for rel in _series_files("A"):
        (overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        (overlay / rel).write_bytes((TREE / rel).read_bytes())
    smoke = _run([sys.executable, REPO / "ci" / "smoke_import.py", "--overlay", overlay],
                 pythonpath=str(site), cwd=tmp_path)
    assert "smoke test passed" in smoke.stdout
    assert f"ok  vllm is installed: {site / 'vllm'}" in smoke.stdout
    # The wheel carries the patched files, byte for byte.
    changed = _series_files("AM", "vllm")
    assert changed
    for rel in changed:
        assert (site / rel).read_bytes() == (TREE / rel).read_bytes(), rel
