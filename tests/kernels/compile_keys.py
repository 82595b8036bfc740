# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile keys of kernel launches, computed as Triton's JIT computes them.

``record(monkeypatch, kernels)`` stands a recorder in for each kernel: a
launch (``kernel[grid](...)``, ``.run``) or a compile-only ``.warmup`` runs
nothing and adds its key -- the compile tier's own specialisation
(``scripts/compile_tier/worker.specialize``: signature, constexprs and
attributes by ``native_specialize_impl`` of a real backend, honouring
``do_not_specialize``) plus the options -- for the sm_90 and gfx942 backends.
Tensors registered as the KV cache count as storage > 2 GiB (an engine's
pool), as the AMD backend sees them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


class _Big:
    """A KV cache pointer: its dtype, storage beyond 2 GiB (as in an engine)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return 1 << 40


class _Recorder:
    """Stands in for one kernel: every launch or warmup adds its compile key
    per backend to ``keys`` and runs nothing."""

    def __init__(self, kernel, backends, caches, keys):
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        # Under TRITON_INTERPRET=1 the kernel is an InterpretedFunction; the
        # JITFunction of the same source and options specialises as a launch.
        self.jit = (
            kernel if isinstance(kernel, JITFunction)
            else JITFunction(kernel.fn, **kernel.kwargs)
        )  # fmt: skip
        self.backends = backends
        self.caches = caches  # the KV caches' storages by data pointer
        self.keys = keys

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._record(args, kwargs)

    def warmup(self, *args, grid, **kwargs):
        self._record(args, kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        self._record(args, kwargs)

    def _arg(self, value):
        if isinstance(value, torch.Tensor) and (
            value.untyped_storage().data_ptr() in self.caches
        ):
            return _Big(value.dtype)
        return value

    def _record(self, args, kwargs) -> None:
        from compile_tier.worker import specialize

        names = self.jit.arg_names
        values = dict(zip(names, args))
        options = {}
        for name, value in kwargs.items():
            (values if name in names else options)[name] = value
        constexprs = {
            n: values[n] for n, p in zip(names, self.jit.params) if p.is_constexpr
        }
        spec = SimpleNamespace(
            args={n: self._arg(v) for n, v in values.items()}, constexprs=constexprs
        )
        for target, backend in self.backends.items():
            signature, consts, attrs = specialize(self.jit, spec, backend)
            self.keys.add(json.dumps([
                target, self.jit.fn.__name__, signature,
                {k: repr(v) for k, v in consts.items()},
                {str(k): repr(v) for k, v in attrs.items()}, sorted(options.items()),
            ], sort_keys=True, default=str))  # fmt: skip


def record(monkeypatch, kernels):
    """Replace each ``(module, name)`` kernel by a recorder for the test; the
    returned namespace's ``keys`` collects the compile keys (sm_90, gfx942) of
    every launch and warmup, ``add_cache(tensor)`` registers a tensor that
    stands for the KV cache pool. The registry holds the tensor's storage: a
    freed cache's address, reused by a later allocation (an output, a
    partial), would otherwise make that tensor count as > 2 GiB too."""
    from compile_tier.targets import TARGETS
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    targets = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": TARGETS["gfx942"].gpu_target()}
    backends = {name: type(make_backend(t)) for name, t in targets.items()}
    keys: set[str] = set()
    caches: dict[int, torch.UntypedStorage] = {}
    for module, name in kernels:
        recorder = _Recorder(getattr(module, name), backends, caches, keys)
        monkeypatch.setattr(module, name, recorder)

    def add_cache(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        caches[storage.data_ptr()] = storage

    return SimpleNamespace(keys=keys, add_cache=add_cache)


def explain(new: set[str], warm: set[str]) -> str:
    """What the first new key differs in from the closest warmed-up key."""
    key = json.loads(sorted(new)[0])
    same = [json.loads(w) for w in warm]
    same = [w for w in same if w[:2] == key[:2]]

    def diff(w):
        out = []
        for i, part in enumerate(key[2:5]):
            for name in sorted(set(part) | set(w[2 + i])):
                if part.get(name) != w[2 + i].get(name):
                    out.append(f"{name}: {part.get(name)} (warm: {w[2 + i].get(name)})")
        if key[5] != w[5]:
            out.append(f"options {key[5]} (warm: {w[5]})")
        return out

    closest = min((diff(w) for w in same), key=len, default=["no warm key"])
    return f"{len(new)} new keys; {key[0]} {key[1]} differs in {closest}"
