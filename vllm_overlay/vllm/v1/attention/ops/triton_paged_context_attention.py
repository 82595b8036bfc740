# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Attention of extend queries to their cached context, read from the paged cache.

An *extend* has ``context_len`` cached tokens and ``query_len`` new ones this
step (a chunked-prefill chunk or a prefix-cache hit).
``paged_context_attention`` attends the new tokens to the cached context
straight from the paged cache and returns the output with its log-sum-exp
(natural log, ``-inf`` for a token that sees nothing, as
``merge_attn_states`` expects).  Given the new tokens' own ``key`` /
``value`` it also attends each new token causally to its request's new tokens
(from those tensors), so the output is the whole extend attention.  With a
sliding window of ``W`` tokens, the token at position ``p`` sees positions
``> p - W``.

Layouts (``T`` new tokens, ``Hq`` / ``Hkv`` heads, ``D`` head size, ``B``
requests): ``query`` ``[T, Hq, D]``; ``key_cache`` / ``value_cache``
``[num_blocks, block_size, Hkv, D]`` views (vLLM's packed cache split into K
and V), the query dtype or fp8 with per-tensor ``k_scale`` / ``v_scale``;
``key`` / ``value`` ``[T, Hkv, D]``; ``block_table`` ``[>= B, max_blocks]``;
``cu_seqlens_q`` ``[B + 1]``; ``seq_lens`` ``[B]`` (context + new tokens);
``out`` ``[T, Hq, D]``; ``lse`` ``[Hq, T]`` float32.  Last dims contiguous.

