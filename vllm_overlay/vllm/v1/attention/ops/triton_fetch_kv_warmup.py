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
compiles one without launching it: the arguments the wrapper would launch
with, on tiny tensors of the engine's strides, go to
``triton_launcher.warmup`` (pointer stand-ins carrying each tensor's dtype
and, for the KV cache, its storage size: the AMD backend specialises pointers
into storage of at most 2 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.triton_utils import triton
from vllm.v1.attention.ops import triton_fetch_kv as fk
from vllm.v1.attention.ops import triton_paged_context_attention as pc
from vllm.v1.attention.ops.triton_launcher import warmup

__all__ = ["FetchKVGeometry", "compile_case", "warmup_cases"]


@dataclass(frozen=True)
class FetchKVGeometry:
    """What one attention group's launches are fixed by.

    ``cache_strides``: strides of the ``[blocks, block_size, Hkv, D]`` K view
    the backend passes (V has the same); ``cache_bytes``: the byte size of the
    storage behind it (the KV cache pool), None when not known yet (both
    pointer variants of the AMD backend are then compiled).  ``out_dtype``:
    the extend workspace's dtype.  ``paged_context``: whether short extends
    take the paged route.  (The block table's row stride is a runtime integer
    of every kernel: it selects nothing.)
    """

    block_size: int
    num_kv_heads: int
    num_heads: int
    head_size: int
    model_dtype: torch.dtype
    cache_dtype: torch.dtype
    out_dtype: torch.dtype
    cache_strides: tuple[int, int, int, int]
    max_num_reqs: int
    kv_cache_layout: str = "NHD"
    paged_context: bool = False
    cache_bytes: int | None = None
    index_dtype: torch.dtype = torch.int32


def warmup_cases(g: FetchKVGeometry) -> list[tuple]:
    """``("fetch_kv", plan, num_reqs)`` and ``("fetch_kv_plan", num_reqs)`` for
    one request count of each ``REQ_STEP`` up to ``g.max_num_reqs``, and
    ``("paged", split)`` when short extends take the paged route."""
    cases: list[tuple] = []
    steps: set[int] = set()
    num_reqs = 1
    while num_reqs <= max(1, g.max_num_reqs):
        step = fk._req_step(num_reqs)
        if step not in steps:
            steps.add(step)
            cases += [
                ("fetch_kv", False, num_reqs),
                ("fetch_kv", True, num_reqs),
                ("fetch_kv_plan", num_reqs),
            ]
        num_reqs = step  # the first count of the next step
    if g.paged_context:
        cases += [("paged", False), ("paged", True)]
    return cases


def compile_case(g: FetchKVGeometry, case: tuple, device) -> None:
    """Compile one case of ``warmup_cases(g)`` for ``device``.

    ``fetch_kv_plan`` has no cache pointer: it runs once on tiny tensors
    (compiling exactly its runtime variant); the cache readers are compiled
    without a launch."""
    kind = case[0]
    num_reqs = case[-1] if kind != "paged" else 1
    num_tokens = 16
    shape = (1, g.block_size, g.num_kv_heads, g.head_size)
    key_cache, value_cache = (
        torch.empty_strided(shape, g.cache_strides, dtype=g.cache_dtype, device=device)
        for _ in range(2)
    )
    idx = dict(dtype=g.index_dtype, device=device)
    block_table = torch.zeros((num_reqs, 4), **idx)
    cu = torch.zeros(num_reqs + 1, **idx)
    starts = torch.zeros(num_reqs, **idx)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    if kind != "paged":
        plan = fk.fetch_kv_plan(
            block_table,
            cu,
            starts,
            num_tokens=num_tokens,
            block_size=g.block_size,
            head_size=g.head_size,
            cache_dtype=g.cache_dtype,
            out_dtype=g.out_dtype,
            kv_cache_layout=g.kv_cache_layout,
        )
        if kind == "fetch_kv_plan":
            return
        out = torch.empty((num_tokens, *shape[2:]), dtype=g.out_dtype, device=device)
        _compile_fetch_kv(
            g, key_cache, out, (block_table, cu, starts), plan, case[1], scale
        )
        return
    # The backend's call: the new tokens' K/V given, the output given, the
    # step's workspace (split or not).
    query = torch.empty(
        (num_tokens, g.num_heads, g.head_size), dtype=g.model_dtype, device=device
    )
    new = torch.empty((num_tokens, *shape[2:]), dtype=g.model_dtype, device=device)
    seq_lens = torch.zeros(num_reqs, **idx)
    heads = (g.num_heads, g.num_kv_heads, g.head_size)
    splits = 2 if case[1] else 1
    ws = pc.paged_context_workspace(
        num_tokens, num_reqs, *heads, g.model_dtype, device, num_splits=splits
    )
    _compile_paged(g, query, key_cache, new, (block_table, cu, seq_lens), scale, ws)


def _compile_fetch_kv(g: FetchKVGeometry, cache, out, metadata, plan, use_plan, scale):
    """Compile ``fetch_kv``'s launch for this geometry: its arguments as the
    wrapper passes them (stand-ins included), the cache as ``g.cache_bytes``."""
    page, head_size = g.block_size, g.head_size
    sizes = (g.cache_dtype.itemsize, g.out_dtype.itemsize)
    shuffle = g.kv_cache_layout == "SHUFFLE"
    ppp = fk._pages_per_program(page, head_size, *sizes, shuffle)
    block_table, cu, starts = metadata
    if use_plan:
        meta: tuple = (plan.table,) * 4 + (0, 0, 0, 0)
    else:
        meta = (block_table, cu, starts, cu)
        meta += (*block_table.stride(), *cu.stride(), *starts.stride())
    dequant = g.cache_dtype != g.out_dtype
    scales = (scale, scale) if dequant else meta[3:4] * 2
    args: tuple = (
        cache,
        cache,
        out,
        out,
        *meta[:4],
        *scales,
        len(starts),
        g.num_kv_heads,
    )
    args += (
        *meta[4:],
        *g.cache_strides,
        *g.cache_strides,
        *out.stride(),
        *out.stride(),
    )
    warp_size = fk._gpu_warp_size() if out.is_cuda else 32
    warmup(
        fk._fetch_kv_kernel,
        (1,),
        *args,
        caches=(0, 1),
        cache_bytes=g.cache_bytes,
        HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size),
        PAGE=page,
        PAGES_PER_PROGRAM=ppp,
        SHUFFLE=shuffle,
        X=fk._VECTOR_BYTES // sizes[0] if shuffle else 1,
        DEQUANT=dequant,
        PLAN=use_plan,
        PLAN_WIDTH=fk._plan_width(ppp),
        PLAN_HEADER=fk._PLAN_HEADER,
        REQ_STEP=fk._req_step(len(starts)),
        num_warps=fk._num_warps(warp_size, ppp * page, head_size, *sizes),
    )


