# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton launches for kernels called once per layer per step.

An attention wrapper runs eagerly once per layer (48-61 times a step) between
the pieces of a piecewise CUDA graph, so its host time is paid on every layer.
``kernel[grid](...)`` dominates it: ``JITFunction.run`` binds and specialises
every argument and builds the compile-cache key on every call.

``launch(kernel, grid, *args, **kwargs)`` does what ``kernel[grid](*args,
**kwargs)`` does.  The first launch of each key goes through ``kernel[grid]``
(compiling if needed) and keeps the ``CompiledKernel`` it returns; later
launches with the same key call that kernel's ``run`` with the arguments
``CompiledKernel.__getitem__``'s launcher would pass (no launch metadata, no
hooks) while no launch hook is set, where the installed Triton's launcher is
seen to call ``run`` that way (``_RUN_CALL``), else through that launcher.  The
key is never coarser than Triton's own: the tensors' dtypes and what the
backend specialises their pointers on, every scalar by value except the
kernel's ``do_not_specialize`` ones (by Triton type), every constexpr and
option by value, and the device.

Which path runs is decided once per process, on the first compiled launch, by
what the installed Triton provides (``launch_path()``), not by its version:

  * ``kernel[grid]`` must return a ``CompiledKernel`` with ``__getitem__``;
  * the active backend's pointer specialisation is probed on meta tensors
    (no memory): if it depends only on 16-byte alignment, or on alignment and
    a storage within 2 GiB (AMD buffer ops), the per-call key computes just
    that; if it depends on anything else, the backend's own function is
    called per tensor.  The key is never coarser than Triton's, so a direct
    launch never runs a kernel compiled for assumptions the pointers break.

Anything missing (another Triton layout, no AMD/NVIDIA backend, a driver
that cannot be asked) selects the plain path, ``kernel[grid]`` on every call;
the choice and its reason are logged once at info.  Direct launches go to the
current stream, so CUDA graphs capture them like ``kernel[grid]``; while
torch.compile traces, launches go through ``kernel[grid]``.  ``ENABLED =
False`` turns direct launches off.
"""

from __future__ import annotations

import inspect
from functools import reduce
from operator import or_

import torch

from vllm.logger import init_logger
from vllm.triton_utils import triton

logger = init_logger(__name__)

__all__ = ["ENABLED", "clear_caches", "launch", "launch_path", "warmup"]

# Direct launches on (False: every launch goes through kernel[grid]).
ENABLED = True

# A kernel holding more compiled-kernel keys than this empties them (dropping
# them all is cheap).
_MAX_KEYS = 4096

# Compiled kernels (not TRITON_INTERPRET=1, not vLLM's Triton placeholder).
_JITFunction = getattr(getattr(triton, "runtime", None), "JITFunction", ())


def clear_caches() -> None:
    """Forget every compiled kernel ``launch`` kept (tests and tuning change
    module constants that launches derive from)."""
    _STATES.clear()


# ---------------------------------------------------------------- launch path

_MAX_INT32 = 2**31 - 1
ALIGNMENT = "alignment"
ALIGNMENT_AND_2GB = "alignment+2GiB"
BACKEND_CALL = "backend call"


class LaunchPath:
    """What the installed Triton lets ``launch`` do, found once.

    ``direct``: whether hits call the compiled kernel's launcher; ``reason``:
    why (logged once); ``pointer_key``: how pointers select a compiled kernel
    (``ALIGNMENT``, ``ALIGNMENT_AND_2GB`` or ``BACKEND_CALL``); ``spec``: the
    backend's per-tensor specialisation (for ``BACKEND_CALL``); ``quiet``:
    None, or a function telling whether no launch hook is set, when the
    compiled kernel's ``run`` may be called with the grid, stream, handle and
    metadata ``CompiledKernel.__getitem__`` passes it (no hooks, no launch
    metadata) instead of through that launcher.
    """

    def __init__(
        self,
        direct,
        reason,
        pointer_key=None,
        spec=None,
        current_device=None,
        current_stream=None,
        compiled_type=None,
        quiet=None,
    ):
        self.direct = direct
        self.reason = reason
        self.pointer_key = pointer_key
        self.spec = spec
        self.current_device = current_device
        self.current_stream = current_stream
        self.compiled_type = compiled_type
        self.quiet = quiet


_PATH: LaunchPath | None = None
_UNKNOWN = LaunchPath(False, "no compiled launch yet")


def launch_path() -> LaunchPath:
    """The process's launch path (found and logged on first use)."""
    global _PATH
    if _PATH is None:
        _PATH = _find_launch_path()
        logger.info(
            "Triton %s: %s launches (%s)",
            getattr(triton, "__version__", "?"),
            "direct CompiledKernel" if _PATH.direct else "kernel[grid]",
            _PATH.reason,
        )
    return _PATH


