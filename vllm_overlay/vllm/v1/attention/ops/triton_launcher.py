# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checked-once Triton launches for kernels called once per layer per step.

An attention wrapper runs eagerly once per layer (48-61 times a step) between
the pieces of a piecewise CUDA graph, so its host time is paid on every layer.
Two costs dominate it: its argument checks, the same for every layer of a
step, and ``kernel[grid](...)``, where ``JITFunction.run`` binds and
specialises every argument and builds the compile-cache key on every call.

  * ``cached_launch`` caches a wrapper's checks and what they derive (a
    ``KernelLaunch`` per kernel, buffer sizes, ...) by a key made from all of
    their arguments, as the checks see them (shapes, strides, dtypes, devices,
    values): a miss runs the checks, a hit skips them, and no wrapper writes
    a key.
  * ``KernelLaunch`` fixes a kernel's grid, scalar arguments, constexprs and
    options; per call only its tensor arguments (the kernel's leading
    parameters) change.  The first call of each pointer pattern launches
    through ``kernel[grid]`` (compiling if needed) and keeps the
    ``CompiledKernel`` it returns together with that kernel's own launcher,
    ``compiled[grid]`` (``CompiledKernel.__getitem__``: it builds the launch
    metadata and passes the launch hooks exactly as ``JITFunction.run`` does).
    Later calls whose pointers Triton would specialise the same way call that
    launcher directly, or, while no launch hook is set, the compiled kernel's
    ``run`` with the arguments that launcher would pass (no launch metadata,
    no hooks), where the installed Triton's launcher is seen to call ``run``
    that way (``_RUN_CALL``).

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
torch.compile traces, ``fast_path()`` is False and the wrappers check and
launch normally.  ``ENABLED = False`` turns caching and direct launches off.
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from functools import reduce
from operator import or_
from types import UnionType
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.triton_utils import triton

logger = init_logger(__name__)

__all__ = [
    "ENABLED",
    "KernelLaunch",
    "OptionalTensors4",
    "Tensors3",
    "Tensors4",
    "cached_launch",
    "clear_caches",
    "fast_path",
    "launch_path",
]

# Caching and direct launches on (False: every call checks its arguments and
# launches through kernel[grid]).
ENABLED = True

# A cache holding more keys than this is emptied (dropping them all is cheap).
_MAX_KEYS = 4096

_CACHES: list[_LaunchCache] = []

# Compiled kernels (not TRITON_INTERPRET=1, not vLLM's Triton placeholder).
_JITFunction = getattr(getattr(triton, "runtime", None), "JITFunction", ())


def fast_path() -> bool:
    """Whether a wrapper may use its cache and direct launches for this call."""
    return ENABLED and not torch.compiler.is_compiling()


class _LaunchCache(dict):
    """A wrapper's checked launches by key (a dict that empties when full)."""

    def __init__(self) -> None:
        super().__init__()
        _CACHES.append(self)

    def put(self, key, value):
        if len(self) >= _MAX_KEYS:
            self.clear()
        self[key] = value
        return value


def _key(args) -> tuple:
    """A key of any arguments: a tensor by shape, strides, dtype and device, a
    tuple (a named tuple such as a plan) by its elements, anything else by type
    and value (5 == 5.0)."""
    return tuple(
        [
            (a.shape, a.stride(), a.dtype, a.device)
            if type(a) is torch.Tensor
            else (type(a), a)
            if type(a) in _BY_VALUE
            else _other_key(a)
            for a in args
        ]
    )


def _other_key(a):
    if isinstance(a, torch.Tensor):  # a subclass (nn.Parameter, ...)
        return (a.shape, a.stride(), a.dtype, a.device)
    return _key(a) if isinstance(a, tuple) else (type(a), a)


_BY_VALUE = frozenset((int, float, bool, str, type(None), torch.dtype))

# Groups of tensor arguments of a cached check, keyed by their geometry
# (Optional...: each a tensor or None, e.g. for one it does not read).
Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
OptionalTensors4 = tuple[Any, Any, Any, Any]


def _union(hint) -> set:
    if hint is Ellipsis:
        return set()
    return set(typing.get_args(hint) if isinstance(hint, UnionType) else (hint,))


