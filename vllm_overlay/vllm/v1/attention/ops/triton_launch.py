# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Relaunch a compiled Triton kernel without ``JITFunction.run``.

An attention op runs once per layer between the pieces of a piecewise CUDA
graph, so a wrapper's ``kernel[grid](...)`` is paid on every layer:
``JITFunction.run`` binds, specialises and keys every argument (about 3x a
torch op on the host).  The kernel it compiled has its own launcher,
``CompiledKernel.run`` (about 1x).

``KernelCall(kernel, grid, **fixed)`` fixes a launch's grid and the arguments
that do not change per call (scalars, constexprs, a step's own tensors,
``None`` for pointers the kernel does not read, ``num_warps`` ...).  Its first
call goes through ``kernel[grid](**fixed, **tensors)``; later calls hand the
kernel that call compiled the tensors' pointers, as ``CompiledKernel[grid]``
hands them to its launcher less the launch metadata and hooks, on the current
stream (CUDA graphs capture it as they capture ``kernel[grid]``).

Callers keep one KernelCall per layer geometry (shapes, strides, dtypes) of a
step.  Per call it checks what Triton specialises on that a geometry does not
fix: the keywords, each pointer's 16-byte alignment (unless the kernel takes
it with ``do_not_specialize_on_alignment``) and, on AMD, each storage's side
of the buffer ops' 2 GiB bound.  A call that differs goes through
``kernel[grid]``, as does every call of an interpreted kernel
(``TRITON_INTERPRET=1``), on a Triton outside ``TESTED_TRITON``, while a launch
hook is set (profilers set them) or while torch.compile traces.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from vllm.triton_utils import triton

__all__ = ["TESTED_TRITON", "KernelCall", "RelaunchSupport", "relaunch_supported"]

# Triton releases whose CompiledKernel[grid] launcher this was checked against.
TESTED_TRITON = ((3, 4), (3, 9))
_MAX_BUFFER_BYTES = 2**31 - 1


class RelaunchSupport(NamedTuple):
    relaunch: bool  # compiled kernels may be relaunched
    amd_buffer_bound: bool  # a pointer counts by its storage's side of 2 GiB


@functools.cache
def relaunch_supported() -> RelaunchSupport:
    """What this Triton and driver allow: a plain version and capability
    check."""
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime import driver

        target = driver.active.get_current_target()
        _launch_hooks_set()  # (triton.knobs: Triton 3.4 and later)
    except Exception:  # vLLM's placeholder, another layout, no driver
        return RelaunchSupport(relaunch=False, amd_buffer_bound=False)
    ok = TESTED_TRITON[0] <= version <= TESTED_TRITON[1]
    ok = ok and callable(getattr(CompiledKernel, "__getitem__", None))
    return RelaunchSupport(relaunch=ok, amd_buffer_bound=target.backend == "hip")