def _find_launch_path() -> LaunchPath:
    try:
        from triton.compiler.compiler import CompiledKernel, make_backend
        from triton.runtime import driver

        active = driver.active
        backend = type(make_backend(active.get_current_target()))
        current_device = active.get_current_device
        current_stream = active.get_current_stream
    except Exception as e:  # another Triton layout, or no usable driver
        return LaunchPath(False, f"Triton internals not found: {e!r}")
    if not callable(getattr(CompiledKernel, "__getitem__", None)):
        return LaunchPath(False, "CompiledKernel has no launcher (__getitem__)")
    pointer_key, spec = probe_pointer_specialization(backend)
    if pointer_key is None:
        return LaunchPath(False, f"{backend.__name__}: {spec}")
    quiet = _hooks_quiet(CompiledKernel)
    return LaunchPath(
        True,
        f"{backend.__name__}, pointer key: {pointer_key}, "
        + ("run() when no launch hook is set" if quiet else "CompiledKernel[grid]"),
        pointer_key,
        spec,
        current_device,
        current_stream,
        CompiledKernel,
        quiet,
    )


# How CompiledKernel.__getitem__'s launcher calls the compiled kernel's run
# (Triton 3.4 - 3.9), whitespace removed.
_RUN_CALL = (
    "self.run(grid[0],grid[1],grid[2],stream,self.function,self.packed_metadata,"
    "launch_metadata,knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
    "*args)"
)


def _hooks_quiet(compiled_type):
    """A ``quiet()`` check when the installed Triton's own launcher calls
    ``run`` as _RUN_CALL and reads its hooks from ``triton.knobs.runtime``
    (else None: launches go through ``compiled[grid]``)."""
    import inspect

    try:
        source = "".join(inspect.getsource(compiled_type.__getitem__).split())
        runtime = triton.knobs.runtime
        runtime.launch_enter_hook, runtime.launch_exit_hook  # noqa: B018
    except (OSError, TypeError, AttributeError):
        return None
    if _RUN_CALL not in source:
        return None
    chain = getattr(triton.knobs, "HookChain", None)

    def unset(hook) -> bool:
        return hook is None or (type(hook) is chain and not hook.calls)

    def quiet() -> bool:
        return unset(runtime.launch_enter_hook) and unset(runtime.launch_exit_hook)

    return quiet


def probe_pointer_specialization(backend):
    """``(pointer_key, spec)``: what ``backend`` specialises a pointer on.

    ``spec(tensor)`` is the backend's own per-tensor specialisation
    (``get_tensor_specialization``, or ``get_arg_specialization`` before it
    existed).  It is called on meta tensors (no memory) at byte offsets 0, 1,
    8, 16 and 32, with storages under and over 2 GiB, and in two shapes; the
    result says which cheap key reproduces it.  ``(None, why)`` when the
    backend offers neither function or the probe fails.
    """
    tensor_spec = getattr(backend, "get_tensor_specialization", None)
    arg_spec = getattr(backend, "get_arg_specialization", None)
    if tensor_spec is not None:

        def spec(t):
            return tensor_spec(t, align=True)
    elif arg_spec is not None:

        def spec(t):
            return arg_spec(t, "tensor", align=True)
    else:
        return None, "no pointer specialisation function"
    results: dict[tuple[bool, bool], set] = {}
    try:
        for size in (64, _MAX_INT32 + 64):
            base = torch.empty(size, dtype=torch.uint8, device="meta")
            for offset in (0, 1, 8, 16, 32):
                flat = base[offset : offset + 32]
                for view in (flat, flat.view(4, 8)):
                    features = (offset % 16 == 0, size <= _MAX_INT32)
                    results.setdefault(features, set()).add(spec(view))
    except Exception as e:
        return None, f"pointer specialisation probe failed: {e!r}"
    if any(len(v) > 1 for v in results.values()):
        return BACKEND_CALL, spec  # depends on more than these features
    if all(results[(a, True)] == results[(a, False)] for a in (True, False)):
        return ALIGNMENT, spec
    return ALIGNMENT_AND_2GB, spec


