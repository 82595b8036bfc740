"""KernelCall's relaunch on every Triton release triton_launch.TESTED_TRITON claims
(pins.env TRITON_RELAUNCH_RELEASES).

Each case runs ``first_launch.py`` in a fresh process on a real Triton wheel
(scripts/triton_releases.py) with a stand-in driver for an NVIDIA (sm_90) or AMD
(gfx942) target: ``kernel[grid]`` really specialises and compiles, and
``relaunch_supported()`` is not stubbed.  The first call of each variant goes
through ``kernel[grid]``, later ones straight to the compiled kernel's
launcher; for every call, the compiled kernel whose launcher the call reached
must be the one ``JITFunction.run`` itself selects for the same arguments
(``warmup=True``), and a relaunch must hand that launcher what Triton's own
launch handed it (every parameter in order, the ``None`` pointer and the
constexpr included), without launch metadata and hooks unless a hook is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from seriestool.pins import load_pins  # noqa: E402
from triton_releases import install  # noqa: E402

RELEASES = load_pins(ROOT)["TRITON_RELAUNCH_RELEASES"].split(",")
TARGETS = ["cuda:90", "hip:gfx942"]

pytestmark = pytest.mark.skipif(not os.environ.get("VLLM_BUILD_TREE"),
                                reason="needs the patched tree (make test)")


def _first_launch(release: str, target: str, tmp: Path) -> dict:
    folder = install(release)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(folder), os.environ["VLLM_BUILD_TREE"]]),
        TRITON_CACHE_DIR=str(tmp / "triton-cache"),
        # vLLM enables Triton only with one active GPU driver; an empty device
        # list is its "driver not up yet" case (the stand-in becomes active later).
        CUDA_VISIBLE_DEVICES="",
    )
    if target.startswith("hip") and release.startswith("3.4."):
        pytest.skip("Triton 3.4 links AMD code with ROCm's ld.lld (/opt/rocm), which a CPU "
                    "machine has no copy of; later releases link in-process")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("first_launch.py")), target],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = proc.stderr
    return result


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
    # A relaunch hands the launcher what Triton's own launch handed it (grid,
    # stream, kernel handle, metadata, every argument), with no launch
    # metadata and no hooks, as no hook is set.
    for relaunch, jit in ((1, 0), (4, 0), (7, 6)):
        args, expected = calls[relaunch]["args"], calls[jit]["args"]
        assert args[:6] == expected[:6] and args[9:] == expected[9:], (relaunch, jit)
        assert args[6:9] == ["None", "None", "None"]
    # A launch hook set later: CompiledKernel[grid] hands the launcher the hook
    # and the launch metadata, the rest as before.
    assert calls[5]["args"][7] == result["hook"] and calls[5]["args"][6] != "None"
    assert calls[5]["args"][:6] == calls[0]["args"][:6] and calls[5]["args"][9:] == calls[0]["args"][9:]