class KernelCall:
    """One launch configuration of ``kernel``: its grid and the arguments
    that do not change per call, fixed; the others (tensors) come per call,
    by keyword."""

    def __init__(self, kernel, grid: tuple[int, ...], **fixed: Any) -> None:
        self.kernel = kernel
        # Three dimensions: CompiledKernel[grid] reads grid[0], grid[1], grid[2].
        self.grid = (*grid, 1, 1)[:3]
        self.fixed = fixed
        support = relaunch_supported()
        jit = getattr(triton.runtime, "JITFunction", ())
        self._may_relaunch = support.relaunch and isinstance(kernel, jit)
        self._hip = support.amd_buffer_bound
        # Set by the call that compiled the kernel relaunched: its keywords,
        # which of their pointers Triton specialises on alignment and, on
        # AMD, which storages were within 2 GiB.
        self._names: tuple[str, ...] = ()
        self._aligned: tuple[bool, ...] = ()
        self._within: tuple[bool, ...] | None = None
        self._relaunch: _Relaunch | None = None

    def __call__(self, **tensors: torch.Tensor | None) -> None:
        relaunch = self._relaunch
        if (
            relaunch is not None
            and not torch.compiler.is_compiling()
            and not _launch_hooks_set()
        ):
            pointers = self.pointers(tensors)
            if pointers is not None:
                # CompiledKernel[grid]'s own call of run, less what only
                # launch hooks read (launch metadata, the hooks).
                args = relaunch.order((*relaunch.fixed, *pointers))
                grid = self.grid
                relaunch.run(
                    grid[0],
                    grid[1],
                    grid[2],
                    relaunch.current_stream(relaunch.current_device()),
                    relaunch.function,
                    relaunch.packed_metadata,
                    None,
                    None,
                    None,
                    *args,
                )
                return
        compiled = self.kernel[self.grid](**self.fixed, **tensors)
        if relaunch is None and self._may_relaunch:
            self._keep(compiled, tensors)

    def pointers(self, tensors: dict[str, torch.Tensor | None]) -> list | None:
        """The tensors' pointers (None for None), or None where the call
        differs from the one that compiled the kernel in what a relaunch may
        not: the keywords, a specialised pointer that is not 16-byte aligned,
        on AMD a storage on the other side of 2 GiB."""
        if tuple(tensors) != self._names:
            return None
        try:
            pointers = [t if t is None else t.data_ptr() for t in tensors.values()]
        except AttributeError:  # not a tensor: Triton decides
            return None
        bits = 0
        for pointer in itertools.compress(pointers, self._aligned):
            bits |= pointer or 0
        if bits & 15:
            return None
        within = self._within
        if within is not None and within != _within_buffer(tensors.values()):
            return None
        return pointers

    def _keep(self, compiled, tensors: dict[str, torch.Tensor | None]) -> None:
        """Keep the kernel a first call compiled for relaunching, if that
        call had every specialised pointer aligned (else a later call tries)
        and named every parameter."""
        if compiled is None or torch.compiler.is_compiling():
            return
        any_alignment = _any_alignment(self.kernel)
        self._names = tuple(tensors)
        self._aligned = tuple(name not in any_alignment for name in self._names)
        self._within = None
        if self.pointers(tensors) is None:  # misaligned, or not a tensor
            return
        if self._hip:
            self._within = _within_buffer(tensors.values())
        # The kernel's arguments in order, taken from (*fixed, *pointers).
        given = dict(zip((*self.fixed, *self._names), itertools.count()))
        try:
            order = operator.itemgetter(*map(given.__getitem__, self.kernel.arg_names))
        except KeyError:  # a parameter left to its default
            return
        fixed = [
            v.data_ptr() if isinstance(v, torch.Tensor) else v
            for v in self.fixed.values()
        ]
        self._relaunch = _Relaunch(compiled, order, tuple(fixed))

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


class _Relaunch:
    """A compiled kernel's launcher and what ``CompiledKernel[grid]`` hands
    it; how to put a call's pointers in the kernel's order after the fixed
    arguments; the driver's current device and stream, read per launch as
    Triton reads them."""

    def __init__(self, compiled, order, fixed: tuple) -> None:
        active = triton.runtime.driver.active
        self.run = compiled.run
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        self.order = order
        self.fixed = fixed
        self.current_device = active.get_current_device
        self.current_stream = active.get_current_stream


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set (a callable up to Triton 3.4, a
    ``HookChain`` with calls after)."""
    runtime = triton.knobs.runtime
    enter = runtime.launch_enter_hook
    leave = runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


@functools.cache
def _any_alignment(kernel) -> frozenset[str]:
    """The pointers Triton does not specialise on 16-byte alignment."""
    return frozenset(p.name for p in kernel.params if p.do_not_specialize_on_alignment)


def _within_buffer(tensors: Iterable[torch.Tensor | None]) -> tuple[bool, ...]:
    """Whether each tensor's storage is within AMD's 2 GiB buffer bound."""
    return tuple(
        t.untyped_storage().nbytes() <= _MAX_BUFFER_BYTES
        for t in tensors
        if t is not None
    )


class _Pointer:
    """A 16-byte aligned pointer of ``t``'s dtype into ``nbytes`` of storage."""

    def __init__(self, t: torch.Tensor, nbytes: int) -> None:
        self.dtype = t.dtype
        self._nbytes = nbytes

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return self._nbytes