def _pointer_key(path, tensors, ptrs):
    """The per-call part of the compiled-kernel key (never coarser than
    Triton's own specialisation of these pointers)."""
    key = path.pointer_key
    # True: all 16-byte aligned (the common case).
    aligned = True if not reduce(or_, ptrs) & 15 else tuple(not p & 15 for p in ptrs)
    if key is ALIGNMENT:
        return aligned
    if key is ALIGNMENT_AND_2GB:
        return aligned, tuple(
            t.untyped_storage().nbytes() <= _MAX_INT32 for t in tensors
        )
    return tuple(map(path.spec, tensors))


class _KernelState:
    """What ``launch`` keeps of one kernel: its compiled kernels by key
    (filled on compiled launches, read on hits) and the function computing
    that key from a call's arguments."""

    __slots__ = ("path", "key", "compiled")

    def __init__(self, path, kernel, args, kwargs):
        self.path = path
        self.key = _key_function(path, kernel, args, kwargs)
        self.compiled: dict = {}


def _key_function(path, kernel, args, kwargs):
    """``key(device, args, kwargs)`` for calls shaped like this one: tensors
    first (their dtypes and pointer key), then scalars (by value, or by Triton
    type for ``do_not_specialize`` ones), then every keyword by value.

    Straight-line code made for this kernel (as Triton's own binder is), so a
    call reads each tensor attribute once and loops over nothing; a call with
    another number of positional arguments or other keywords raises
    ValueError or KeyError (no hit).
    """
    num_tensors = next(
        (i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args)
    )
    names = [f"a{i}" for i in range(len(args))]
    tensors = names[:num_tensors]
    ptrs = [f"{t}.data_ptr()" for t in tensors]
    aligned = " or ".join(
        [f"({' | '.join(ptrs)}) & 15 == 0"]
        + [f"({', '.join(f'{p} & 15 == 0' for p in ptrs)},)"]
    )
    if not tensors:
        pointer = "()"
    elif path.pointer_key is ALIGNMENT:
        pointer = f"({aligned})"
    elif path.pointer_key is ALIGNMENT_AND_2GB:
        sizes = ", ".join(
            f"{t}.untyped_storage().nbytes() <= {_MAX_INT32}" for t in tensors
        )
        pointer = f"({aligned}), ({sizes},)"
    else:
        pointer = ", ".join(f"spec({t})" for t in tensors)
    params = kernel.params
    scalars = [
        f"scalar_type({n})"
        if i < len(params) and getattr(params[i], "do_not_specialize", False)
        else n
        for i, n in enumerate(names[num_tensors:], num_tensors)
    ]
    parts = [f"{t}.dtype" for t in tensors] + [pointer] + scalars
    parts += [f"kwargs[{k!r}]" for k in kwargs]
    source = (
        f"def key(device, args, kwargs):\n"
        f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args\n"
        f"    if len(kwargs) != {len(kwargs)}:\n"
        f"        raise KeyError('other keywords')\n"
        f"    return (device, {', '.join(parts)})\n"
    )
    scope = {"spec": path.spec, "scalar_type": _scalar_type}
    exec(source, scope)  # noqa: S102 - built above from argument counts only
    return scope["key"]


def _scalar_type(value):
    """The Triton type of a per-step (do_not_specialize) scalar, which alone
    selects its compiled kernel."""
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value)
    return "i32" if -(2**31) <= value < 2**31 else "u64" if value >= 2**63 else "i64"


