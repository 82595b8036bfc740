# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Relaunch a compiled Triton kernel without ``JITFunction.run``.

An attention op called once per layer between the pieces of a piecewise CUDA
graph pays ``kernel[grid](...)`` on every layer: ``JITFunction.run`` binds,
specialises and keys every argument (about 3x a torch op on the host).  The
kernel it compiled can be launched again through its own launcher,
``CompiledKernel.run``, called as ``CompiledKernel[grid]`` calls it on the
releases in ``TESTED_TRITON``: with no launch hook set (profilers set them),
without the launch metadata and hooks, which only hooks read; with one set,
through ``CompiledKernel[grid]`` itself.

``KernelCall(kernel, grid, **fixed)`` fixes a launch's grid and every argument
that is not a tensor (scalars, constexprs, ``None`` for pointers the kernel
does not read, ``num_warps`` ...).  ``call(q_ptr=q, ...)`` launches
``kernel[grid](**fixed, **tensors)`` the first time for each guard value and
relaunches that compiled kernel afterwards, on the current stream.  The
guard, read on every call, is what Triton specialises on beyond the fixed
arguments: the tensors' names in call order, which are None, the others'
dtypes and, on AMD, whether each storage is within the buffer ops' 2 GiB; a
call with a pointer that is not 16-byte aligned goes through ``kernel[grid]``
(unless the kernel takes that pointer with
``do_not_specialize_on_alignment``).  A fixed int argument counts by what
Triton specialises on: whether it fits int32, is 1, is a multiple of 16 (only
the first with ``do_not_specialize``).

``kernel[grid]`` runs instead whenever anything is unknown: not a compiled
``JITFunction`` (``TRITON_INTERPRET=1``), a Triton release outside
``TESTED_TRITON``, a non-tensor argument given per call, or while
torch.compile traces.  Launches go to the current stream, so CUDA graphs
capture them as they capture ``kernel[grid]``.  A KernelCall serves one step
on one device: the wrappers build one per layer geometry of a step.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, NamedTuple

import torch

from vllm.triton_utils import triton

__all__ = ["TESTED_TRITON", "KernelCall", "relaunch_supported"]