def _compile_paged(g: FetchKVGeometry, query, cache, new, metadata, scale, ws):
    """Compile ``paged_context_attention``'s launches for the backend's call
    (new tokens' K/V, ``out=query``, the workspace ``ws``), as the wrapper
    makes them (stand-ins included), the cache as ``g.cache_bytes``."""
    num_tokens, num_heads, head_size = query.shape
    block_table, cu, seq_lens = metadata
    fp8 = g.cache_dtype in pc._FP8_DTYPES
    scales = (scale, scale) if fp8 else (seq_lens, seq_lens)
    group = num_heads // g.num_kv_heads
    target = pc._gpu_target() if query.is_cuda else None
    tile = pc._tile_config(target, head_size, group, query.dtype)
    splits, lse = ws.num_splits, ws.lse
    if splits == 1:
        parts = (query, lse)
        part_strides = (0, *query.stride()[:2], 0, *lse.stride())
    else:
        parts = (ws.partial_out, ws.partial_lse)
        part_strides = (*ws.partial_out.stride()[:3], *ws.partial_lse.stride())
    args: tuple = (
        query,
        cache,
        cache,
        new,
        new,
        block_table,
        cu,
        seq_lens,
        *scales,
        *parts,
    )
    args += (len(seq_lens), splits, pc._LOG2E, 0, *query.stride()[:2])
    args += (*g.cache_strides[:3], *g.cache_strides[:3], *new.stride()[:2])
    args += (*new.stride()[:2], block_table.stride()[0], *part_strides)
    head_dim_pad = triton.next_power_of_2(head_size)
    warmup(
        pc._paged_context_attention_kernel,
        (1,),
        *args,
        caches=(1, 2),
        cache_bytes=g.cache_bytes,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=tile.block_q,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        HEAD_DIM=head_size,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=g.block_size,
        USE_WINDOW=False,
        FP8=fp8,
        WITH_NEW=True,
        DOT_IEEE=query.dtype == torch.float32,
        RESCALE_SLACK=pc._RESCALE_SLACK,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if splits > 1:
        block_h, warps = pc._combine_config(num_heads)
        args = (*parts, query, lse, cu, len(seq_lens), splits, num_heads, *part_strides)
        args += (*query.stride()[:2], *lse.stride())
        warmup(
            pc._combine_splits_kernel,
            (1,),
            *args,
            HEAD_DIM=head_size,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_H=block_h,
            num_warps=warps,
        )