# The state of every kernel launched through ``launch`` (module-level kernels,
# never freed).
_STATES: dict = {}


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel Triton
    chose for the same arguments where the launch path allows it.

    ``grid`` is a tuple of one to three ints; the kernel lists its tensor
    parameters first, then its runtime scalars (passed positionally), then its
    constexprs (by keyword, with the options such as ``num_warps``).  A scalar
    that changes from step to step must be in the kernel's
    ``do_not_specialize`` (only its Triton type is part of the key); every
    other scalar, constexpr and option is keyed by value, as are the tensors'
    dtypes and what Triton specialises their pointers on.  The first launch of
    each key goes through ``kernel[grid]`` (compiling if needed), and so does
    every call shaped otherwise than the kernel's first compiled launch (another
    number of positional arguments, other keywords: one call site per kernel).
    """
    state = _STATES.get(kernel)
    if state is not None and ENABLED:
        path = state.path
        device = path.current_device()
        try:
            entry = state.compiled.get(state.key(device, args, kwargs))
        except (AttributeError, KeyError, TypeError, ValueError):  # other arguments
            entry = None
        if entry is not None and not torch.compiler.is_compiling():
            compiled, rest = entry
            stream = path.current_stream(device)
            g = (*grid, 1, 1)
            if path.quiet is not None and path.quiet():
                # What CompiledKernel.__getitem__'s launcher passes (_RUN_CALL)
                # with no launch metadata and no hooks.
                compiled.run(*g[:3], stream, *compiled.meta, *args, *rest)
            else:
                compiled[g[:3]](*args, *rest, stream=stream)
            return
    compiled = kernel[grid](*args, **kwargs)
    if (
        ENABLED
        and isinstance(kernel, _JITFunction)
        and not torch.compiler.is_compiling()
    ):
        _remember(kernel, compiled, args, kwargs)


def _remember(kernel, compiled, args, kwargs) -> None:
    path = launch_path()
    if not path.direct or not isinstance(compiled, path.compiled_type):
        return
    state = _STATES.get(kernel)
    if state is None:
        state = _STATES[kernel] = _KernelState(path, kernel, args, kwargs)
    names = kernel.arg_names[len(args) :]
    params = kernel.params[len(args) :]
    rest = tuple(kwargs.get(n, p.default) for n, p in zip(names, params))
    if any(r is inspect.Parameter.empty for r in rest):
        return  # a parameter Triton filled otherwise: keep kernel[grid]
    compiled[(1, 1, 1)]  # loads the kernel's handles if needed
    try:
        key = state.key(path.current_device(), args, kwargs)
    except (AttributeError, KeyError, TypeError, ValueError):  # not the arguments the
        return  # state was made for
    if len(state.compiled) >= _MAX_KEYS:
        state.compiled.clear()
    state.compiled[key] = (_Compiled(compiled), rest)


class _Compiled:
    """A CompiledKernel with its ``run`` arguments after grid and stream."""

    __slots__ = ("kernel", "run", "meta")

    def __init__(self, kernel):
        self.kernel = kernel
        self.run = kernel.run
        self.meta = (kernel.function, kernel.packed_metadata, None, None, None)

    def __getitem__(self, grid):
        return self.kernel[grid]


def warmup(kernel, grid, *args, caches=(), cache_bytes=None, **kwargs) -> None:
    """Compile ``kernel`` for these arguments without launching (JIT warmup).

    The tensors at indices ``caches`` stand in for the KV cache, whose storage
    is ``cache_bytes`` (None: unknown, compile for a pool over 2 GiB and a
    small one, the two AMD buffer-ops variants).
    """
    for nbytes in (_KV_POOL_BYTES, 1) if cache_bytes is None else (cache_bytes,):
        stand_ins = [
            _CompileOnlyPointer(a, nbytes if i in caches else None)
            if isinstance(a, torch.Tensor)
            else a
            for i, a in enumerate(args)
        ]
        kernel.warmup(*stand_ins, **kwargs, grid=grid)


_KV_POOL_BYTES = 1 << 40  # "more than 2 GiB": a KV cache pool


class _CompileOnlyPointer:
    """A pointer argument for a compile-only launch: dtype, 16-byte aligned,
    and the byte size of its storage (``ptr_range``, read by the AMD backend)."""

    def __init__(self, t: torch.Tensor, nbytes: int | None = None):
        self.dtype = t.dtype
        self._bytes = t.untyped_storage().nbytes() if nbytes is None else nbytes

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return self._bytes
