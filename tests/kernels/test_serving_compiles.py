# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Nothing compiles mid-serving: after warmup, a 240-step random trace of the
series' kernels (decode-only, mixed, short extends on the paged route, long
extends on the gather route, MLA decode + prefill; bf16 and fp8 caches;
request counts 0-300, token counts 1-2047, context lengths 1-1024) launches no
variant the warmup did not compile.

CPU tier: every kernel is replaced by a recorder that computes, for each
launch, the key Triton's JIT compiles under, for the sm_90 and gfx942 backends
(compile_keys.py: the compile tier's own specialisation).  GPU tier: real
compiles counted with Triton's ``jit_post_compile_hook`` while the trace
replays.
"""

from __future__ import annotations

import random

import pytest
import torch
from vllm.v1.attention.ops import triton_fetch_kv as fk
from vllm.v1.attention.ops import triton_fetch_kv_warmup as fkw
from vllm.v1.attention.ops import triton_mla_rope_cache as mla
from vllm.v1.attention.ops import triton_mla_rope_cache_warmup as mlaw
from vllm.v1.attention.ops import triton_paged_context_attention as pc

import compile_keys  # tests/kernels, on sys.path as the test's folder
import serving_trace

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


@pytest.fixture
def record_keys(monkeypatch):
    return compile_keys.record(monkeypatch, KERNELS)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
def test_trace_launches_only_warmed_up_keys(record_keys, cache_dtype):
    engine = serving_trace.Engine("cpu", cache_dtype)
    for cache in engine.caches:
        record_keys.add_cache(cache)
    _warm_up(engine)
    warm = set(record_keys.keys)
    assert warm
    kinds = _replay(engine, seed=25)
    assert set(kinds) == {"decode", "mixed", "short_extend", "long_extend"}
    new = record_keys.keys - warm
    assert not new, compile_keys.explain(new, warm)


def test_trace_check_can_fail(record_keys, monkeypatch):
    """A constexpr that follows the batch outside the warmed-up buckets gives
    keys the warmup did not produce, and the check sees them."""
    engine = serving_trace.Engine("cpu")
    _warm_up(engine)
    warm = set(record_keys.keys)
    monkeypatch.setattr(fk, "_req_step", lambda n: 16 if n < 8 else 32)
    _replay(engine, seed=1)
    assert any("_fetch_kv" in key for key in record_keys.keys - warm)


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
        _replay(engine, seed=25)
        torch.accelerator.synchronize()
    finally:
        knobs.jit_post_compile_hook = previous
    assert warm > 0
    assert compiled[warm:] == [], f"compiled after warmup: {compiled[warm:]}"
