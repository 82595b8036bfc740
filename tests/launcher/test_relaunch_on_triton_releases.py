"""KernelCall's relaunch on every Triton release triton_launch.TESTED_TRITON claims
(pins.env TRITON_RELAUNCH_RELEASES), each a real wheel in ``<series cache>/triton/<version>``.

Each case runs ``first_launch.py`` in a fresh process with a stand-in driver for an NVIDIA
(sm_90) or AMD (gfx942) target: every call must reach the launcher of the compiled kernel
``JITFunction.run`` itself selects, and a relaunch must hand it exactly what Triton's own
launch handed it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from seriestool.pins import load_pins  # noqa: E402
from seriestool.sdist import cache_dir  # noqa: E402

RELEASES = load_pins(ROOT)["TRITON_RELAUNCH_RELEASES"].split(",")
TARGETS = ["cuda:90", "hip:gfx942"]

pytestmark = pytest.mark.skipif(not os.environ.get("VLLM_BUILD_TREE"),
                                reason="needs the patched tree (make test)")


def _release(version: str) -> Path:
    """The folder holding ``triton==version`` (no dependencies), installed on first use
    through a ``.partial`` folder, so an interrupted install is redone."""
    folder = cache_dir() / "triton" / version
    if not (folder / "triton" / "__init__.py").is_file():
        partial = folder.with_name(f"{version}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--target", str(partial), f"triton=={version}"], check=True)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return folder


def _first_launch(release: str, target: str, tmp: Path) -> dict:
    if target.startswith("hip") and release.startswith("3.4."):
        pytest.skip("Triton 3.4 links AMD code with ROCm's ld.lld (/opt/rocm), which a CPU "
                    "machine has no copy of; later releases link in-process")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(_release(release)), os.environ["VLLM_BUILD_TREE"]]),
        TRITON_CACHE_DIR=str(tmp / "triton-cache"),
        # vLLM enables Triton only with one active GPU driver; an empty device
        # list is its "driver not up yet" case (the stand-in becomes active later).
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("first_launch.py")), target],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_release_is_within_tested_triton():
    """Every release pinned here is inside TESTED_TRITON and its ends are pinned."""
    from vllm.v1.attention.ops.triton_launch import TESTED_TRITON

    versions = sorted(tuple(int(x) for x in r.split(".")[:2]) for r in RELEASES)
    assert versions[0] == TESTED_TRITON[0] and versions[-1] == TESTED_TRITON[1]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("release", RELEASES)
def test_relaunch_matches_triton_on_each_release(release, target, tmp_path):
    result = _first_launch(release, target, tmp_path)
    assert result["triton"] == release
    assert result["supported"]
    assert result["hip_bound"] == target.startswith("hip")
    calls = result["calls"]
    # Every call reached the launcher of the kernel Triton selects.
    assert [c["launcher"] for c in calls] == [c["picked"] for c in calls]
    # Only these go through JITFunction.run: the first call, each call with a
    # misaligned tensor (2, 3) and, on AMD (buffer ops: KernelCall keys the
    # 2 GiB bound there), the first with the big storage (6).
    new = {0, 2, 3} | ({6} if target.startswith("hip") else set())
    assert {i for i, c in enumerate(calls) if c["jit"]} == new
    # A relaunch hands the launcher exactly what Triton's own launch handed it.
    for relaunch, jit in ((1, 0), (4, 0), (7, 6)):
        assert calls[relaunch]["args"] == calls[jit]["args"], (relaunch, jit)
    # A launch hook set later: CompiledKernel[grid] hands the launcher the hook
    # and the launch metadata, the rest as before.
    assert calls[5]["args"][7] == result["hook"] and calls[5]["args"][6] != "None"
    assert calls[5]["args"][:6] == calls[0]["args"][:6] and calls[5]["args"][9:] == calls[0]["args"][9:]
