"""KernelCall's relaunch on every Triton release triton_launch.TESTED_TRITON claims (pins.env
TRITON_RELAUNCH_RELEASES): this file's ``main`` in a fresh process on that release, with a
stand-in driver for sm_90 or gfx942, so ``kernel[grid]`` really specialises and compiles and
only the driver's load and launch are recorded.  Every call must reach the launcher of the
kernel ``JITFunction.run`` selects, and a relaunch must hand it what Triton's launch did, the
tensors' pointers for the tensors, without launch metadata and hooks; while a launch hook is set,
every call goes through ``kernel[grid]``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from seriestool.pins import load_pins  # noqa: E402
from seriestool.sdist import cache_dir  # noqa: E402

RELEASES = load_pins(ROOT)["TRITON_RELAUNCH_RELEASES"].split(",")
TARGETS = ["cuda:90", "hip:gfx942"]


class _Launcher:
    """Stands in for the backend launcher: records (launcher, arguments) of every call."""

    instances: list = []
    calls: list = []

    def __init__(self, src, metadata):
        _Launcher.instances.append(self)

    def __call__(self, *args):
        _Launcher.calls.append((self, args))


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        # module, function, n_regs, n_spills, n_max_threads
        return object(), object(), 32, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 228 * 1024}


def _driver(target):
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    backend, arch = target.split(":")
    gpu_target = GPUTarget(backend, int(arch) if backend == "cuda" else arch,
                           32 if backend == "cuda" else 64)

    class Driver(DriverBase):
        launcher_cls = _Launcher

        def __init__(self):
            self.utils = _Utils()

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return gpu_target

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 4242

        def get_active_torch_device(self):
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_benchmarker(self):
            raise NotImplementedError

    return Driver()


def _label(arg, buf, given=()):
    """Tensors by offset (a pointer of one of the ``given`` tensors as that tensor), per-call
    metadata by type, other objects (handles, hooks) by identity."""
    pointed = [t for t in given if type(arg) is int and arg == t.data_ptr()]
    if pointed:
        arg = pointed[0]
    if isinstance(arg, torch.Tensor):
        if arg.untyped_storage().data_ptr() != buf.data_ptr():
            return "tensor@big"
        return f"tensor@{arg.data_ptr() - buf.data_ptr()}"
    if isinstance(arg, (int, tuple)) or arg is None:
        return repr(arg)
    if type(arg).__name__ == "LazyDict":
        return "LazyDict"
    return f"{type(arg).__name__}#{id(arg)}"


def main(target):
    """Prints one JSON line: whether this release is relaunched and, per call, whether it went
    through ``JITFunction.run`` and which launcher got which arguments."""
    logging.basicConfig(level=logging.INFO)
    import triton
    from triton.runtime import driver

    driver.set_active(_driver(target))

    import triton.language as tl

    from vllm.v1.attention.ops import triton_launch

    @triton.jit
    def add_one(x_ptr, y_ptr, s_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(x_ptr + offs, mask=mask) + 1
        if s_ptr is not None:
            y += tl.load(s_ptr)
        tl.store(y_ptr + offs, y, mask=mask)

    jit_runs = []
    run = add_one.run

    def counting_run(*args, **kwargs):
        jit_runs.append(1)
        return run(*args, **kwargs)

    add_one.run = counting_run
    buf = torch.zeros(4096, dtype=torch.float32)
    x, y = buf[:128], buf[1024:1152]
    # s_ptr=None: a pointer the kernel does not read, fixed like the wrappers do.
    launch = triton_launch.KernelCall(add_one, (2,), s_ptr=None, n=128, BLOCK=64, num_warps=4)
    calls = []

    def call(x_ptr, y_ptr):
        before = len(jit_runs)
        _Launcher.calls.clear()
        launch(x_ptr=x_ptr, y_ptr=y_ptr)
        ((launcher, args),) = _Launcher.calls  # exactly one launch
        # The compiled kernel JITFunction.run itself selects for these arguments.
        picked = run(x_ptr, y_ptr, None, 128, BLOCK=64, num_warps=4, grid=(2,), warmup=True)
        calls.append({
            "jit": len(jit_runs) > before,
            "launcher": _Launcher.instances.index(launcher),
            "picked": _Launcher.instances.index(picked.run),
            "args": [_label(a, buf, (x_ptr, y_ptr)) for a in args],
        })

    call(x, y)          # 0: compiles, through kernel[grid]
    call(x, y)          # 1: relaunch
    x1 = buf[1:129]
    call(x1, y)         # 2: misaligned x: another specialisation, through kernel[grid]
    call(x1, y)         # 3: misaligned again: through kernel[grid] again
    call(x, y)          # 4: relaunch, the aligned kernel again
    # 6, 7: an aligned tensor whose storage exceeds 2 GiB (never touched; AMD
    # buffer ops specialise on it): the kernel Triton picks, both times.
    big = torch.empty(2**31 + 4096, dtype=torch.uint8).view(torch.float32)
    from triton import knobs

    saved = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = hook = lambda metadata: None
    call(x, y)          # 5: a launch hook is set: through kernel[grid], which hands it on
    knobs.runtime.launch_enter_hook = saved
    call(big[:128], y)  # 6
    call(big[:128], y)  # 7
    support = triton_launch.relaunch_supported()
    print(json.dumps({
        "triton": triton.__version__,
        "supported": support.relaunch,
        "hip_bound": support.amd_buffer_bound,
        "calls": calls,
        "hook": _label(hook, buf),
    }))


pytestmark = pytest.mark.skipif(not os.environ.get("VLLM_BUILD_TREE"),
                                reason="needs the patched tree (make test)")


def _release(version: str) -> Path:
    """The folder holding ``triton==version`` (no dependencies), pip-installed on first use."""
    folder = cache_dir() / "triton" / version
    if not (folder / "triton" / "__init__.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(folder), f"triton=={version}"], check=True)
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
    proc = subprocess.run([sys.executable, __file__, target], env=env, capture_output=True,
                          text=True, timeout=600)
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
    # misaligned tensor (2, 3), the call with a launch hook set (5) and, on AMD
    # (buffer ops: a relaunch keeps the first call's 2 GiB bound), each with
    # the big storage (6, 7).
    hip = target.startswith("hip")
    new = {0, 2, 3, 5} | ({6, 7} if hip else set())
    assert {i for i, c in enumerate(calls) if c["jit"]} == new
    # A relaunch hands the launcher what Triton's own launch handed it (grid,
    # stream, kernel handle, metadata, every argument; a tensor's pointer for
    # the tensor), with no launch metadata and no hooks, as no hook is set.
    for relaunch, jit in ((1, 0), (4, 0)) + (() if hip else ((7, 6),)):
        args, expected = calls[relaunch]["args"], calls[jit]["args"]
        assert args[:6] == expected[:6] and args[9:] == expected[9:], (relaunch, jit)
        assert args[6:9] == ["None", "None", "None"]
    # A launch hook set later: Triton hands the launcher the hook and the
    # launch metadata, the rest as before.
    assert calls[5]["args"][7] == result["hook"] and calls[5]["args"][6] != "None"
    assert calls[5]["args"][:6] == calls[0]["args"][:6] and calls[5]["args"][9:] == calls[0]["args"][9:]


if __name__ == "__main__":
    main(sys.argv[1])
