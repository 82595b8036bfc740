"""``python first_launch.py <cuda:90 | hip:gfx942>``, with a Triton release and the patched
tree on PYTHONPATH: a KernelCall's launches (triton_launch.py) through a stand-in driver for
that target, so ``kernel[grid]`` really specialises and compiles and only the driver's load
and launch are recorded.  Prints one JSON line: whether this release is relaunched and, per
call, whether it went through ``JITFunction.run`` and which launcher got which arguments.
"""

from __future__ import annotations

import json
import logging
import sys

import torch


class _Launcher:
    """Stands in for the backend launcher: records the calls it gets."""

    instances: list = []

    def __init__(self, src, metadata):
        self.calls = []
        _Launcher.instances.append(self)

    def __call__(self, *args):
        self.calls.append(args)


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        # module, function, n_regs, n_spills, n_max_threads
        return object(), object(), 32, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 228 * 1024, "multiprocessor_count": 132,
                "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1,
                "mem_clock_rate": 1, "mem_bus_width": 1}


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


def _label(arg, buf):
    """A comparable label: tensors by offset, per-call metadata by type,
    other objects (function handles, hooks) by identity."""
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
        counts = [len(i.calls) for i in _Launcher.instances]
        launch(x_ptr=x_ptr, y_ptr=y_ptr)
        counts += [0] * (len(_Launcher.instances) - len(counts))
        (launcher,) = [i for i, n in zip(_Launcher.instances, counts) if len(i.calls) > n]
        args = launcher.calls[-1]
        # The compiled kernel JITFunction.run itself selects for these arguments.
        picked = run(x_ptr, y_ptr, None, 128, BLOCK=64, num_warps=4, grid=(2,), warmup=True)
        calls.append({
            "jit": len(jit_runs) > before,
            "launcher": _Launcher.instances.index(launcher),
            "picked": _Launcher.instances.index(picked.run),
            "args": [_label(a, buf) for a in args],
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
    hooked = []
    from triton import knobs

    saved = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = hook = lambda metadata: hooked.append(metadata)
    call(x, y)          # 5: a launch hook is set: CompiledKernel[grid] hands it on
    knobs.runtime.launch_enter_hook = saved
    call(big[:128], y)  # 6
    call(big[:128], y)  # 7
    supported, hip_bound = triton_launch.relaunch_supported()
    print(json.dumps({
        "triton": triton.__version__,
        "supported": supported,
        "hip_bound": hip_bound,
        "calls": calls,
        "hook": _label(hook, buf),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
