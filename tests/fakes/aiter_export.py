"""Export fakes the way AITER exports its ops, so that the series' probes see
what they would see on a ROCm machine.

Mirrors ROCm/aiter at e4048607 (``v0.1.20-46``):

* ``aiter/jit/core.py`` ``compile_ops(...)``: the pybind op is wrapped by
  ``torch_compile_guard(device="cuda", calling_func_=func)``;
* ``aiter/jit/utils/torch_guard.py`` ``torch_compile_guard``: the Python stub's
  signature becomes a ``torch.library`` schema in the ``aiter`` namespace
  (``torch.library.infer_schema(stub, mutates_args="unknown")``: every Tensor
  argument is marked mutable), and the exported callable is
  ``wrapper_custom(*args, **kwargs)`` -- no ``functools.wraps`` -- which calls
  ``torch.ops.aiter.<name>(*args, **kwargs)``.  ``inspect.signature`` of the
  export is therefore ``(*args, **kwargs)``; only the registered schema names
  the arguments.

Registrations here go to a private namespace per install (``torch.library``
cannot drop a definition again), and ``torch.ops.aiter`` is pointed at it
while the fake is installed.
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable

import torch

__all__ = ["AiterExport", "guarded_export"]

_COUNTER = itertools.count()


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
            self.modules[name] = mod
            parent, _, leaf = name.rpartition(".")
            if parent:
                setattr(self.module(parent), leaf, mod)
        return self.modules[name]

    def register_guarded(self, module: str, stub: Callable, impl: Callable,
                         *, mutates_args="unknown", export_name: str | None = None) -> Callable:
        """Register ``impl`` under ``stub``'s inferred schema (as
        ``torch_compile_guard`` does) and export the guard wrapper from
        ``module``.  ``impl`` gets the op's arguments by keyword-or-position as
        the schema orders them."""
        name = stub.__name__
        schema = torch.library.infer_schema(stub, mutates_args=mutates_args)
        self._lib.define(f"{name}{schema}")
        for key in ("CPU", "CUDA"):
            self._lib.impl(name, impl, key)
        export = guarded_export(name, self.namespace)
        setattr(self.module(module), export_name or name, export)
        return export

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
