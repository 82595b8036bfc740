# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every compile variant the AITER FA backend's fetch-kv kernels can launch.

A serving step launches ``fetch_kv`` / ``fetch_kv_plan`` (context gathers) and
``paged_context_attention`` (short extends) with per-step integers (request
and token counts, split counts, the LSE strides of the step's token count):
the kernels take them with ``do_not_specialize``, and request metadata
(slices at a per-step offset) with ``do_not_specialize_on_alignment``, so
they select no variant.  What remains is fixed by the engine's geometry
(``FetchKVGeometry``) except three choices that follow the batch:
``REQ_STEP`` (four values, ``_req_step``), whether a plan is read, and for
the paged route whether the context is split (a second kernel).

``warmup_cases(geometry)`` lists them; ``compile_case(geometry, case)``
compiles one without launching it: the wrapper's own checks build the launch
on tiny tensors of the engine's strides, and the kernel is compiled
(``JITFunction.warmup``) with pointer stand-ins that carry each tensor's dtype
and, for the KV cache, its storage size (the AMD backend specialises pointers
into storage of at most 2 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.ops import triton_fetch_kv as fk
from vllm.v1.attention.ops import triton_paged_context_attention as pc

__all__ = ["FetchKVGeometry", "compile_case", "warmup_cases"]

_BIG = 1 << 40  # "more than 2 GiB": a KV cache pool


@dataclass(frozen=True)
class FetchKVGeometry:
    """What one attention group's launches are fixed by.

    ``cache_strides``: strides of the ``[blocks, block_size, Hkv, D]`` K view
    the backend passes (V has the same); ``cache_bytes``: the byte size of the
    storage behind it (the KV cache pool).  ``out_dtype``: the extend
    workspace's dtype.  ``block_table_width``: the block table's row stride.
    ``paged_context``: whether short extends take the paged route.
    """

    block_size: int
    num_kv_heads: int
    num_heads: int
    head_size: int
    model_dtype: torch.dtype
    cache_dtype: torch.dtype
    out_dtype: torch.dtype
    cache_strides: tuple[int, int, int, int]
    block_table_width: int
    max_num_reqs: int
    kv_cache_layout: str = "NHD"
    paged_context: bool = False
    cache_bytes: int = _BIG
    index_dtype: torch.dtype = torch.int32


def _reqs_for(step: int) -> int:
    """A request count whose _req_step is ``step``."""
    return 1 if step == 16 else step // 4


def warmup_cases(g: FetchKVGeometry) -> list[tuple]:
    """The cases to compile: ``("fetch_kv", plan, req_step)``,
    ``("fetch_kv_plan", req_step)`` and ``("paged", split, with_new)``."""
    cases: list[tuple] = []
    steps = sorted({fk._req_step(n) for n in _sample_counts(g.max_num_reqs)})
    for step in steps:
        cases += [("fetch_kv", False, step), ("fetch_kv", True, step)]
        cases.append(("fetch_kv_plan", step))
    if g.paged_context:
        cases += [("paged", False, True), ("paged", True, True)]
    return cases


def _sample_counts(max_num_reqs: int) -> list[int]:
    # Request counts 1 .. max_num_reqs meet every _req_step value at one of
    # the bucket edges (or at max_num_reqs).
    counts = {1, max(1, max_num_reqs)}
    step = 16
    while step <= fk._MAX_REQ_STEP:
        counts.update((step - 1, step))
        step *= 4
    return sorted(n for n in counts if 1 <= n <= max(1, max_num_reqs))


class _Ptr:
    """A pointer argument for a compile-only launch: dtype, 16-byte aligned,
    and the byte size of its storage (``ptr_range``, read by the AMD backend)."""

    def __init__(self, t: torch.Tensor, nbytes: int | None = None):
        self.dtype = t.dtype
        self._bytes = t.untyped_storage().nbytes() if nbytes is None else nbytes

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:
        return self._bytes


def _compile(launch, tensors, sizes=None) -> None:
    """Compile ``launch`` for ``tensors`` without launching it; ``sizes``:
    storage bytes by argument index where the tensor stands in for a larger
    one (a KV cache)."""
    sizes = sizes or {}
    ptrs = [_Ptr(t, sizes.get(i)) for i, t in enumerate(tensors)]
    launch.kernel.warmup(
        *ptrs, *launch.scalars, **launch.constexprs, **launch.options, grid=launch.grid
    )


def _cache(g: FetchKVGeometry, device):
    shape = (1, g.block_size, g.num_kv_heads, g.head_size)
    k = torch.empty_strided(shape, g.cache_strides, dtype=g.cache_dtype, device=device)
    v = torch.empty_strided(shape, g.cache_strides, dtype=g.cache_dtype, device=device)
    return k, v


def compile_case(g: FetchKVGeometry, case: tuple, device) -> None:
    """Compile one case of ``warmup_cases(g)`` for ``device`` (no launch)."""
    kind = case[0]
    key_cache, value_cache = _cache(g, device)
    step = case[-1] if kind != "paged" else None
    num_reqs = _reqs_for(step) if step is not None else 1
    idx = dict(dtype=g.index_dtype, device=device)
    block_table = torch.zeros((num_reqs, g.block_table_width), **idx)
    cu = torch.zeros(num_reqs + 1, **idx)
    starts = torch.zeros(num_reqs, **idx)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    big = {0: g.cache_bytes, 1: g.cache_bytes}  # the caches
    num_tokens = 16
    if kind in ("fetch_kv", "fetch_kv_plan"):
        # Runs the plan kernel on the tiny tensors (compiling its variant).
        plan = fk.fetch_kv_plan(
            block_table, cu, starts, num_tokens=num_tokens, block_size=g.block_size,
            head_size=g.head_size, cache_dtype=g.cache_dtype, out_dtype=g.out_dtype,
            kv_cache_layout=g.kv_cache_layout,
        )  # fmt: skip
        if kind == "fetch_kv_plan":  # no cache pointer: the tiny launch is exact
            return
        out = torch.empty((num_tokens, g.num_kv_heads, g.head_size), dtype=g.out_dtype,
                          device=device)  # fmt: skip
        use_plan = case[1]
        launch, dequant = fk._bind_fetch_kv(
            key_cache, value_cache, out, out, block_table, cu, starts, scale, scale,
            g.kv_cache_layout, num_tokens, plan if use_plan else None,
        )  # fmt: skip
        unread = plan.table if use_plan else cu
        scales = (scale, scale) if dequant else (unread, unread)
        meta = (unread,) * 3 if use_plan else (block_table, cu, starts)
        _compile(
            launch, (key_cache, value_cache, out, out, *meta, unread, *scales), big
        )
        return
    _, split, with_new = case
    query = torch.empty((num_tokens, g.num_heads, g.head_size), dtype=g.model_dtype,
                        device=device)  # fmt: skip
    new = torch.empty((num_tokens, g.num_kv_heads, g.head_size), dtype=g.model_dtype,
                      device=device)  # fmt: skip
    seq_lens = torch.zeros(num_reqs, **idx)
    ws = pc.paged_context_workspace(
        num_tokens, num_reqs, g.num_heads, g.num_kv_heads, g.head_size, g.model_dtype,
        device, num_splits=2 if split else 1,
    )  # fmt: skip
    bound = pc._bind(
        query, key_cache, value_cache, block_table, cu, seq_lens, 1.0,
        new if with_new else None, new if with_new else None, None, scale, scale,
        query, ws.lse, None, None, ws,
    )  # fmt: skip
    scales = (scale, scale) if bound.fp8 else (seq_lens, seq_lens)
    kv_new = (new, new) if with_new else (key_cache, value_cache)
    head = (query, key_cache, value_cache, *kv_new, block_table, cu, seq_lens, *scales)
    big = {1: g.cache_bytes, 2: g.cache_bytes}  # the caches, after the query
    if bound.combine is None:
        _compile(bound.attend, (*head, query, ws.lse), big)
        return
    _compile(bound.attend, (*head, ws.partial_out, ws.partial_lse), big)
    _compile(bound.combine, (ws.partial_out, ws.partial_lse, query, ws.lse, cu))
