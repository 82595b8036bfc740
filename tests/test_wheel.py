"""make build: the Python-only wheel of the patched tree (as `make build` builds it off ROCm),
installed with --no-deps into a throwaway venv that borrows this environment's packages
through a .pth file, passes ci/smoke_import.py there and carries the patched files."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREE = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm")).resolve()
sys.path.insert(0, str(REPO / "scripts"))

from seriestool.pins import load_pins  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TREE / ".git").exists(), reason=f"{TREE} not built (run make apply)"),
]


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
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
    pins = load_pins(REPO)
    _run([sys.executable, REPO / "scripts/build_wheel.py", "--device", "empty", "--tree", TREE,
          "--dist", tmp_path / "dist"])
    (wheel,) = (tmp_path / "dist").glob("vllm-*.whl")
    assert wheel.name.startswith(f"vllm-{pins['VLLM_VERSION']}+aiter.series.")
    assert ".empty-" in wheel.name and "dev" not in wheel.name

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-compile",
          "--no-index", wheel])
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                   .stdout.strip())
    (purelib / "zz-borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    overlay = tmp_path / "overlay"
    for rel in _series_files("A"):
        (overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        (overlay / rel).write_bytes((TREE / rel).read_bytes())
    smoke = _run([python, REPO / "ci" / "smoke_import.py", "--overlay", overlay], cwd=tmp_path)
    assert "smoke test passed" in smoke.stdout
    assert f"ok  vllm is installed: {purelib / 'vllm'}" in smoke.stdout
    # The wheel carries the patched files, byte for byte.
    changed = _series_files("AM", "vllm")
    assert changed
    for rel in changed:
        assert (purelib / rel).read_bytes() == (TREE / rel).read_bytes(), rel
