# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checked-once Triton launches for kernels called once per layer per step.

An attention wrapper runs eagerly once per layer (48-61 times a step) between
the pieces of a piecewise CUDA graph, so its host time is paid on every layer.
Two costs dominate it:

  * its argument checks, the same for every layer of a step;
  * ``kernel[grid](...)``: ``JITFunction.run`` binds and specialises every
    argument, builds the compile-cache key from them and reads Triton's knobs
    on every call -- about 15 us of Python for a 40-argument kernel before the
    driver launch.

This module lets a wrapper pay both once per *launch key*: the argument
shapes, strides, dtypes and devices, plus the host scalars the call takes.

  * ``LaunchCache`` maps a wrapper's key to what it derived from validated
    arguments (a ``KernelLaunch`` per kernel, buffer sizes, ...).  A miss runs
    the wrapper's full checks (one code path for validation; bad input raises
    before anything is cached or launched); a hit skips them.  A key must
    determine everything the checks look at.
  * ``KernelLaunch`` fixes a kernel's grid, scalar arguments, constexprs and
    options.  Per call only its tensor arguments (the kernel's leading
    parameters) change.  The first call of each pointer-alignment pattern
    launches through ``kernel[grid]`` (compiling if needed) and keeps the
    ``CompiledKernel`` it returns; later calls hand the data pointers to that
    kernel's launcher directly.  What selects the compiled kernel is known:
    scalars, constexprs and tensor dtypes are fixed by the key, and the
    pointers' alignment (and, on backends that specialise on more, the
    backend's own tensor specialisation) is part of the per-call lookup.

On Triton 3.6 a hit calls the launcher's C launch function itself when the
kernel needs no scratch buffer (``_raw_launch``: the arguments the CUDA / HIP
launcher would pass), and on ROCm the pointer specialisation (alignment and
storage within 2 GiB, what ``HIPBackend`` selects on with buffer ops) is
computed here with the ``AMDGCN_USE_BUFFER_OPS`` knob read once per process,
not from the environment per pointer.

The direct launch goes to the current stream, so it is captured by CUDA graphs
like ``kernel[grid]``.  ``kernel[grid]`` is used instead when the kernel is not
compiled (``TRITON_INTERPRET=1``), while torch.compile traces (``fast_path()``
is False; the wrappers then check every call and launch normally), and when
Triton launch hooks (profilers) are installed.  ``ENABLED = False`` turns
caching and the direct launch off everywhere (the plain path, for comparison).
"""

from __future__ import annotations

from functools import reduce
from operator import or_

import torch
import triton

__all__ = [
    "ENABLED", "KernelLaunch", "LaunchCache", "clear_caches", "fast_path", "tensor_geometry",
]

# Caching and direct launches on (False: every call checks its arguments and
# launches through kernel[grid]).
ENABLED = True

# A cache holding more keys than this is emptied (keys carry the step's token
# counts, so they accumulate slowly over a run; dropping them all is cheap).
_MAX_KEYS = 4096

_CACHES: list[LaunchCache] = []

try:
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # pragma: no cover - another Triton layout
    _JITFunction = ()

# Direct launches follow the launcher calling convention of Triton 3.4 - 3.6
# (the releases with triton.knobs: every bound argument, constexprs included,
# after the grid, stream, function, metadata and hooks); other releases keep
# the validation cache and launch through kernel[grid].  _RAW: the release
# whose CUDA / HIP launcher internals _raw_launch and _pointer_spec mirror.
_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
_DIRECT = hasattr(triton, "knobs") and _VERSION in ((3, 4), (3, 5), (3, 6))
_RAW = _DIRECT and _VERSION == (3, 6)
# Launch hooks: Triton 3.5+ keeps them in (possibly empty) HookChains; a set
# hook (a profiler) sends launches through kernel[grid].
_RUNTIME = triton.knobs.runtime if _DIRECT else None
_HookChain = getattr(triton.knobs, "HookChain", None) if _DIRECT else None


def fast_path() -> bool:
    """Whether a wrapper may use its cache and direct launches for this call."""
    return ENABLED and not torch.compiler.is_compiling()


class LaunchCache(dict):
    """A wrapper's validated launches by key (a dict that empties when full)."""

    def __init__(self) -> None:
        super().__init__()
        _CACHES.append(self)

    def put(self, key, value):
        if len(self) >= _MAX_KEYS:
            self.clear()
        self[key] = value
        return value

    def bind(self, key, check_and_bind, *args):
        """A miss: ``check_and_bind(*args)`` (the wrapper's full checks; raises
        before anything is cached), kept under ``key`` unless it is None (an
        unkeyable call, or the plain path)."""
        value = check_and_bind(*args)
        if key is not None:
            self.put(key, value)
        return value


