# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Relaunch a compiled Triton kernel without ``JITFunction.run``.

An attention op called once per layer between the pieces of a piecewise CUDA
graph pays ``kernel[grid](...)`` on every layer: ``JITFunction.run`` binds,
specialises and keys every argument (about 3x a torch op on the host).  The
kernel it compiled can be launched again through its own launcher,
``CompiledKernel.run``, called as ``CompiledKernel[grid]`` calls it on the
releases in ``TESTED_TRITON`` with no launch hook set, less the launch
metadata and hooks, which only hooks read.  While a launch hook is set
(profilers set them), every call goes through ``kernel[grid]``, which calls
the hooks.

``KernelCall(kernel, grid, **fixed)`` fixes a launch's grid and every argument
that does not change per call (scalars, constexprs, a step's own tensors,
``None`` for pointers the kernel does not read, ``num_warps`` ...).  A fixed
tensor counts by its dtype and alignment (on AMD, its 2 GiB bound), not by
its identity, and is handed over as its pointer.  ``call(q_ptr=q, ...)`` launches
``kernel[grid](**fixed, **tensors)`` the first time and relaunches that
compiled kernel afterwards, on the current stream, handing the launcher the
tensors' pointers (ints: the launcher then neither calls ``data_ptr()`` nor
asks the driver about each pointer again).  A KernelCall's first call finds
the kernel an earlier step compiled for the same configuration, device and
tensors (keywords, dtypes, which are None; on AMD whether each storage is
within the buffer ops' 2 GiB) in ``_COMPILED``, or compiles it.

Every later call must pass the same keywords with tensors of the same dtypes
(None where the first call had None): the wrappers keep one KernelCall per
layer geometry, and their geometry keys hold the dtypes.  Per call the
relaunch checks what Triton specialises on that a geometry does not fix: each
pointer's 16-byte alignment (unless the kernel takes it with
``do_not_specialize_on_alignment``) and, on AMD, each storage's 2 GiB bound;
a call that differs goes through ``kernel[grid]``.  A fixed int argument
counts by what Triton specialises on: whether it fits int32, is 1, is a
multiple of 16 (only the first with ``do_not_specialize``).