Design: flash-attention forward, one program per ``BLOCK_Q`` new tokens of
one request times the query heads of one kv head (GQA), walking the context
in ``BLOCK_N``-token tiles through the block table, with an online softmax
that rescales lazily (``_RESCALE_SLACK``).  Tiles are numbered in closed form
(request ``b`` owns tiles from ``cu_seqlens_q[b] // BLOCK_Q + b``; a binary
search finds it): no host synchronisation.  When the tiles cannot fill the
GPU, the key range is split across programs and a second kernel combines
their fp32 partials.  Offsets of block ids and tokens are 64-bit.
"""

import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.utils.platform_utils import num_compute_units
from vllm.v1.attention.ops.triton_launch import KernelCall

__all__ = [
    "PagedContextWorkspace",
    "paged_context_attention",
    "paged_context_workspace",
    "paged_context_workspace_size",
    "use_paged_context",
]

# Tile (query rows = tokens x heads of a GQA group, context tokens per
# iteration, warps, stages): the best worst case of the H200 sweeps
# (benchmarks/notes/paged_context.md).  D > 128: half the context tile, twice
# the warps.
_BLOCK_M = 128
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2
_BLOCK_N_LARGE_D = 32
_NUM_WARPS_LARGE_D = 8
# Split the context when fewer than this many programs per SM have work, into
# at most _MAX_SPLITS splits of at least _MIN_TOKENS_PER_SPLIT context tokens.
_PROGRAMS_PER_SM = 2
_MIN_TOKENS_PER_SPLIT = 1024
_MAX_SPLITS = 16
# Heads per program of the split-combining kernel.
_COMBINE_BLOCK_H = 16
# fp32 queries (exact FMA dots) use smaller tiles.
_FP32_BLOCK_M = 64
_FP32_BLOCK_N = 32
# CDNA (gfx942 / gfx950): (block_m, block_n, warps, stages) for D <= 128 and
# D > 128, from the AMD compile tier's facts (no spill, two waves per SIMD).
_CDNA_TILES = {False: (128, 32, 8, 1), True: (128, 16, 8, 1)}
# Interpreter (CPU) launches.
_INTERP_BLOCK_M = 16
_INTERP_BLOCK_N = 16

_LOG2E = 1.4426950408889634
# Lazy rescaling slack in log2 units (0: rescale on every context tile).
_RESCALE_SLACK = 8.0
# Running max of a row that has seen no score (finite: no NaNs).
_NO_SCORE = tl.constexpr(-1.0e30)

_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = frozenset((torch.int32, torch.int64))


@triton.jit
def _find_request(cu_seqlens_q_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """Largest ``b`` with ``cu_seqlens_q[b] // BLOCK_Q + b <= tile``."""
    lo: tl.int32 = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # fp32 operands: exact products (no tf32); 16-bit operands: the target's
    # default tensor-core path.
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    block_row_ptr,
    row_base,
    tile_start,
    limit,
    pos_base,
    q_pos,
    k_head_off,
    v_head_off,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    window_left,
    offs_n,
    offs_d,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGED: tl.constexpr,
    TAIL: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with one tile of keys/values.

    Keys ``pos = tile_start + offs_n`` index either the paged cache (``PAGED``:
    position ``pos`` of the request whose block-table row is ``block_row_ptr``)
    or a contiguous ``[tokens, Hkv, D]`` tensor (row ``row_base + pos``); their
    absolute positions are ``pos_base + pos``.  ``TAIL``: the tile crosses
    ``limit`` (mask keys at or past it); ``CAUSAL``: a row sees keys at or
    before its own position ``q_pos``.
    """
    pos = tile_start + offs_n
    if PAGED:
        if TAIL:
            in_range = pos < limit
            block = tl.load(block_row_ptr + pos // PAGE_SIZE, mask=in_range, other=0)
        else:
            block = tl.load(block_row_ptr + pos // PAGE_SIZE)
        slot = (pos % PAGE_SIZE).to(tl.int64)
        k_rows = block.to(tl.int64) * stride_kb + slot * stride_kt + k_head_off
        v_rows = block.to(tl.int64) * stride_vb + slot * stride_vt + v_head_off
    else:
        if TAIL:
            in_range = pos < limit
        row = row_base + pos.to(tl.int64)
        k_rows = row * stride_kt + k_head_off
        v_rows = row * stride_vt + v_head_off
    # K is loaded like V, [N, D] rows, and transposed in registers: on the
    # H200 as fast as or up to 10% faster than a [D, N] pointer load.
    k_ptrs = k_ptr + k_rows[:, None] + offs_d[None, :]  # [N, D]
    v_ptrs = v_ptr + v_rows[:, None] + offs_d[None, :]  # [N, D]
    if TAIL:
        if HEAD_DIM_PAD != HEAD_DIM:
            kv_mask = in_range[:, None] & (offs_d < HEAD_DIM)[None, :]
        else:
            kv_mask = in_range[:, None]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM_PAD != HEAD_DIM:
        kv_mask = (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
        k = tl.load(k_ptrs)
    k = tl.trans(k)  # [D, N]

    # Raw scores; the softmax scale (log2 units) is applied inside the exp2
    # argument, where it fuses with the max subtraction into one FMA.
    s = _dot(q, k.to(q.dtype), tl.zeros([q.shape[0], k.shape[1]], tl.float32), DOT_IEEE)
    if TAIL:
        s = tl.where(in_range[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(pos_base + pos[None, :] <= q_pos[:, None], s, float("-inf"))
    if USE_WINDOW:
        s = tl.where(
            pos_base + pos[None, :] >= q_pos[:, None] - window_left, s, float("-inf")
        )

    m_tile = tl.max(s, axis=1) * qk_scale
    if RESCALE_SLACK > 0:
        # Lazy rescaling: keep a row's running max until the tile's max exceeds
        # it by more than RESCALE_SLACK (log2 units), so p <= 2**RESCALE_SLACK
        # (exact in every dtype used) and, once the maxima settle, the
        # [BLOCK_M, D] accumulator is not rescaled at all.
        m_new = tl.where(m_tile > m_i + RESCALE_SLACK, m_tile, m_i)
    else:
        m_new = tl.maximum(m_i, m_tile)
    # m_i starts at a finite _NO_SCORE, so a fully masked row gives
    # exp2(-inf) = 0 here, never NaN.
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if RESCALE_SLACK > 0:
        if tl.max(m_new - m_i, axis=0) > 0:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    acc = _dot(p.to(q.dtype), v.to(q.dtype), acc, DOT_IEEE)
    return acc, l_i, m_new


@triton.jit
def _attend_range(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    block_row_ptr,
    row_base,
    t_begin,
    t_end,
    limit,
    pos_base,
    q_pos,
    k_head_off,
    v_head_off,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    window_left,
    offs_n,
    offs_d,
    full_end,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
):
    """Key tiles ``[t_begin, t_end)``: those below ``full_end`` need no mask
    but the window's; the rest are masked at ``limit`` (and causally)."""
    for t in range(t_begin, tl.minimum(t_end, full_end)):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q,
            k_ptr,
            v_ptr,
            block_row_ptr,
            row_base,
            t * BLOCK_N,
            limit,
            pos_base,
            q_pos,
            k_head_off,
            v_head_off,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            qk_scale,
            window_left,
            offs_n,
            offs_d,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            PAGED,
            False,
            False,
            USE_WINDOW,
            DOT_IEEE,
            RESCALE_SLACK,
        )
    for t in range(tl.maximum(t_begin, full_end), t_end):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q,
            k_ptr,
            v_ptr,
            block_row_ptr,
            row_base,
            t * BLOCK_N,
            limit,
            pos_base,
            q_pos,
            k_head_off,
            v_head_off,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            qk_scale,
            window_left,
            offs_n,
            offs_d,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            PAGED,
            True,
            CAUSAL,
            USE_WINDOW,
            DOT_IEEE,
            RESCALE_SLACK,
        )
    return acc, l_i, m_i