def _key_source(check, params) -> tuple[str, str]:
    """``check``'s parameters and the straight-line code of their key, from its
    annotations: a ``torch.Tensor``, ``torch.Tensor | None`` or a group of them
    (``Tensors4``, ``OptionalTensors4`` ...; unpacked) by geometry, one of
    ``_BY_VALUE`` (or a union of them) by type and value, a tuple of those as
    it is, a named tuple by its elements, another class by type and value,
    anything else through ``_key``."""
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return "*args", "_k_ = _key_(args)"
    hints = typing.get_type_hints(check)
    names = [p.name for p in params]
    lines, parts = [], []
    for name in names:
        hint = hints.get(name)
        kinds = _union(hint)
        tensor = torch.Tensor in kinds <= {torch.Tensor, type(None)}
        tensors = [(name, kinds)] if tensor else []
        (group_hint, *rest) = kinds - {type(None)} or {None}
        group = typing.get_args(group_hint)
        if (
            not rest
            and type(None) in kinds
            and typing.get_origin(group_hint) is tuple
            and set(group) == {torch.Tensor}
        ):  # a group of tensors, or None: one nested tuple
            names_i = [f"{name}_{i}" for i in range(len(group))]
            geometry = ", ".join(
                f"{t}.shape, {t}.stride(), {t}.dtype, {t}.device" for t in names_i
            )
            lines += [f"if {name} is None:", f"    _g_{name} = None", "else:"]
            lines += [f"    {', '.join(names_i)}, = {name}"]
            lines += [f"    _g_{name} = ({geometry})"]
            parts.append(f"_g_{name}")
            continue
        group = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and set(group) <= {Any, torch.Tensor}:
            tensors = [(f"{name}_{i}", {k}) for i, k in enumerate(group)]
            lines.append(f"{', '.join(t for t, _ in tensors)}, = {name}")
        for t, k in tensors:  # Any: a tensor or None
            geometry = f"{t}.shape, {t}.stride(), {t}.dtype, {t}.device"
            if k != {torch.Tensor}:
                geometry = f"None if {t} is None else ({geometry})"
            parts.append(geometry)
        if tensors:
            continue
        if kinds <= _BY_VALUE:
            parts.append(f"type({name}), {name}")
            continue
        value = f"_key_(({name},))"
        classes = [k for k in kinds - {type(None)} if isinstance(k, type)]
        if len(classes) == len(kinds - {type(None)}) == 1:
            # One class: a tuple (a named tuple) by its elements, else by value.
            by_value = f"(type({name}), {name})"
            value = f"_key_({name})" if issubclass(classes[0], tuple) else by_value
        for kind in kinds:
            if typing.get_origin(kind) is tuple:  # tuple[int, ...]: as it is
                inner = {k for a in typing.get_args(kind) for k in _union(a)}
                value = name if inner <= _BY_VALUE else f"_key_({name})"
        if type(None) in kinds:
            value = f"None if {name} is None else {value}"
        parts.append(value)
    lines.append(f"_k_ = ({', '.join(parts)},)")
    return ", ".join(names), "\n        ".join(lines)


def _signature(params) -> str:
    """The parameters with their defaults (``_defaults_[i]``)."""
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return "*args"
    return ", ".join(
        p.name if p.default is p.empty else f"{p.name}=_defaults_[{i}]"
        for i, p in enumerate(params)
    )


# Names of the generated function's own start and end with "_" (parameters
# of the checks do not).
_CACHED_SOURCE = """
def cached({signature}):
    if not _launcher_.ENABLED or _compiling_():
        return _check_({params})
    try:
        {key}
        _hit_ = _cache_.get(_k_, _cache_)
    except (AttributeError, TypeError, ValueError):  # not tensors, unhashable
        return _check_({params})
    return _hit_ if _hit_ is not _cache_ else _cache_.put(_k_, _check_({params}))
"""


def cached_launch(check):
    """Cache a wrapper's ``check(...)`` by what it can read of its arguments.

    ``check`` validates a wrapper's arguments and returns what its launch needs
    (``KernelLaunch`` objects, sizes); it must be a function of its arguments'
    shapes, strides, dtypes and devices and of their other values (never of a
    tensor's data or address) and of module constants, which is what the key
    holds (``_key_source``: made from the annotations), so a hit is what
    ``check`` would return.  Call it positionally.  A call that raises caches
    nothing; arguments the key cannot be made of are checked on every call, as
    are all while torch.compile traces or with ``ENABLED`` False.  The key is
    straight-line code, as Triton's own binder is: it runs on every layer.
    """
    cache = _LaunchCache()
    parameters = list(inspect.signature(check).parameters.values())
    params, key = _key_source(check, parameters)
    signature = _signature(parameters)
    source = _CACHED_SOURCE.format(signature=signature, params=params, key=key)
    launcher = sys.modules[__name__]  # ENABLED as it is at the call
    namespace = dict(_check_=check, _cache_=cache, _key_=_key, _launcher_=launcher)
    namespace["_defaults_"] = [p.default for p in parameters]
    namespace["_compiling_"] = torch.compiler.is_compiling
    exec(source, namespace)
    cached = functools.wraps(check)(namespace["cached"])
    cached.cache = cache  # type: ignore[attr-defined]
    return cached