``kernel[grid]`` runs instead whenever anything is unknown: not a compiled
``JITFunction`` (``TRITON_INTERPRET=1``), a Triton release outside
``TESTED_TRITON``, a non-tensor argument given per call, a launch hook set,
or while torch.compile traces.  Launches go to the current stream, so CUDA graphs
capture them as they capture ``kernel[grid]``.  A KernelCall serves one step
on one device: the wrappers build one per layer geometry of a step.
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
# The relaunch (launcher, argument order) of each compiled kernel by
# (configuration, device, variant: KernelCall._variant), so the KernelCalls
# a later step builds find them without JITFunction.run (Triton keeps each
# kernel anyway).  A configuration (kernel and fixed arguments) is numbered
# when a KernelCall is built.
_CONFIGS: dict[tuple, int] = {}
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
        self._may_relaunch = support.relaunch and isinstance(
            kernel, getattr(triton.runtime, "JITFunction", ())
        )
        self._relaunch: _Relaunch | None = None
        if not self._may_relaunch:
            return
        params = _parameters(kernel)
        self._any_alignment = params.any_alignment
        self._hip = support.amd_buffer_bound
        # The fixed kernel arguments (not the launch options), in order (a
        # tensor as its pointer), and the configuration's key: an int
        # argument counts by the class Triton specialises it by (int32 or
        # not; unless do_not_specialize, whether it is 1 and whether a
        # multiple of 16), not by its value, and a tensor by its dtype,
        # alignment and (AMD) 2 GiB bound, not by its identity.
        kinds = params.kinds
        self._fixed_args = [name for name in fixed if name in kinds]
        fixed_values = []
        key: list[Any] = []
        for name, value in fixed.items():
            kind = kinds.get(name)  # None: a launch option
            if type(value) is int and kind == _INT:
                key.append((value in _INT32) + 2 * (value == 1) + 4 * (value % 16 == 0))
            elif type(value) is int and kind == _LOOSE_INT:
                key.append(value in _INT32)
            elif isinstance(value, torch.Tensor):
                pointer = value.data_ptr()
                aligned = name in params.any_alignment or not pointer & 15
                within = self._hip and _within_buffer((value,))
                key.append((value.dtype, aligned, within))
                value = pointer
            else:
                key.append(value)
            if kind is not None:
                fixed_values.append(value)
        self._fixed_values = tuple(fixed_values)
        self._config = _CONFIGS.setdefault(
            (params.number, tuple(fixed), tuple(key)), len(_CONFIGS)
        )
        # What a relaunch of the first call's kernel needs of a later call:
        # its keywords, which of its tensors Triton specialises on 16-byte
        # alignment, on AMD which storages were within 2 GiB.
        self._names: tuple[str, ...] = ()
        self._aligned: tuple[bool, ...] = ()
        self._within: tuple[bool, ...] | None = None

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
        """The tensors' pointers for a relaunch of the first call's kernel
        (None for None), or None where the call differs from the first in
        what it may not: the keywords, a specialised pointer that is not
        16-byte aligned, on AMD a storage on the other side of 2 GiB."""
        if tuple(tensors) != self._names:
            return None
        try:
            pointers = [t if t is None else t.data_ptr() for t in tensors.values()]
        except AttributeError:  # not a tensor: Triton decides
            return None
        if _misaligned(pointers, self._aligned):
            return None
        within = self._within
        if within is not None and within != _within_buffer(tensors.values()):
            return None
        return pointers

    def _launch(self, tensors: dict[str, torch.Tensor | None]) -> None:
        """A call the relaunch does not take (the first, one that differs,
        anything unknown): through ``kernel[grid]``, or for a first call the
        kernel an earlier KernelCall of this configuration compiled; keeps
        what a relaunch needs."""
        variant = None
        first = self._may_relaunch and self._relaunch is None
        if first and not torch.compiler.is_compiling():
            # Which of the tensors Triton specialises on 16-byte alignment.
            aligned = tuple(name not in self._any_alignment for name in tensors)
            variant = self._variant(tensors, aligned)
        if variant is None:
            self.kernel[self.grid](**self.fixed, **tensors)  # Triton decides
            return
        key = (self._config, triton.runtime.driver.active.get_current_device(), variant)
        found = _COMPILED.get(key)
        launched = found is None
        if launched:
            compiled = self.kernel[self.grid](**self.fixed, **tensors)
            names = _parameters(self.kernel).names
            given = [*self._fixed_args, *tensors]
            if compiled is None or sorted(given) != sorted(names):
                return  # (Triton launched it, or said what is missing)
            # The kernel's arguments in order, taken from (*fixed, *pointers).
            order = operator.itemgetter(*(given.index(n) for n in names))
            found = _Relaunch(compiled, order, self.grid)
            if len(_COMPILED) < _MAX_COMPILED:
                _COMPILED[key] = found
        self._names = tuple(tensors)
        self._aligned = aligned
        self._within = variant[-1]
        self._relaunch = found
        if not launched:
            self(**tensors)  # relaunches the kernel found

    def _variant(
        self, tensors: dict[str, torch.Tensor | None], aligned: tuple[bool, ...]
    ) -> tuple | None:
        """What the compiled kernel depends on beyond the configuration
        (None: ``kernel[grid]``): the keywords in order (the launcher takes
        the arguments in it), the tensors' dtypes (None for None) and, on
        AMD, each storage's bound.  A misaligned pointer: None."""
        try:
            pointers = [t if t is None else t.data_ptr() for t in tensors.values()]
            within = _within_buffer(tensors.values()) if self._hip else None
        except AttributeError:  # not a tensor: Triton decides
            return None
        if _misaligned(pointers, aligned):
            return None
        dtypes = map(getattr, tensors.values(), _DTYPE, _NO_DTYPE)
        return (*tensors, *dtypes, within)

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


_DTYPE = itertools.repeat("dtype")
_NO_DTYPE = itertools.repeat(None)


_CONSTEXPR, _INT, _LOOSE_INT = 0, 1, 2
_KERNEL_NUMBERS = itertools.count()


class _Parameters(NamedTuple):
    number: int  # the kernel's, in _CONFIGS keys
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
        number=next(_KERNEL_NUMBERS),
        names=tuple(p.name for p in params),
        kinds=kinds,
        any_alignment=frozenset(
            p.name for p in params if p.do_not_specialize_on_alignment
        ),
    )


def _misaligned(pointers: list, specialised: tuple[bool, ...]) -> bool:
    """Whether a pointer Triton specialises on alignment (``specialised``,
    per pointer; None counts as aligned) is not 16-byte aligned."""
    bits = 0
    for pointer in itertools.compress(pointers, specialised):
        bits |= pointer or 0
    return bool(bits & 15)


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
