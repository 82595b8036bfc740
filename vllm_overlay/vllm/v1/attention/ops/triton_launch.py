# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Relaunch a compiled Triton kernel without ``JITFunction.run``.

An attention op called once per layer between the pieces of a piecewise CUDA
graph pays ``kernel[grid](...)`` on every layer: ``JITFunction.run`` binds,
specialises and keys every argument (about 3x a torch op on the host).  The
kernel it compiled can be launched again through its own launcher,
``CompiledKernel[grid]`` (about 1.1x: it passes Triton's launch hooks and
metadata as ``JITFunction.run`` does).

``KernelCall(kernel, grid, **fixed)`` fixes a launch's grid and every argument
that is not a tensor: scalars, constexprs, ``None`` for pointers the kernel
does not read, and launch options (``num_warps``, ``num_stages``).  Calling
it with the tensors by keyword, ``call(q_ptr=q, ...)`` (``None`` for a
pointer not read), launches
``kernel[grid](**fixed, **tensors)`` the first time for each *variant* and
relaunches that compiled kernel afterwards.  The variant (the guard of what
Triton specialised on, checked on every call) is: the fixed arguments (an int
that Triton does not specialise by ``do_not_specialize`` only by whether it
fits int32), the tensors' names and dtypes, whether every pointer is 16-byte
aligned and, on AMD, whether each tensor's storage is within 2 GiB (buffer
ops); it is never coarser than Triton's own key (the keywords' order is part
of it: a call site passes them in one order).

``kernel[grid]`` runs instead whenever anything is unknown: not a compiled
``JITFunction`` (``TRITON_INTERPRET=1``), a Triton release outside
``TESTED_TRITON``, a non-tensor argument given per call, or while
torch.compile traces.  Launches go to the current stream, so CUDA graphs
capture them as they capture ``kernel[grid]``.  (Inductor's
``StaticallyLaunchedCudaKernel`` launches as cheaply but needs the binary on
disk and Triton's implied constants filtered out: one more thing to keep in
step with Triton.)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm.triton_utils import triton

__all__ = ["TESTED_TRITON", "KernelCall", "relaunch_supported"]

# Triton releases whose CompiledKernel[grid] launcher this was checked against.
TESTED_TRITON = ((3, 4), (3, 9))
_INT32 = range(-(2**31), 2**31)
_MAX_BUFFER_BYTES = 2**31 - 1
# Compiled kernels by (configuration, tensor variant); Triton keeps each of
# them anyway, this only finds one without JITFunction.run.  A configuration
# (kernel and fixed arguments) is numbered once, when a KernelCall is built, so
# a call hashes a small int, not the kernel (JITFunction.__hash__ hashes its
# source key under a lock).
_CONFIGS: dict[tuple, int] = {}
_COMPILED: dict[tuple, Any] = {}
_MAX_COMPILED = 4096


@functools.cache
def relaunch_supported() -> tuple[bool, bool]:
    """(whether compiled kernels may be relaunched, whether pointers are keyed
    by the AMD 2 GiB bound): a plain version and capability check."""
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception:  # vLLM's placeholder, another layout, no driver
        return False, False
    ok = TESTED_TRITON[0] <= version <= TESTED_TRITON[1]
    ok = ok and callable(getattr(CompiledKernel, "__getitem__", None))
    return ok, target.backend == "hip"


class KernelCall:
    """One launch configuration of ``kernel``: its grid and non-tensor
    arguments, fixed; the tensors come per call, by keyword."""

    def __init__(self, kernel, grid: tuple[int, ...], **fixed: Any) -> None:
        self.kernel = kernel
        # Three dimensions: CompiledKernel[grid] reads grid[0], grid[1], grid[2].
        self.grid = (*grid, 1, 1)[:3]
        self.fixed = fixed
        names: list[str] = list(getattr(kernel, "arg_names", None) or ())
        params: list[Any] = list(getattr(kernel, "params", None) or ())
        self._relaunch = (
            isinstance(kernel, getattr(triton.runtime, "JITFunction", ()))
            and bool(names)
            and len(params) == len(names)
            and relaunch_supported()[0]
        )
        if not self._relaunch:
            return
        loose = {p.name for p in params if getattr(p, "do_not_specialize", False)}
        key = []
        for name, value in fixed.items():
            if name in loose and type(value) is int:
                value = value in _INT32  # Triton still picks i32 or i64
            key.append((name, value))
        self._config = _CONFIGS.setdefault((kernel, tuple(key)), len(_CONFIGS))
        self._hip = relaunch_supported()[1]
        self._device = triton.runtime.driver.active.get_current_device
        self._index = {name: i for i, name in enumerate(names)}
        self._tensor_names = frozenset(names) - fixed.keys()
        # Every parameter's value in order; the tensors fill their slots.
        self._args = [fixed.get(name) for name in names]

    def __call__(self, **tensors: torch.Tensor | None) -> None:
        if not self._relaunch or torch.compiler.is_compiling():
            self.kernel[self.grid](**self.fixed, **tensors)
            return
        key = self.variant(tensors)
        compiled = _COMPILED.get(key) if key is not None else None
        if compiled is None:
            compiled = self.kernel[self.grid](**self.fixed, **tensors)
            full = len(_COMPILED) >= _MAX_COMPILED
            if key is not None and compiled is not None and not full:
                _COMPILED[key] = compiled
            return
        args = self._args.copy()
        index = self._index
        for name, tensor in tensors.items():
            args[index[name]] = tensor
        compiled[self.grid](*args)

    def warmup(self, storage_bytes: dict[str, int], **tensors: Any) -> None:
        """Compile without launching (``JITFunction.warmup``, for vLLM's JIT
        warmup): the tensors named in ``storage_bytes`` stand in as pointers
        into storage of that many bytes (what AMD's buffer ops specialise on),
        e.g. the KV cache pool, which a warmup does not allocate."""
        args = {
            name: t if name not in storage_bytes else _Pointer(t, storage_bytes[name])
            for name, t in tensors.items()
        }
        self.kernel.warmup(**self.fixed, **args, grid=self.grid)

    def variant(self, tensors: dict[str, torch.Tensor | None]) -> tuple | None:
        """The per-call guard (None: launch through ``kernel[grid]``)."""
        if tensors.keys() != self._tensor_names:
            return None  # a parameter missing or given twice: Triton says which
        # The configuration, the device and the tensors' names in call order,
        # then per tensor: its dtype, whether it is 16-byte aligned and, on AMD,
        # whether its storage is within the buffer ops' 2 GiB (None: a pointer
        # the kernel does not read, a constexpr to Triton).
        key: list[Any] = [self._config, self._device(), *tensors]
        try:
            for t in tensors.values():
                if t is None:
                    key.append(None)
                    continue
                key.append(t.dtype)
                key.append(not t.data_ptr() & 15)
                if self._hip:
                    key.append(t.untyped_storage().nbytes() <= _MAX_BUFFER_BYTES)
        except AttributeError:  # not a tensor: Triton decides
            return None
        return tuple(key)


class _Pointer:
    """A 16-byte aligned pointer of ``t``'s dtype into ``nbytes`` of storage."""

    def __init__(self, t: torch.Tensor, nbytes: int) -> None:
        self.dtype = t.dtype
        self._nbytes = nbytes

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return self._nbytes