@triton.jit(
    do_not_specialize=[
        "num_reqs",
        "num_splits",
        "stride_bt",
        "stride_os",
        "stride_ls",
        "stride_lh",
    ],
    do_not_specialize_on_alignment=[
        "block_table_ptr",
        "cu_seqlens_q_ptr",
        "seq_lens_ptr",
        "k_scale_ptr",
        "v_scale_ptr",
    ],
)
def _paged_context_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, bs, Hkv, D] (strided view)
    v_cache_ptr,  # [num_blocks, bs, Hkv, D] (strided view)
    k_new_ptr,  # [T, Hkv, D] new tokens' keys (read only WITH_NEW)
    v_new_ptr,  # [T, Hkv, D] new tokens' values (read only WITH_NEW)
    block_table_ptr,  # [B, max_blocks]
    cu_seqlens_q_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    k_scale_ptr,  # [1] float32 (read only for fp8 caches)
    v_scale_ptr,  # [1] float32 (read only for fp8 caches)
    out_ptr,  # [T, Hq, D] final, or [S, T, Hq, D] fp32 partials
    lse_ptr,  # [Hq, T] final, or [S, Hq, T] fp32 partials
    num_reqs,
    num_splits,
    qk_scale_log2,  # softmax scale * log2(e)
    window_left,  # a token at p sees context k >= p - window_left
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_bt,
    stride_os,
    stride_otok,
    stride_oh,
    stride_ls,
    stride_lh,
    stride_lt,
    GROUP: tl.constexpr,  # Hq // Hkv
    GROUP_PAD: tl.constexpr,  # next power of two of GROUP
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD query rows
    BLOCK_N: tl.constexpr,  # context tokens per iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    FP8: tl.constexpr,
    WITH_NEW: tl.constexpr,  # also attend causally to the request's new tokens
    DOT_IEEE: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,  # 0: rescale every tile (classic online softmax)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(cu_seqlens_q_ptr, num_reqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + req).to(tl.int32)
    q_end = tl.load(cu_seqlens_q_ptr + req + 1).to(tl.int32)
    query_len = q_end - q_begin
    first_local = (tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if first_local >= query_len:
        return  # idle tile between two requests' tile ranges
    context_len = tl.load(seq_lens_ptr + req).to(tl.int32) - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    local = first_local + offs_m // GROUP_PAD  # token index within the request
    head_in_group = offs_m % GROUP_PAD
    row_ok = (local < query_len) & (head_in_group < GROUP)
    token = (q_begin + local).to(tl.int64)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + local  # absolute position of each row's token

    q_ptrs = (
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    )
    if HEAD_DIM_PAD != HEAD_DIM:
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    else:
        q_mask = row_ok[:, None]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    qk_scale = qk_scale_log2
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # Key tiles this program's rows need: the context from the window start
    # of its earliest token on (or all of it), then -- WITH_NEW -- the
    # request's new tokens up to its last row's token; whole BLOCK_N tiles,
    # aligned.  The splits share out the context tiles followed by the new
    # ones, evenly, so no split also carries all of the new tokens.
    ctx_lo = 0
    if USE_WINDOW:
        ctx_lo = tl.maximum(context_len + first_local - window_left, 0)
    tile_lo = ctx_lo // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    ctx_tiles = tl.maximum(num_tiles - tile_lo, 0)
    new_tile_lo = 0
    new_tiles = 0
    new_end = 0
    if WITH_NEW:
        new_lo = 0
        if USE_WINDOW:
            new_lo = tl.maximum(first_local - window_left, 0)
        new_tile_lo = new_lo // BLOCK_N
        new_end = tl.minimum(first_local + BLOCK_Q, query_len)
        new_tiles = tl.cdiv(new_end, BLOCK_N) - new_tile_lo
    per_split = tl.cdiv(ctx_tiles + new_tiles, num_splits)
    v_begin = split * per_split
    v_end = tl.minimum(v_begin + per_split, ctx_tiles + new_tiles)
    t_begin = tile_lo + v_begin
    t_end = tile_lo + tl.minimum(v_end, ctx_tiles)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NO_SCORE, dtype=tl.float32)

    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_range(
        acc,
        l_i,
        m_i,
        q,
        k_cache_ptr,
        v_cache_ptr,
        block_row_ptr,
        0,
        t_begin,
        t_end,
        context_len,
        0,
        q_pos,
        kv_head.to(tl.int64) * stride_kh,
        kv_head.to(tl.int64) * stride_vh,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        qk_scale,
        window_left,
        offs_n,
        offs_d,
        context_len // BLOCK_N,
        BLOCK_N,
        PAGE_SIZE,
        HEAD_DIM,
        HEAD_DIM_PAD,
        True,
        False,
        USE_WINDOW,
        DOT_IEEE,
        RESCALE_SLACK,
    )
    if FP8:
        # Dequantise the context's values here (once, not per tile); new-token
        # values below are already real values.
        acc = acc * tl.load(v_scale_ptr)

    if WITH_NEW:
        # This split's share of the request's new tokens, causally (keys up to
        # the last row's token; tiles wholly at or before the first row's
        # token need no causal mask).  Read from the step's key/value tensors,
        # never from the cache: no dependence on the cache write, no fp8
        # rounding.
        acc, l_i, m_i = _attend_range(
            acc,
            l_i,
            m_i,
            q,
            k_new_ptr,
            v_new_ptr,
            block_row_ptr,
            q_begin.to(tl.int64),
            new_tile_lo + tl.maximum(v_begin - ctx_tiles, 0),
            new_tile_lo + tl.maximum(v_end - ctx_tiles, 0),
            new_end,
            context_len,
            q_pos,
            kv_head.to(tl.int64) * stride_knh,
            kv_head.to(tl.int64) * stride_vnh,
            0,
            stride_knt,
            0,
            stride_vnt,
            qk_scale_log2,
            window_left,
            offs_n,
            offs_d,
            (first_local + 1) // BLOCK_N,
            BLOCK_N,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            False,
            True,
            USE_WINDOW,
            DOT_IEEE,
            RESCALE_SLACK,
        )

    seen = l_i > 0.0
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    out = acc * inv_l[:, None]
    lse = tl.where(
        seen,
        (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
        float("-inf"),
    )

    split64 = split.to(tl.int64)
    o_ptrs = (
        out_ptr
        + split64 * stride_os
        + token[:, None] * stride_otok
        + head[:, None] * stride_oh
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    l_ptrs = (
        lse_ptr
        + split64 * stride_ls
        + head.to(tl.int64) * stride_lh
        + token * stride_lt
    )
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit(
    do_not_specialize=[
        "num_reqs",
        "num_splits",
        "stride_ps",
        "stride_pls",
        "stride_plh",
        "stride_lh",
    ],
    do_not_specialize_on_alignment=["cu_seqlens_q_ptr"],
)
def _combine_splits_kernel(
    part_out_ptr,  # [S, T, Hq, D] fp32
    part_lse_ptr,  # [S, Hq, T] fp32
    out_ptr,  # [T, Hq, D]
    lse_ptr,  # [Hq, T]
    cu_seqlens_q_ptr,  # [B + 1]
    num_reqs,
    num_splits,
    num_heads,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pls,
    stride_plh,
    stride_plt,
    stride_otok,
    stride_oh,
    stride_lh,
    stride_lt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per token and BLOCK_H heads: a few hundred programs that
    # each move [BLOCK_H, D] rows, not one tiny program per (token, head).
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(cu_seqlens_q_ptr + num_reqs):
        return  # padding past the last request: no partials were written
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < num_heads
    hd_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    lse_ptrs = part_lse_ptr + offs_h.to(tl.int64) * stride_plh + token * stride_plt
    part_ptrs = (
        part_out_ptr
        + token * stride_pt
        + offs_h.to(tl.int64)[:, None] * stride_ph
        + offs_d[None, :]
    )

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(lse_ptrs + s * stride_pls, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, lse_s)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(lse_ptrs + s * stride_pls, mask=h_ok, other=float("-inf"))
        w = tl.exp(lse_s - m_shift)  # 0 for empty splits
        total += w
        part = tl.load(part_ptrs + s * stride_ps, mask=hd_ok, other=0.0)
        acc += part * w[:, None]
    seen = total > 0.0
    merged = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(
        out_ptr
        + token * stride_otok
        + offs_h.to(tl.int64)[:, None] * stride_oh
        + offs_d[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=hd_ok,
    )
    lse = tl.where(seen, m_shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(
        lse_ptr + offs_h.to(tl.int64) * stride_lh + token * stride_lt, lse, mask=h_ok
    )


@dataclass(frozen=True)
class _Tile:
    """A launch configuration of ``_paged_context_attention_kernel``."""

    block_m: int  # query rows per program: block_q tokens x GROUP_PAD heads
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


def _tile_config(target, head_size: int, group: int, dtype: torch.dtype) -> _Tile:
    """The tile for a Triton ``GPUTarget`` (None: the interpreter), head size,
    GQA group and query dtype; the AMD compile tier calls it too."""
    large_d = next_power_of_2(head_size) > 128
    warps = _NUM_WARPS_LARGE_D if large_d else _NUM_WARPS
    stages = _NUM_STAGES
    if target is None:
        block_m, block_n = _INTERP_BLOCK_M, _INTERP_BLOCK_N
    elif dtype == torch.float32:
        block_m, block_n = _FP32_BLOCK_M, _FP32_BLOCK_N
    elif target.backend == "hip":
        block_m, block_n, warps, stages = _CDNA_TILES[large_d]
    else:
        block_m = _BLOCK_M
        block_n = _BLOCK_N_LARGE_D if large_d else _BLOCK_N
    group_pad = next_power_of_2(group)
    block_m = max(block_m, group_pad)
    return _Tile(block_m, block_m // group_pad, block_n, warps, stages)


class _CombineTile(NamedTuple):
    """A launch configuration of ``_combine_splits_kernel``."""

    block_h: int
    num_warps: int


def _combine_config(num_heads: int) -> _CombineTile:
    return _CombineTile(
        block_h=min(next_power_of_2(num_heads), _COMBINE_BLOCK_H),
        num_warps=_NUM_WARPS,
    )


@functools.cache
def _gpu_target():
    return triton.runtime.driver.active.get_current_target()


def _split_count(num_tokens, num_reqs, num_kv_heads, tile, device, max_context, splits):
    """Context splits per query tile: ``splits``, or enough programs to fill
    the device (one under the interpreter), at most one per
    _MIN_TOKENS_PER_SPLIT of context."""
    if splits is not None:
        return splits
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    base = (num_tokens // tile.block_q + num_reqs) * num_kv_heads
    want = cdiv(_PROGRAMS_PER_SM * num_compute_units(device.index or 0), base)
    cap = _MAX_SPLITS
    if max_context is not None:
        cap = min(cap, max(1, max_context // _MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap))


@dataclass
class PagedContextWorkspace:
    """One step's ``paged_context_attention`` work, built once per step by
    ``paged_context_workspace`` (the AITER FA metadata builder) and passed to
    every layer's call.

    The request metadata (checked), the sizes and query dtype every layer's
    tensors are checked against, the tile and split count that fix the grid,
    and the buffers: ``lse`` ``[Hq, T]`` and, with ``num_splits > 1``,
    ``partial_out`` ``[S, T, Hq, D]`` and ``partial_lse`` ``[S, Hq, T]``
    (float32, contiguous).  ``calls``: the launches of each layer geometry
    (strides, dtypes, scale, window) met in this step.
    """

    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    num_tokens: int
    num_reqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    tile: _Tile
    num_splits: int
    lse: torch.Tensor
    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None
    calls: dict[tuple, "_LayerCalls"] = field(default_factory=dict, repr=False)


@dataclass
class _LayerCalls:
    """The launches of one layer geometry of a step (None: nothing to do)."""

    attend: KernelCall | None
    combine: KernelCall | None  # None: one split, the attend kernel writes out
    fp8: bool  # an fp8 cache: the kernel reads the scales


def paged_context_workspace(
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> PagedContextWorkspace:
    """Check one step's request metadata and fix what its
    ``paged_context_attention`` calls share: ``num_tokens`` queries of
    ``num_heads`` heads (``dtype``), the split count (``max_context_len`` /
    ``num_splits`` as for ``paged_context_attention``) and the buffers.

    ``buffers``: three 1-D float32 tensors of at least
    ``paged_context_workspace_size(...)`` elements (persistent), of which the
    workspace is views; else they are allocated.  Never reads device values.
    """
    fn = "paged_context_workspace"
    if dtype not in _QUERY_DTYPES:
        raise TypeError(f"{fn}: the query dtype must be fp16, bf16 or fp32")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{fn}: Hq must be a multiple of Hkv")
    if not 16 <= head_size <= 256:
        raise ValueError(f"{fn}: head size must be in [16, 256]")
    if max_context_len is not None and max_context_len < 0:
        raise ValueError(f"{fn}: max_context_len must be >= 0")
    if num_splits is not None and not 1 <= num_splits <= 256:
        raise ValueError(f"{fn}: num_splits must be in [1, 256]")
    if not {block_table.dtype, cu_seqlens_q.dtype, seq_lens.dtype} <= _INDEX_DTYPES:
        raise TypeError(f"{fn}: the request metadata must be int32 or int64")
    (num_reqs,) = seq_lens.shape
    assert cu_seqlens_q.shape == (num_reqs + 1,), f"{fn}: cu_seqlens_q length"
    assert block_table.dim() == 2, f"{fn}: block_table must be 2-D"
    assert block_table.shape[0] >= num_reqs, f"{fn}: block_table has too few rows"
    assert block_table.stride(1) == 1, f"{fn}: block_table rows must be dense"
    assert cu_seqlens_q.stride() == seq_lens.stride() == (1,), f"{fn}: metadata"
    device = seq_lens.device
    if not block_table.device == cu_seqlens_q.device == device:
        raise ValueError(f"{fn}: the request metadata must be on {device}")

    target = _gpu_target() if device.type == "cuda" else None
    tile = _tile_config(target, head_size, num_heads // num_kv_heads, dtype)
    splits = _split_count(
        num_tokens, num_reqs, num_kv_heads, tile, device, max_context_len, num_splits
    )
    lse_shape = (num_heads, num_tokens)
    part_out_shape = (splits, num_tokens, num_heads, head_size)
    part_lse_shape = (splits, num_heads, num_tokens)
    if buffers is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        partial_out = partial_lse = None
        if splits > 1:
            partial_out = torch.empty(
                part_out_shape, dtype=torch.float32, device=device
            )
            partial_lse = torch.empty(
                part_lse_shape, dtype=torch.float32, device=device
            )
    else:
        lse_buf, part_out_buf, part_lse_buf = buffers
        lse = _buffer_view(lse_buf, lse_shape, device, "lse")
        partial_out = partial_lse = None
        if splits > 1:
            partial_out = _buffer_view(
                part_out_buf, part_out_shape, device, "partial_out"
            )
            partial_lse = _buffer_view(
                part_lse_buf, part_lse_shape, device, "partial_lse"
            )
    return PagedContextWorkspace(
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        tile=tile,
        num_splits=splits,
        lse=lse,
        partial_out=partial_out,
        partial_lse=partial_lse,
    )


def _buffer_view(buf: torch.Tensor, shape: tuple, device, name: str) -> torch.Tensor:
    n = math.prod(shape)
    if (
        buf.dim() != 1
        or buf.dtype != torch.float32
        or buf.numel() < n
        or buf.device != device
    ):
        raise ValueError(
            f"paged_context_workspace: buffers: {name} must be a 1-D float32 "
            f"tensor of >= {n} elements on {device}"
        )
    return buf[:n].view(shape)


def paged_context_workspace_size(
    max_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[int, int, int]:
    """Float32 elements of the (lse, partial_out, partial_lse) buffers that
    hold every step of up to ``max_tokens`` tokens: ``Hq * T_max``, and for
    the partials the largest ``S * T`` over ``T <= T_max`` at one request (S
    only falls as requests are added) times ``Hq * D`` and ``Hq``.
    """
    device = torch.device(device)
    target = None if device.type != "cuda" else _gpu_target()
    tile = _tile_config(target, head_size, num_heads // num_kv_heads, dtype)
    rows = 0  # the largest S * T with S > 1
    for t in range(1, max_tokens + 1):
        splits = _split_count(t, 1, num_kv_heads, tile, device, None, None)
        if splits > 1:
            rows = max(rows, splits * t)
    return num_heads * max_tokens, rows * num_heads * head_size, rows * num_heads


def _layer_calls(
    ws,
    query,
    key_cache,
    value_cache,
    key,
    value,
    out,
    lse,
    seq_lens,
    num_splits,
    scale,
    window,
) -> _LayerCalls:
    """The launches of one layer geometry of ``ws``'s step, after checking
    the layer's tensors against the workspace (the step's first call of each
    geometry)."""
    fn = "paged_context_attention"
    if num_splits not in (None, ws.num_splits):
        raise ValueError(f"{fn}: num_splits differs from the workspace's")
    if seq_lens.shape != (ws.num_reqs,):
        raise ValueError(
            f"{fn}: a workspace for {ws.num_reqs} requests; the call has "
            f"{tuple(seq_lens.shape)} seq_lens"
        )
    num_tokens, num_heads, head_size = query.shape
    if (num_tokens, num_heads, head_size, key_cache.shape[2]) != (
        ws.num_tokens,
        ws.num_heads,
        ws.head_size,
        ws.num_kv_heads,
    ):
        raise ValueError(f"{fn}: the workspace was made for other shapes")
    if query.dtype != ws.dtype:
        raise TypeError(f"{fn}: the workspace was made for {ws.dtype} queries")
    for name, t in (("key", key), ("value", value)):
        assert t is None or t.shape == (num_tokens, ws.num_kv_heads, head_size), (
            f"{fn}: {name} shape"
        )
    if out.shape != query.shape:
        raise ValueError(f"{fn}: out must be like the query")
    if lse.shape != (num_heads, num_tokens):
        raise ValueError(f"{fn}: lse must be ({num_heads}, {num_tokens}) float32")
    q_dtype, cache_dtype = query.dtype, key_cache.dtype
    fp8 = cache_dtype in _FP8_DTYPES
    if value_cache.dtype != cache_dtype:
        raise TypeError(f"{fn}: the K and V caches must have one dtype")
    if cache_dtype != q_dtype and not (fp8 and q_dtype != torch.float32):
        raise TypeError(f"{fn}: the cache must be the query dtype or fp8 (16-bit q)")
    if window is not None and window < 1:
        raise ValueError(f"{fn}: sliding_window must be None or >= 1")
    assert value_cache.shape == key_cache.shape, f"{fn}: K/V cache shapes differ"
    assert key_cache.shape[3] == ws.head_size, f"{fn}: cache and query head sizes"
    assert query.stride(2) == key_cache.stride(3) == value_cache.stride(3) == 1, (
        f"{fn}: last dims must be contiguous"
    )
    if (key is None) != (value is None):
        raise TypeError(f"{fn}: key and value come together")
    if key is not None and value is not None:
        if key.dtype != q_dtype or value.dtype != q_dtype:
            raise TypeError(f"{fn}: key and value must have the query dtype")
        assert key.stride(2) == value.stride(2) == 1, f"{fn}: key / value last dims"
    if out.dtype != q_dtype or out.stride(2) != 1:
        raise ValueError(f"{fn}: out must be like the query")
    if lse.dtype != torch.float32:
        raise ValueError(f"{fn}: lse must be float32")
    device = ws.seq_lens.device
    tensors = [query, key_cache, value_cache, key, value, out, lse]
    if any(t is not None and t.device != device for t in tensors):
        raise ValueError(f"{fn}: every tensor must be on {device}")

    if ws.num_reqs == 0 or ws.num_tokens == 0:
        return _LayerCalls(attend=None, combine=None, fp8=fp8)
    tile = ws.tile
    group = ws.num_heads // ws.num_kv_heads
    head_dim_pad = next_power_of_2(ws.head_size)
    with_new = key is not None and value is not None
    split = ws.num_splits > 1
    # One split: the kernel writes out and lse; else the fp32 partials.
    part_out = ws.partial_out if split else out
    part_lse = ws.partial_lse if split else lse
    assert part_out is not None and part_lse is not None
    # The step's tensors are fixed for its layers, and so, with splits, are
    # the partials the kernel writes (with one split: the call's out, lse).
    step_tensors = dict(
        block_table_ptr=ws.block_table,
        cu_seqlens_q_ptr=ws.cu_seqlens_q,
        seq_lens_ptr=ws.seq_lens,
    )
    if split:
        step_tensors.update(out_ptr=part_out, lse_ptr=part_lse)
    attend = KernelCall(
        _paged_context_attention_kernel,
        (ws.num_tokens // tile.block_q + ws.num_reqs, ws.num_kv_heads, ws.num_splits),
        **step_tensors,
        num_reqs=ws.num_reqs,
        num_splits=ws.num_splits,
        qk_scale_log2=scale * _LOG2E,
        window_left=0 if window is None else window - 1,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_kb=key_cache.stride(0),
        stride_kt=key_cache.stride(1),
        stride_kh=key_cache.stride(2),
        stride_vb=value_cache.stride(0),
        stride_vt=value_cache.stride(1),
        stride_vh=value_cache.stride(2),
        stride_knt=key.stride(0) if with_new else 0,
        stride_knh=key.stride(1) if with_new else 0,
        stride_vnt=value.stride(0) if with_new else 0,
        stride_vnh=value.stride(1) if with_new else 0,
        stride_bt=ws.block_table.stride(0),
        stride_os=part_out.stride(0) if split else 0,
        stride_otok=part_out.stride(-3),
        stride_oh=part_out.stride(-2),
        stride_ls=part_lse.stride(0) if split else 0,
        stride_lh=part_lse.stride(-2),
        stride_lt=part_lse.stride(-1),
        GROUP=group,
        GROUP_PAD=next_power_of_2(group),
        BLOCK_Q=tile.block_q,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        HEAD_DIM=ws.head_size,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=key_cache.shape[1],
        USE_WINDOW=window is not None,
        FP8=fp8,
        WITH_NEW=with_new,
        DOT_IEEE=query.dtype == torch.float32,
        RESCALE_SLACK=_RESCALE_SLACK,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if not split:
        return _LayerCalls(attend=attend, combine=None, fp8=fp8)
    combine_tile = _combine_config(ws.num_heads)
    combine = KernelCall(
        _combine_splits_kernel,
        (ws.num_tokens, cdiv(ws.num_heads, combine_tile.block_h)),
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        cu_seqlens_q_ptr=ws.cu_seqlens_q,
        num_reqs=ws.num_reqs,
        num_splits=ws.num_splits,
        num_heads=ws.num_heads,
        stride_ps=part_out.stride(0),
        stride_pt=part_out.stride(1),
        stride_ph=part_out.stride(2),
        stride_pls=part_lse.stride(0),
        stride_plh=part_lse.stride(1),
        stride_plt=part_lse.stride(2),
        stride_otok=out.stride(0),
        stride_oh=out.stride(1),
        stride_lh=lse.stride(0),
        stride_lt=lse.stride(1),
        HEAD_DIM=ws.head_size,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_H=combine_tile.block_h,
        num_warps=combine_tile.num_warps,
    )
    return _LayerCalls(attend=attend, combine=combine, fp8=fp8)


def _scale_tensor(scale, query) -> torch.Tensor:
    """An fp8 cache's scale as a one-element float32 tensor (a float: one per
    call)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(
                "paged_context_attention: scales must be one-element float32"
            )
        return scale
    if scale is None:
        raise ValueError(
            "paged_context_attention: an fp8 cache needs k_scale and v_scale"
        )
    return query.new_full((1,), scale, dtype=torch.float32)


def paged_context_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    workspace: PagedContextWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend each new token of each extend to its cached context (and, with
    ``key`` / ``value``, causally to its request's new tokens); returns
    ``(out, lse)`` (layouts in the module docstring).

    ``scale``: softmax scale; ``sliding_window``: ``None`` or ``W >= 1``;
    ``k_scale`` / ``v_scale``: one-element float32 tensors or floats, needed
    for fp8 caches; ``max_context_len``: optional host bound on the context
    lengths (caps the split); ``num_splits``: force the split count.
    ``workspace``: ``paged_context_workspace`` of the step (built once for all
    its layers): the metadata arguments are then the workspace's and are not
    read again, the call uses its buffers and split count and checks only its
    own tensors against it.  Never reads device values on the host.
    """
    if workspace is None:
        num_tokens, num_heads, head_size = query.shape
        workspace = paged_context_workspace(
            block_table,
            cu_seqlens_q,
            seq_lens,
            num_tokens=num_tokens,
            num_heads=num_heads,
            num_kv_heads=key_cache.shape[2],
            head_size=head_size,
            dtype=query.dtype,
            max_context_len=max_context_len,
            num_splits=num_splits,
        )
    elif not isinstance(workspace, PagedContextWorkspace):
        raise TypeError(
            "paged_context_attention: workspace must be a paged_context_workspace"
        )
    ws = workspace
    if out is None:
        out = torch.empty_like(query)
    if lse is None:
        lse = ws.lse
    # This layer's tensors against the step's workspace: checked by the step's
    # first call of each geometry, which builds the launches the others reuse.
    geometry = (
        query.shape,
        query.stride(),
        key_cache.shape,
        key_cache.stride(),
        value_cache.shape,
        value_cache.stride(),
        None if key is None else (key.shape, key.stride(), key.dtype),
        None if value is None else (value.shape, value.stride(), value.dtype),
        out.shape,
        out.stride(),
        lse.shape,
        lse.stride(),
        query.dtype,
        key_cache.dtype,
        value_cache.dtype,
        out.dtype,
        lse.dtype,
        scale,
        sliding_window,
        num_splits,
    )
    calls = ws.calls.get(geometry)
    if calls is None:
        calls = _layer_calls(
            ws,
            query,
            key_cache,
            value_cache,
            key,
            value,
            out,
            lse,
            seq_lens,
            num_splits,
            scale,
            sliding_window,
        )
        ws.calls[geometry] = calls
    if calls.fp8:
        k_scale = _scale_tensor(k_scale, query)
        v_scale = _scale_tensor(v_scale, query)
    if calls.attend is None:
        return out, lse
    if calls.combine is None:  # one split: the kernel writes out and lse
        calls.attend(
            q_ptr=query,
            k_cache_ptr=key_cache,
            v_cache_ptr=value_cache,
            k_new_ptr=key,  # None: not read
            v_new_ptr=value,
            k_scale_ptr=k_scale if calls.fp8 else None,
            v_scale_ptr=v_scale if calls.fp8 else None,
            out_ptr=out,
            lse_ptr=lse,
        )
        return out, lse
    calls.attend(  # into the workspace's partials
        q_ptr=query,
        k_cache_ptr=key_cache,
        v_cache_ptr=value_cache,
        k_new_ptr=key,
        v_new_ptr=value,
        k_scale_ptr=k_scale if calls.fp8 else None,
        v_scale_ptr=v_scale if calls.fp8 else None,
    )
    calls.combine(out_ptr=out, lse_ptr=lse)
    return out, lse


def use_paged_context(extend_query_lens: torch.Tensor, max_tokens: int) -> bool:
    """Whether a step's extends take the paged route (the AITER FA backend's
    rule, once per step): they bring at most ``max_tokens`` new tokens in all
    (``max_tokens <= 0``: never).  The gain over gather + a dense varlen
    kernel is parallelism, which shrinks as the step's total grows
    (benchmarks/RESULTS.md); ``extend_query_lens`` is the host tensor of the
    extends' new-token counts.
    """
    if max_tokens <= 0 or extend_query_lens.numel() == 0:
        return False
    return int(extend_query_lens.sum()) <= max_tokens
