"""make build: the Python-only wheel of the patched tree installs and imports.

The one test that builds from the real build/vllm (make apply): the wheel is
built as `make build` builds it off ROCm (VLLM_TARGET_DEVICE=empty), installed
with --no-deps into a throwaway venv that borrows this environment's packages
(torch, vLLM's requirements) through a .pth file, and ci/smoke_import.py runs
there from outside any source tree.  About a minute on a 2-core machine.
"""

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


def _added_files(dest: Path) -> Path:
    """The files the series adds to the tree the wheel is built from (its overlay), copied to dest."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(TREE), *args], capture_output=True, text=True,
                              check=True).stdout

    root = git("rev-list", "--max-parents=0", "HEAD").split()[-1]
    for rel in git("diff", "--name-only", "--no-renames", "--diff-filter=A", root, "HEAD").splitlines():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes((TREE / rel).read_bytes())
    return dest


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

    smoke = _run([python, REPO / "ci" / "smoke_import.py", "--overlay", _added_files(tmp_path / "overlay")],
                 cwd=tmp_path)
    assert "smoke test passed" in smoke.stdout
    assert f"ok  vllm is installed: {purelib / 'vllm'}" in smoke.stdout
    # The wheel carries the patched files, byte for byte.
    root = _run(["git", "-C", TREE, "rev-list", "--max-parents=0", "HEAD"]).stdout.split()[-1]
    changed = _run(["git", "-C", TREE, "diff", "--name-only", "--no-renames", "--diff-filter=AM",
                    root, "HEAD", "--", "vllm"]).stdout.splitlines()
    assert changed
    for rel in changed:
        assert (purelib / rel).read_bytes() == (TREE / rel).read_bytes(), rel
