# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Nothing compiles mid-serving: after warmup, a 240-step random trace of the
series' kernels (decode-only, mixed, short extends on the paged route, long
extends on the gather route, MLA decode + prefill; bf16 and fp8 caches;
request counts 0-300, token counts 1-2047, context lengths 1-1024) launches no
variant the warmup did not compile.

CPU tier: every kernel is replaced by a recorder that computes, for each
launch, the key Triton's JIT compiles under -- the compile tier's own
specialisation (``scripts/compile_tier/worker.specialize``: signature,
constexprs and attributes by ``native_specialize_impl`` of a real backend,
honouring ``do_not_specialize``) plus the options -- for the sm_90 and gfx942
backends (the KV cache pointers count as storage > 2 GiB there, as in an
engine).  GPU tier: real compiles counted with Triton's
``jit_post_compile_hook`` while the trace replays.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.ops import triton_fetch_kv as fk
from vllm.v1.attention.ops import triton_fetch_kv_warmup as fkw
from vllm.v1.attention.ops import triton_launcher
from vllm.v1.attention.ops import triton_mla_rope_cache as mla
from vllm.v1.attention.ops import triton_mla_rope_cache_warmup as mlaw
from vllm.v1.attention.ops import triton_paged_context_attention as pc

import serving_trace  # tests/kernels, on sys.path as the test's folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

NUM_STEPS = 240
CACHE_DTYPES = (None, torch.float8_e4m3fn)  # None: the model dtype, bf16
KERNELS = (
    (fk, "_fetch_kv_kernel"),
    (fk, "_fetch_kv_plan_kernel"),
    (pc, "_paged_context_attention_kernel"),
    (pc, "_combine_splits_kernel"),
    (mla, "_mla_rope_cache_kernel"),
)


def _warm_up(engine: serving_trace.Engine) -> None:
    for case in fkw.warmup_cases(engine.fetch_geometry):
        fkw.compile_case(engine.fetch_geometry, case, engine.device)
    for case in mlaw.warmup_cases(engine.mla_geometry):
        mlaw.compile_case(engine.mla_geometry, case, engine.device)


def _replay(engine: serving_trace.Engine, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    kinds: dict[str, int] = {}
    for _ in range(NUM_STEPS):
        kind = engine.step(rng)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# ---------------------------------------------------------------- CPU tier


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
        self.caches = caches  # storage data pointers of the KV caches
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


@pytest.fixture
def record_keys(monkeypatch):
    from compile_tier.targets import TARGETS
    from triton.compiler import make_backend

    backends = {
        name: type(make_backend(TARGETS[name].gpu_target()))
        for name in ("sm_90", "gfx942")
    }
    keys: set[str] = set()
    caches: set[int] = set()
    for module, name in KERNELS:
        recorder = _Recorder(getattr(module, name), backends, caches, keys)
        monkeypatch.setattr(module, name, recorder)
    return SimpleNamespace(keys=keys, caches=caches)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
def test_trace_launches_only_warmed_up_keys(record_keys, cache_dtype):
    engine = serving_trace.Engine("cpu", cache_dtype)
    record_keys.caches.update(c.untyped_storage().data_ptr() for c in engine.caches)
    _warm_up(engine)
    warm = set(record_keys.keys)
    assert warm
    triton_launcher.clear_caches()
    kinds = _replay(engine, seed=25)
    assert set(kinds) == {"decode", "mixed", "short_extend", "long_extend"}
    new = record_keys.keys - warm
    assert not new, _explain(new, warm)


def test_trace_check_can_fail(record_keys, monkeypatch):
    """A constexpr that follows the batch outside the warmed-up buckets gives
    keys the warmup did not produce, and the check sees them."""
    engine = serving_trace.Engine("cpu")
    _warm_up(engine)
    warm = set(record_keys.keys)
    monkeypatch.setattr(fk, "_req_step", lambda n: 16 if n < 8 else 32)
    triton_launcher.clear_caches()
    _replay(engine, seed=1)
    assert any("_fetch_kv" in key for key in record_keys.keys - warm)


def _explain(new: set[str], warm: set[str]) -> str:
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


# ---------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
def test_trace_compiles_nothing_after_warmup_gpu(cache_dtype):
    import triton

    compiled: list[str] = []

    def hook(*args, **kwargs):  # Triton calls it after every JIT compile
        compiled.append(kwargs.get("repr", "?"))

    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = hook
    try:
        engine = serving_trace.Engine("cuda", cache_dtype)
        _warm_up(engine)
        torch.accelerator.synchronize()
        warm = len(compiled)
        triton_launcher.clear_caches()
        _replay(engine, seed=25)
        torch.accelerator.synchronize()
    finally:
        knobs.jit_post_compile_hook = previous
    assert warm > 0
    assert compiled[warm:] == [], f"compiled after warmup: {compiled[warm:]}"