def tensor_geometry(t) -> tuple:
    """What a launch key holds of a tensor: shape, strides, dtype, device."""
    return (t.shape, t.stride(), t.dtype, t.device)


def clear_caches() -> None:
    """Forget every validated launch (tests and tuning change module constants
    that launches were derived from)."""
    for cache in _CACHES:
        cache.clear()


_MAX_INT32 = 2**31 - 1


class _Driver:
    """Triton's active driver's device / stream getters and how the backend
    specialises pointer arguments, looked up on the first direct launch."""

    current_device = None
    current_stream = None
    # How pointer arguments select a compiled kernel: None, 16-byte alignment
    # only (the default backend); _HIP_BUFFER_OPS, alignment and whether the
    # storage fits in 2 GiB (HIPBackend with buffer ops on); else the
    # backend's get_tensor_specialization, called per tensor.
    tensor_spec = None

    @classmethod
    def load(cls) -> None:
        from triton.backends.compiler import BaseBackend
        from triton.compiler.compiler import make_backend
        from triton.runtime import driver

        active = driver.active
        backend = type(make_backend(active.get_current_target()))
        spec = backend.get_tensor_specialization
        if spec is BaseBackend.get_tensor_specialization:
            cls.tensor_spec = None
        elif _is_hip_backend(backend, spec) and _RAW:
            # HIPBackend.get_tensor_specialization reads its knob from the
            # environment on every call; it is read once per process here.
            cls.tensor_spec = _HIP_BUFFER_OPS if triton.knobs.amd.use_buffer_ops else None
        else:
            cls.tensor_spec = spec
        cls.current_stream = active.get_current_stream
        # torch.cuda.current_device() without its lazy-init check (launches
        # have happened, so CUDA is initialised).
        cls.current_device = getattr(
            torch._C, "_cuda_getDevice", active.get_current_device
        )


_HIP_BUFFER_OPS = "hip-buffer-ops"


def _is_hip_backend(backend, spec) -> bool:
    try:
        from triton.backends.amd.compiler import HIPBackend
    except ImportError:  # pragma: no cover - no AMD backend in this build
        return False
    return backend is HIPBackend and spec is HIPBackend.get_tensor_specialization


def _pointer_spec(tensors, ptrs):
    """What Triton specialises the pointer arguments on, as a cache key."""
    spec = _Driver.tensor_spec
    if spec is None or spec is _HIP_BUFFER_OPS:
        # True: all 16-byte aligned (the common case).
        aligned = True if not reduce(or_, ptrs) & 15 else tuple(not p & 15 for p in ptrs)
        if spec is None:
            return aligned
        # HIPBackend: "D" for 16-byte alignment, "S" for a storage of at most
        # 2**31 - 1 bytes (buffer ops with 32-bit offsets).
        return aligned, tuple(_storage_nbytes(t) <= _MAX_INT32 for t in tensors)
    return tuple(spec(t, align=True) for t in tensors)


def _storage_nbytes(t) -> int:
    return t.untyped_storage().nbytes()


try:  # the launchers whose calling convention _raw_launch knows (Triton 3.6)
    from triton.backends.nvidia.driver import CudaLauncher as _CudaLauncher
except ImportError:  # pragma: no cover - no NVIDIA backend in this build
    _CudaLauncher = None
try:
    from triton.backends.amd.driver import HIPLauncher as _HIPLauncher
except ImportError:  # pragma: no cover - no AMD backend in this build
    _HIPLauncher = None