# Triton releases whose CompiledKernel[grid] launcher this was checked against.
TESTED_TRITON = ((3, 4), (3, 9))
_INT32 = range(-(2**31), 2**31)
_MAX_BUFFER_BYTES = 2**31 - 1
# The relaunch (launcher, argument order) of each compiled kernel by
# (configuration, device, guard), so the KernelCalls a later step builds find
# them without JITFunction.run (Triton keeps each kernel anyway).  A
# configuration (kernel and fixed arguments) is numbered when a KernelCall is
# built.
_CONFIGS: dict[tuple, int] = {}
_COMPILED: dict[tuple, _Relaunch] = {}
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
        _launch_hooks_set()  # (triton.knobs: Triton 3.4 and later)
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
        self._relaunch = relaunch_supported()[0] and isinstance(
            kernel, getattr(triton.runtime, "JITFunction", ())
        )
        if not self._relaunch:
            return
        params = _parameters(kernel)
        self._any_alignment = params.any_alignment
        self._hip = relaunch_supported()[1]
        # The fixed kernel arguments (not the launch options), in order, and
        # the configuration's key: an int argument counts by the class Triton
        # specialises it by (int32 or not; unless do_not_specialize, whether
        # it is 1 and whether a multiple of 16), not by its value.
        self._fixed_args: list[str] = []
        fixed_values = []
        key = []
        for name, value in fixed.items():
            kind = params.kinds.get(name)  # None: a launch option
            if kind is not None:
                self._fixed_args.append(name)
                fixed_values.append(value)
            if type(value) is int and kind == _INT:
                value = (value in _INT32) + 2 * (value == 1) + 4 * (value % 16 == 0)
            elif type(value) is int and kind == _LOOSE_INT:
                value = value in _INT32
            key.append(value)
        self._fixed_values = tuple(fixed_values)
        self._config = _CONFIGS.setdefault(
            (kernel, tuple(fixed), tuple(key)), len(_CONFIGS)
        )
        # The launcher and argument order per guard value.
        self._launchers: dict[tuple | None, _Relaunch] = {}

    def __call__(self, **tensors: torch.Tensor | None) -> None:
        guard = None
        if self._relaunch and not torch.compiler.is_compiling():
            guard = self.guard(tensors)
            relaunch = self._launchers.get(guard)
            if relaunch is not None:
                args = relaunch.order((*self._fixed_values, *tensors.values()))
                if _launch_hooks_set():
                    relaunch.compiled[self.grid](*args)
                    return
                # CompiledKernel[grid]'s own call of run, less what only
                # launch hooks read (launch metadata, the hooks).
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
        self._launch(guard, tensors)

    def guard(self, tensors: dict[str, torch.Tensor | None]) -> tuple | None:
        """What a relaunch depends on per call (None: ``kernel[grid]``): the
        keywords in order (the launcher takes the arguments in it), the
        tensors' dtypes (None for None) and, on AMD, each storage's bound."""
        pointers = 0
        any_alignment = self._any_alignment
        try:
            for name, t in tensors.items():
                if t is not None and name not in any_alignment:
                    pointers |= t.data_ptr()
            within = None
            if self._hip:
                within = tuple(
                    _within_buffer(t) for t in tensors.values() if t is not None
                )
        except AttributeError:  # not a tensor: Triton decides
            return None
        if pointers & 15:
            return None  # a pointer not 16-byte aligned
        dtypes = map(getattr, tensors.values(), _DTYPE, _NO_DTYPE)
        return (*tensors, *dtypes, within)

    def _launch(self, guard, tensors: dict[str, torch.Tensor | None]) -> None:
        """A call the relaunch path does not take (the first of ``guard``, a
        misaligned pointer, anything unknown: None): through ``kernel[grid]``,
        or the kernel an earlier KernelCall of this configuration compiled;
        keeps what a relaunch needs."""
        if guard is None:
            self.kernel[self.grid](**self.fixed, **tensors)  # Triton decides
            return
        key = (self._config, triton.runtime.driver.active.get_current_device(), guard)
        found = _COMPILED.get(key)
        if found is None:
            compiled = self.kernel[self.grid](**self.fixed, **tensors)
            names = _parameters(self.kernel).names
            given = [*self._fixed_args, *tensors]
            if compiled is None or sorted(given) != sorted(names):
                return  # (Triton launched it, or said what is missing)
            # The kernel's arguments in order, taken from (*fixed, *tensors).
            order = operator.itemgetter(*(given.index(n) for n in names))
            relaunch = _Relaunch(compiled, order, self.grid)
            if len(_COMPILED) < _MAX_COMPILED:
                _COMPILED[key] = relaunch
            self._launchers[guard] = relaunch
            return
        self._launchers[guard] = found
        args = found.order((*self._fixed_values, *tensors.values()))
        found.compiled[self.grid](*args)

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
        self.compiled = compiled
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


_DTYPE = itertools.repeat("dtype")
_NO_DTYPE = itertools.repeat(None)


_CONSTEXPR, _INT, _LOOSE_INT = 0, 1, 2


class _Parameters(NamedTuple):
    names: tuple[str, ...]
    # _CONSTEXPR (compiled in), _INT (specialised by class) or _LOOSE_INT
    # (do_not_specialize); pointers and other arguments count as _INT.
    kinds: dict[str, int]
    any_alignment: frozenset[str]  # pointers Triton does not specialise


@functools.cache
def _parameters(kernel) -> _Parameters:
    params = kernel.params
    kinds = {
        p.name: _CONSTEXPR
        if p.is_constexpr
        else _LOOSE_INT
        if p.do_not_specialize
        else _INT
        for p in params
    }
    return _Parameters(
        names=tuple(p.name for p in params),
        kinds=kinds,
        any_alignment=frozenset(
            p.name for p in params if p.do_not_specialize_on_alignment
        ),
    )


def _within_buffer(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() <= _MAX_BUFFER_BYTES


class _Pointer:
    """A 16-byte aligned pointer of ``t``'s dtype into ``nbytes`` of storage."""

    def __init__(self, t: torch.Tensor, nbytes: int) -> None:
        self.dtype = t.dtype
        self._nbytes = nbytes

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return self._nbytes
