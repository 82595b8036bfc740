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
``None`` for pointers the kernel does not read, ``num_warps`` ...).
``call(x_ptr=x, ...)`` launches ``kernel[grid](**fixed, **tensors)`` the first
time; later calls hand that kernel's launcher the tensors' pointers, as
``CompiledKernel[grid]`` calls it less the launch metadata and hooks, on the
current stream (CUDA graphs capture it as they capture ``kernel[grid]``).

Callers keep one KernelCall per layer geometry (shapes, strides, dtypes) of a
step.  Per call it checks what Triton specialises on that a geometry does not
fix: the keywords, each pointer's 16-byte alignment (unless the kernel takes
it with ``do_not_specialize_on_alignment``) and, on AMD, each storage's side
of the buffer ops' 2 GiB bound.  A call that differs goes through
``kernel[grid]``, as does every call of an interpreted kernel
(``TRITON_INTERPRET=1``), on a Triton outside ``TESTED_TRITON``, while a launch
hook is set (profilers set them) or while torch.compile traces.  The first call
of a KernelCall built in a later step finds the kernel an earlier step
compiled (``_COMPILED``), keyed as Triton keys it: a fixed int by whether it
fits int32, is 1, is a multiple of 16 (only the first with
``do_not_specialize``), a tensor by its dtype, alignment and AMD bound.
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
_INT32 = range(-(2**31), 2**31)
_MAX_BUFFER_BYTES = 2**31 - 1
# Each compiled kernel's relaunch by (configuration, device, the tensors'
# keywords, dtypes and AMD bounds), for the KernelCalls of later steps.
_COMPILED: dict[tuple, _Relaunch] = {}
_MAX_COMPILED = 4096


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
        self._hip = support.amd_buffer_bound
        # Set by the first call that may relaunch: its keywords, which of
        # their pointers Triton specialises on alignment, on AMD which
        # storages were within 2 GiB, and the compiled kernel's relaunch.
        self._names: tuple[str, ...] = ()
        self._aligned: tuple[bool, ...] = ()
        self._within: tuple[bool, ...] | None = None
        self._relaunch: _Relaunch | None = None
        self._config: tuple | None = None  # None: always kernel[grid]
        if support.relaunch and isinstance(
            kernel, getattr(triton.runtime, "JITFunction", ())
        ):
            self._config, self._fixed_values = _configuration(kernel, fixed, self._hip)

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
                args = relaunch.order((*self._fixed_values, *pointers))
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
        self._launch(tensors)

    def pointers(self, tensors: dict[str, torch.Tensor | None]) -> list | None:
        """The tensors' pointers (None for None), or None where the call
        differs from the first in what a relaunch may not: the keywords, a
        specialised pointer that is not 16-byte aligned, on AMD a storage on
        the other side of 2 GiB."""
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

    def _launch(self, tensors: dict[str, torch.Tensor | None]) -> None:
        """A call the relaunch does not take: through ``kernel[grid]``, or
        for a first call the kernel an earlier step's KernelCall of this
        configuration compiled."""
        first = self._config is not None and self._relaunch is None
        if not first or torch.compiler.is_compiling():
            self.kernel[self.grid](**self.fixed, **tensors)  # Triton decides
            return
        params = _parameters(self.kernel)
        self._names = tuple(tensors)
        self._aligned = tuple(n not in params.any_alignment for n in self._names)
        try:
            dtypes = tuple(t if t is None else t.dtype for t in tensors.values())
            self._within = _within_buffer(tensors.values()) if self._hip else None
        except AttributeError:  # not a tensor
            dtypes = None
        if dtypes is None or self.pointers(tensors) is None:
            self.kernel[self.grid](**self.fixed, **tensors)  # Triton decides
            return
        device = triton.runtime.driver.active.get_current_device()
        key = (self._config, device, self._names, dtypes, self._within)
        self._relaunch = _COMPILED.get(key)
        if self._relaunch is not None:
            self(**tensors)  # relaunches the kernel found
            return
        compiled = self.kernel[self.grid](**self.fixed, **tensors)
        given = [name for name in self.fixed if name in params.kinds]
        given += self._names
        if compiled is None or sorted(given) != sorted(params.names):
            return  # (Triton launched it, or said what is missing)
        # The kernel's arguments in order, taken from (*fixed, *pointers).
        order = operator.itemgetter(*(given.index(n) for n in params.names))
        self._relaunch = _Relaunch(compiled, order, self.grid)
        if len(_COMPILED) < _MAX_COMPILED:
            _COMPILED[key] = self._relaunch

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
    it; how to put a call's arguments in the kernel's order; the driver's
    current device and stream, read per launch as Triton reads them."""

    def __init__(self, compiled, order, grid: tuple[int, ...]) -> None:
        compiled[grid]  # loads the kernel's handles, as its first launch did
        active = triton.runtime.driver.active
        self.run = compiled.run
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        self.order = order
        self.current_device = active.get_current_device
        self.current_stream = active.get_current_stream


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set (a callable up to Triton 3.4, a
    ``HookChain`` with calls after)."""
    runtime = triton.knobs.runtime
    enter = runtime.launch_enter_hook
    leave = runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def _configuration(kernel, fixed: dict[str, Any], hip: bool) -> tuple[tuple, tuple]:
    """A KernelCall's configuration (the key of the kernels it may share
    with other KernelCalls) and its fixed kernel arguments in order (not the
    launch options; a tensor as its pointer).  An int counts by the class
    Triton specialises it by, a tensor by its dtype, alignment and (AMD)
    2 GiB bound, not by its identity."""
    params = _parameters(kernel)
    key: list[Any] = [params.number, tuple(fixed)]
    values = []
    for name, value in fixed.items():
        kind = params.kinds.get(name)  # None: a launch option
        if type(value) is int and kind == _INT:
            key.append((value in _INT32) + 2 * (value == 1) + 4 * (value % 16 == 0))
        elif type(value) is int and kind == _LOOSE_INT:
            key.append(value in _INT32)
        elif isinstance(value, torch.Tensor):
            pointer = value.data_ptr()
            aligned = name in params.any_alignment or not pointer & 15
            within = hip and _within_buffer((value,))
            key.append((value.dtype, aligned, within))
            value = pointer
        else:
            key.append(value)
        if kind is not None:
            values.append(value)
    return tuple(key), tuple(values)


_CONSTEXPR, _INT, _LOOSE_INT = 0, 1, 2
_KERNEL_NUMBERS = itertools.count()


class _Parameters(NamedTuple):
    number: int  # the kernel's, in configuration keys (one hash, not the kernel's)
    names: tuple[str, ...]
    # _CONSTEXPR (compiled in), _INT (specialised by class) or _LOOSE_INT
    # (do_not_specialize); pointers and other arguments count as _INT.
    kinds: dict[str, int]
    any_alignment: frozenset[str]  # pointers Triton does not specialise


@functools.cache
def _parameters(kernel) -> _Parameters:
    kinds = {
        p.name: _CONSTEXPR
        if p.is_constexpr
        else _LOOSE_INT
        if p.do_not_specialize
        else _INT
        for p in kernel.params
    }
    return _Parameters(
        number=next(_KERNEL_NUMBERS),
        names=tuple(p.name for p in kernel.params),
        kinds=kinds,
        any_alignment=frozenset(
            p.name for p in kernel.params if p.do_not_specialize_on_alignment
        ),
    )


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
