"""Export fakes the way AITER exports its ops, so that the series' probes see
what they would see on a ROCm machine.

Mirrors ROCm/aiter at e4048607 (``v0.1.20-46``, the newest readable snapshot;
the pinned v0.1.28.post1, pins.env ``AITER_REF``, is not readable here, so
the lines below were not re-checked at it):

* ``aiter/jit/core.py`` ``compile_ops(...)``: the pybind op is wrapped by
  ``torch_compile_guard(device="cuda", calling_func_=func)``;
* ``aiter/jit/utils/torch_guard.py`` ``torch_compile_guard``: the Python stub's
  signature becomes a ``torch.library`` schema in the ``aiter`` namespace
  (``torch.library.infer_schema(stub, mutates_args="unknown")``: every Tensor
  argument is marked mutable), and the exported callable is
  ``wrapper_custom(*args, **kwargs)`` -- no ``functools.wraps`` -- which calls
  ``torch.ops.aiter.<name>(*args, **kwargs)``.  ``inspect.signature`` of the
  export is therefore ``(*args, **kwargs)``; only the registered schema names
  the arguments.  Ops listed in ``MANUAL_SCHEMA_OPS`` (``mha_varlen_fwd``,
  ``fmha_v3_varlen_fwd``, ...) get their schema from AITER's own
  ``generate_schema`` instead (``generate_schema`` here);
* ``csrc/cpp_itfs/torch_utils.py`` ``direct_register_custom_op``: ops such as
  ``paged_attention_v1`` are defined with ``infer_schema(op_func,
  mutates_args=[...])`` and called as ``torch.ops.aiter.<name>`` only
  (``AiterExport.register_direct``).

Registrations here go to a private namespace per install (``torch.library``
cannot drop a definition again), and ``torch.ops.aiter`` is pointed at it
while the fake is installed.
"""

from __future__ import annotations

import inspect
import importlib.machinery
import itertools
import sys
import types
import typing
from collections.abc import Callable

import torch

__all__ = ["MANUAL_SCHEMA_OPS", "AiterExport", "generate_schema", "guarded_export"]

_COUNTER = itertools.count()

# aiter/jit/utils/torch_guard.py l.38-59 (e4048607): ops whose schema
# torch_compile_guard writes with generate_schema() rather than infer_schema.
MANUAL_SCHEMA_OPS = frozenset({
    "register_graph_buffers", "module_moe_ck2stages", "mha_fwd", "fmha_v3_fwd",
    "mha_varlen_fwd", "mha_bwd", "fmha_v3_bwd", "mha_varlen_bwd", "fmha_v3_varlen_bwd",
    "fmha_v3_varlen_fwd", "mha_batch_prefill", "hipb_findallsols", "rocb_findallsols",
    "_ActivationType", "_QuantType", "init_custom_ar", "greedy_sample", "random_sample",
    "mixed_sample", "exponential",
})


def _schema_type(annotation, idx: int) -> str | None:
    tensor_opt = torch.Tensor | None
    if annotation is torch.Tensor:
        return f"Tensor(a{idx}!)"
    if annotation == tensor_opt or (
            typing.get_origin(annotation) in (typing.Union, types.UnionType)
            and torch.Tensor in typing.get_args(annotation)):
        return f"Tensor(a{idx}!)?"
    if annotation in (torch.SymInt, int):
        return "SymInt"
    if annotation in (float, bool, str):
        return annotation.__name__
    if annotation == (torch.Generator | None):
        return "Generator?"
    if typing.get_origin(annotation) is list:
        arg = typing.get_args(annotation)[0]
        if arg is torch.Tensor:
            return f"Tensor(a{idx}!)[]"
        if arg is int:
            return "int[]"
    if annotation == (torch.dtype | None):
        return "ScalarType?"
    return None


def generate_schema(func: Callable) -> str:
    """AITER's ``generate_schema(func, mutates_args="unknown")``
    (aiter/jit/utils/torch_guard.py l.95-197, e4048607), as torch_compile_guard
    calls it for ``MANUAL_SCHEMA_OPS``: every Tensor argument is mutable with
    its own alias set, ``int`` becomes ``SymInt``, defaults are written with
    ``str()``; a tuple return lists its element types."""
    sig = inspect.signature(func)
    params = []
    for idx, (name, param) in enumerate(sig.parameters.items()):
        type_str = _schema_type(param.annotation, idx)
        if type_str is None:  # AITER writes "* " and drops the name
            params.append("* ")
            continue
        text = f"{type_str} {name}"
        if param.default is not inspect.Parameter.empty:
            text += "=None" if param.default is None else f"={param.default}"
        params.append(text)
    ret = sig.return_annotation
    simple = {torch.Tensor: "Tensor", int: "int", float: "float", bool: "bool"}
    if ret is None or ret is type(None):
        ret_str = "()"
    elif ret in simple:
        ret_str = simple[ret]
    elif typing.get_origin(ret) is list and typing.get_args(ret)[0] in (int, torch.Tensor):
        ret_str = "int[]" if typing.get_args(ret)[0] is int else "Tensor[]"
    elif typing.get_origin(ret) is tuple:
        ret_str = "(" + ", ".join(simple[a] for a in typing.get_args(ret) if a in simple) + ")"
    else:
        ret_str = "Any"
    return f"({', '.join(params)}) -> {ret_str}"