def _raw_launch(run, function, metadata, dims):
    """``(fn, before, after)`` with ``fn(*before, stream, *after, *args)``
    doing what ``run(*dims, stream, function, metadata, None, None, None,
    *args)`` does (no launch metadata, no hooks).

    ``run`` is a compiled kernel's launcher.  Triton 3.6's CUDA and HIP
    launchers only allocate scratch buffers (when the kernel needs them) and
    reorder their arguments for the C launch function; without scratch that
    function is called here directly, saving a Python frame and a copy of the
    argument tuple per launch.  Any other launcher is called as it is.
    """
    launch = getattr(run, "launch", None)
    cls = type(run)
    if _RAW and launch is not None and cls in (_CudaLauncher, _HIPLauncher):
        if cls is _CudaLauncher and not (
            run.global_scratch_size or run.profile_scratch_size
        ):
            return launch, dims, (
                function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                metadata, None, None, None,
            )  # fmt: skip
        if cls is _HIPLauncher and not run.profile_scratch_size:
            return launch, (run.launch_cooperative_grid, *dims), (
                function, None, metadata, None, None, None,
            )  # fmt: skip
    return run, dims, (function, metadata, None, None, None)


class KernelLaunch:
    """One launch configuration of a ``@triton.jit`` kernel.

    ``kernel(*tensors, *scalars, **constexprs)`` must list its parameters in
    that order (pointer arguments first, then runtime scalars, then
    constexprs), which is how every kernel here is written.  ``grid`` (up to
    three ints), ``scalars``, ``constexprs`` and ``options`` (``num_warps``,
    ...) are fixed; call the object with the tensor arguments, whose dtypes
    must be the same on every call (the caller's key fixes them).
    """

    __slots__ = (
        "kernel",
        "grid",
        "scalars",
        "constexprs",
        "options",
        "_dims",
        "_tail",
        "_compiled",
    )

    def __init__(self, kernel, grid, scalars=(), constexprs=None, **options):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.scalars = tuple(scalars)
        self.constexprs = dict(constexprs or {})
        self.options = options
        self._dims = (*self.grid, 1, 1)[:3]
        self._tail = None  # scalars + constexpr values in parameter order
        # (device, pointer specialisation) -> (fn, before, after): _raw_launch
        self._compiled: dict = {}

    def __call__(self, *tensors) -> None:
        compiled = self._compiled
        if compiled:
            ptrs = [*map(_data_ptr, tensors)]
            device = _Driver.current_device()
            entry = compiled.get((device, _pointer_spec(tensors, ptrs)))
            if entry is not None:
                runtime = _RUNTIME
                enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
                if (enter is None or type(enter) is _HookChain and not enter.calls) and (
                    leave is None or type(leave) is _HookChain and not leave.calls
                ):
                    fn, before, after = entry
                    fn(*before, _Driver.current_stream(device), *after, *ptrs, *self._tail)
                    return
        kernel = self.kernel[self.grid](
            *tensors, *self.scalars, **self.constexprs, **self.options
        )
        if _DIRECT and isinstance(self.kernel, _JITFunction) and fast_path():
            self._remember(kernel, tensors)

    def _remember(self, kernel, tensors) -> None:
        # kernel[grid] returns the CompiledKernel it launched (None when a
        # compile hook took over); its launcher now has handles loaded.
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return
        if _Driver.current_device is None:
            _Driver.load()
        if self._tail is None:
            names = self.kernel.arg_names[len(tensors) + len(self.scalars) :]
            if sorted(names) != sorted(self.constexprs):
                raise TypeError(
                    f"KernelLaunch: {self.kernel} takes {self.kernel.arg_names}; "
                    f"got {len(tensors)} tensors, {len(self.scalars)} scalars and "
                    f"constexprs {sorted(self.constexprs)}"
                )
            self._tail = (*self.scalars, *(self.constexprs[n] for n in names))
        ptrs = [t.data_ptr() for t in tensors]
        key = (_Driver.current_device(), _pointer_spec(tensors, ptrs))
        self._compiled[key] = _raw_launch(
            kernel.run, kernel.function, kernel.packed_metadata, self._dims
        )


_data_ptr = torch.Tensor.data_ptr