def clear_caches() -> None:
    """Forget every validated launch (tests and tuning change module constants
    that launches were derived from)."""
    for cache in _CACHES:
        cache.clear()


# ---------------------------------------------------------------- launch path

_MAX_INT32 = 2**31 - 1
ALIGNMENT = "alignment"
ALIGNMENT_AND_2GB = "alignment+2GiB"
BACKEND_CALL = "backend call"


class LaunchPath:
    """What the installed Triton lets a ``KernelLaunch`` do, found once.

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
        "_path",
        "_compiled",
    )

    def __init__(self, kernel, grid, scalars=(), constexprs=None, **options):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.scalars = tuple(scalars)
        self.constexprs = dict(constexprs or {})
        self.options = options
        self._dims = (*self.grid, 1, 1)[:3]
        self._tail: tuple = ()  # scalars + constexpr values in parameter order
        self._path = _UNKNOWN  # the process's launch path, once a launch found it
        # (device, pointer key) -> (run, its arguments after grid and stream,
        # launcher)
        # of the CompiledKernel Triton compiled for that key
        self._compiled: dict = {}

    def __call__(self, *tensors) -> None:
        if self._compiled:
            path = self._path
            device = path.current_device()
            ptrs = [t.data_ptr() for t in tensors]
            entry = self._compiled.get((device, _pointer_key(path, tensors, ptrs)))
            if entry is not None:
                run, after, launcher = entry
                stream = path.current_stream(device)
                if path.quiet is not None and path.quiet():
                    run(*self._dims, stream, *after, *tensors, *self._tail)
                else:
                    launcher(*tensors, *self._tail, stream=stream)
                return
        compiled = self.kernel[self.grid](
            *tensors, *self.scalars, **self.constexprs, **self.options
        )
        if isinstance(self.kernel, _JITFunction) and fast_path():
            self._remember(compiled, tensors)

    def compile_only(self, tensors, caches=(), cache_bytes=None) -> None:
        """Compile for ``tensors`` without launching (JIT warmup): the tensors
        at indices ``caches`` stand in for the KV cache, whose storage is
        ``cache_bytes`` (None: unknown, compile for a pool over 2 GiB and a
        small one, the two AMD buffer-ops variants)."""
        for nbytes in (_KV_POOL_BYTES, 1) if cache_bytes is None else (cache_bytes,):
            ptrs = [
                _CompileOnlyPointer(t, nbytes if i in caches else None)
                for i, t in enumerate(tensors)
            ]
            self.kernel.warmup(
                *ptrs, *self.scalars, **self.constexprs, **self.options, grid=self.grid
            )

    def _remember(self, compiled, tensors) -> None:
        path = launch_path()
        if not path.direct or not isinstance(compiled, path.compiled_type):
            return
        if not self._tail:
            names = self.kernel.arg_names[len(tensors) + len(self.scalars) :]
            if sorted(names) != sorted(self.constexprs):
                raise TypeError(
                    f"KernelLaunch: {self.kernel} takes {self.kernel.arg_names}; "
                    f"got {len(tensors)} tensors, {len(self.scalars)} scalars and "
                    f"constexprs {sorted(self.constexprs)}"
                )
            self._tail = (*self.scalars, *(self.constexprs[n] for n in names))
        grid = self._dims
        ptrs = [t.data_ptr() for t in tensors]
        key = (path.current_device(), _pointer_key(path, tensors, ptrs))
        self._path = path
        launcher = compiled[grid]  # loads the kernel's handles if needed
        # run's arguments after the grid and stream: the handle, the metadata,
        # no launch metadata and no hooks (what quiet() allows).
        after = (compiled.function, compiled.packed_metadata, None, None, None)
        self._compiled[key] = (compiled.run, after, launcher)


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
