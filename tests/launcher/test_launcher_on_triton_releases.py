"""triton_launcher on every Triton release it claims (pins.env TRITON_LAUNCHER_RELEASES).

Each case runs ``first_launch.py`` in a fresh process on a real Triton wheel
(scripts/triton_releases.py) with a stand-in driver for an NVIDIA (sm_90) or AMD
(gfx942) target: ``kernel[grid]`` really specialises and compiles, and the code
that runs on the first compiled launch (``launch_path()``: the capability checks
and the pointer probe) is not stubbed.  For every call, the compiled kernel
whose launcher the call reached must be the one ``JITFunction.run`` itself
selects for the same arguments (``warmup=True``), a direct launch must hand
that launcher exactly what Triton's own launch handed it, and only new
specialisations go through ``JITFunction.run``.
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

RELEASES = load_pins(ROOT)["TRITON_LAUNCHER_RELEASES"].split(",")
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
        # test_pointer_probe_on_each_release covers 3.4's AMD backend.
        pytest.skip("Triton 3.4 links AMD code with ROCm's ld.lld (/opt/rocm), which a CPU "
                    "machine has no copy of; later releases link in-process")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("first_launch.py")), target],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = proc.stderr
    return result


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("release", RELEASES)
def test_direct_launch_matches_triton_on_each_release(release, target, tmp_path):
    result = _first_launch(release, target, tmp_path)
    assert result["triton"] == release
    assert result["direct"], result["reason"]
    calls = result["calls"]
    # Every call reached the launcher of the kernel Triton selects.
    assert [c["launcher"] for c in calls] == [c["picked"] for c in calls]
    # Only a new specialisation goes through JITFunction.run: the first call,
    # the misaligned tensor (2) and, where the backend specialises on a storage
    # within 2 GiB (AMD buffer ops), the big storage (6).
    new = {0, 2} | ({6} if result["pointer_key"] == "alignment+2GiB" else set())
    assert {i for i, c in enumerate(calls) if c["jit"]} == new
    # A direct launch with no hook set hands the launcher what Triton's own
    # launch handed it, less the launch metadata and the (empty) hooks.
    quiet = ["None"] * 3
    for direct, jit in ((1, 0), (3, 2), (4, 0)):
        assert calls[direct]["args"][:6] == calls[jit]["args"][:6]
        assert calls[direct]["args"][6:9] == quiet
        assert calls[direct]["args"][9:] == calls[jit]["args"][9:]
    assert "run() when no launch hook is set" in result["reason"]
    # A launch hook set later: the launch goes through CompiledKernel[grid],
    # which hands the launcher the hook and the launch metadata itself.
    assert calls[5]["args"][7] == result["hook"] and calls[5]["args"][6] != "None"
    assert calls[5]["args"][:6] == calls[0]["args"][:6] and calls[5]["args"][9:] == calls[0]["args"][9:]
    # The path and its reason are logged once, at info.
    assert result["log"].count("launches (") == 1
    if target.startswith("cuda"):
        assert result["pointer_key"] == "alignment"


@pytest.mark.parametrize("release", RELEASES)
def test_pointer_probe_on_each_release(release, tmp_path):
    """The probe finds what each backend specialises pointers on: NVIDIA 16-byte
    alignment; AMD alignment and, with buffer ops on, a storage within 2 GiB."""
    keys = _first_launch(release, "probe", tmp_path)
    assert keys["cuda"] == "alignment"
    assert keys["hip_buffer_ops_1"] == "alignment+2GiB"
    assert keys["hip_buffer_ops_0"] == "alignment"