def guarded_export(name: str, namespace: str) -> Callable:
    """AITER's ``wrapper_custom``: ``(*args, **kwargs)`` over the registered op
    (first argument a Tensor, so no dummy tensor is prepended)."""

    def wrapper_custom(*args, **kwargs):
        return getattr(torch.ops.aiter, name)(*args, **kwargs)

    return wrapper_custom


class AiterExport:
    """A fake ``aiter`` package: modules in ``sys.modules`` and ops registered
    the way AITER registers them.  ``install()`` / ``uninstall()``, or use it
    as a context manager (a pytest fixture can call both)."""

    def __init__(self):
        self.namespace = f"aiter_fake{next(_COUNTER)}"
        self._lib = torch.library.Library(self.namespace, "DEF")
        self.modules: dict[str, types.ModuleType] = {}
        self._saved_modules: dict[str, types.ModuleType | None] = {}
        self._saved_ops = None
        self._installed = False

    # --- building -----------------------------------------------------------

    def module(self, name: str) -> types.ModuleType:
        """``aiter`` or a submodule (parents are created and linked)."""
        if name not in self.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []  # a package, so "import aiter.ops.x" resolves
            # As an imported package has: vLLM calls find_spec("aiter").
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            self.modules[name] = mod
            parent, _, leaf = name.rpartition(".")
            if parent:
                setattr(self.module(parent), leaf, mod)
        return self.modules[name]

    def register_guarded(self, module: str, stub: Callable, impl: Callable,
                         *, mutates_args="unknown", export_name: str | None = None) -> Callable:
        """Register ``impl`` under ``stub``'s schema (as ``torch_compile_guard``
        does: ``generate_schema`` for ``MANUAL_SCHEMA_OPS``, else
        ``infer_schema``) and export the guard wrapper from ``module``.
        ``impl`` gets the op's arguments by keyword-or-position as the schema
        orders them."""
        name = stub.__name__
        if name in MANUAL_SCHEMA_OPS:
            schema = generate_schema(stub)
        else:
            schema = torch.library.infer_schema(stub, mutates_args=mutates_args)
        self._lib.define(f"{name}{schema}")
        for key in ("CPU", "CUDA"):
            self._lib.impl(name, impl, key)
        export = guarded_export(name, self.namespace)
        setattr(self.module(module), export_name or name, export)
        return export

    def register_direct(self, op_func: Callable, mutates_args: list[str]) -> None:
        """``direct_register_custom_op(name, op_func, mutates_args)``
        (csrc/cpp_itfs/torch_utils.py l.85-127, e4048607): the schema is
        ``infer_schema(op_func, mutates_args)``, the op is reached only as
        ``torch.ops.aiter.<name>``.  AITER registers the CUDA kernel only; the
        fake is registered for the CPU too, so the CPU tier can call it."""
        name = op_func.__name__
        self._lib.define(name + torch.library.infer_schema(op_func, mutates_args=mutates_args))
        for key in ("CPU", "CUDA"):
            self._lib.impl(name, op_func, key)

    def export_plain(self, module: str, name: str, fn: Callable) -> Callable:
        """A function AITER exports as plain Python (its Triton wrappers, the
        ``aiter`` top-level re-exports of Python functions)."""
        setattr(self.module(module), name, fn)
        return fn

    # --- installing ---------------------------------------------------------

    def install(self) -> "AiterExport":
        if self._installed:
            return self
        for name, mod in self.modules.items():
            self._saved_modules[name] = sys.modules.get(name)
            sys.modules[name] = mod
        self._saved_ops = torch.ops.__dict__.get("aiter")
        setattr(torch.ops, "aiter", getattr(torch.ops, self.namespace))
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        for name, mod in self._saved_modules.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        self._saved_modules.clear()
        if self._saved_ops is None:
            torch.ops.__dict__.pop("aiter", None)
        else:
            setattr(torch.ops, "aiter", self._saved_ops)
        self._installed = False

    def __enter__(self) -> "AiterExport":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
