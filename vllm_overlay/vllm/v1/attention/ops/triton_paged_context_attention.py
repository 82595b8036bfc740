# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Attention of extend queries to their cached context, read from the paged cache.

An *extend* is a request that already has ``context_len`` tokens in the KV
cache and brings ``query_len`` new tokens this step (a chunked-prefill chunk or
a prefix-cache hit).  Its attention splits into two parts that a backend merges
with ``merge_attn_states``: the new tokens attending causally to each other,
and the new tokens attending to the cached context.  ``paged_context_attention``
computes the second part straight from the paged cache -- no gather into a
workspace -- and returns the output with its log-sum-exp.  Given the new
tokens' own ``key`` / ``value`` it computes the first part in the same pass,
so the output is the whole extend attention and nothing is merged afterwards.

Semantics, for request ``b`` and its ``i``-th new token (``i < query_len_b``):

  * absolute position ``p = context_len_b + i``;
  * it attends to context positions ``k`` in ``[0, context_len_b)`` -- all of
    them (the context precedes every new token, so no causal mask), or, with a
    sliding window of ``W`` tokens, those with ``p - k < W`` (vLLM's
    ``sliding_window`` int; the backend tuple ``(W - 1, 0)``);
  * with ``key`` / ``value``, it also attends to new tokens ``j <= i`` of its
    request (absolute positions ``context_len_b + j``; the window applies to
    them too), read from those tensors, never from the cache;
  * ``lse = log(sum_k exp(scale * q . k))`` (natural log, as
    ``merge_attn_states`` expects); a token that sees no context gets output 0
    and ``lse = -inf``, which the merge treats as "no prefix".

Layouts (``T`` = total new tokens, ``Hq`` / ``Hkv`` = query / kv heads,
``D`` = head_size, ``bs`` = block_size, ``B`` = number of requests):

  * ``query``: ``[T, Hq, D]``, requests back to back in ``cu_seqlens_q`` order;
    any token/head strides, last dim contiguous.
  * ``key_cache`` / ``value_cache``: ``[num_blocks, bs, Hkv, D]`` views with any
    strides (last dim contiguous).  vLLM 0.33.0's packed cache
    ``(num_blocks, Hkv, bs, 2 * D)`` is the common case:
    ``kv_cache.transpose(1, 2).split(D, dim=-1)`` gives K and V with strides
    ``(Hkv * bs * 2D, 2D, bs * 2D, 1)``.  fp16/bf16, or fp8 (e4m3fn, e4m3fnuz,
    e5m2, e5m2fnuz) with per-tensor ``k_scale`` / ``v_scale``: the stored value
    times the scale is the real value.
  * ``key`` / ``value`` (optional): ``[T, Hkv, D]`` in the query dtype, rows
    like ``query``'s; any token/head strides, last dim contiguous.
  * ``block_table``: ``[>= B, max_blocks]`` int32/int64; logical position ``k``
    of request ``b`` is slot ``k % bs`` of block ``block_table[b, k // bs]``.
  * ``cu_seqlens_q``: ``[B + 1]`` int32/int64, ``cu_seqlens_q[0] == 0``,
    ``cu_seqlens_q[B] <= T``.
  * ``seq_lens``: ``[B]`` int32/int64, context + new tokens per request (vLLM's
    ``seq_lens``); ``context_len_b = seq_lens[b] - query_len_b``.  Positions at
    or after ``context_len_b`` are never read, so it does not matter whether
    the new tokens are already in the cache.
  * outputs: ``out`` ``[T, Hq, D]`` in the query dtype and ``lse`` ``[Hq, T]``
    float32 (any strides; ``merge_attn_states``'s layout).  Rows of tokens at
    or after ``cu_seqlens_q[B]`` are not written.

Design (flash-attention forward, one program per tile):
  * A program owns ``BLOCK_Q`` consecutive new tokens of one request times the
    ``Hq / Hkv`` query heads that share one kv head (GQA): ``BLOCK_M = BLOCK_Q *
    GROUP_PAD`` query rows, row ``r`` = token ``r // GROUP_PAD``, head ``r %
    GROUP_PAD`` of the group.  Each K/V tile is loaded once for the whole group.
  * It walks the context in ``BLOCK_N``-token tiles, looking up each token's
    block in the block table (so ``BLOCK_N`` need not equal the page size), with
    ``tl.dot`` for ``Q K^T`` and ``P V``, an fp32 accumulator and an online
    softmax in base 2 that rescales lazily: a row's running max is replaced
    only when a tile's max exceeds it by more than ``_RESCALE_SLACK`` (log2
    units), so the accumulator is rescaled on few iterations (1.12-1.16x on
    an H200).  fp8 tiles are widened to the query dtype for the dots;
    ``k_scale`` folds into the softmax scale and ``v_scale`` into the final
    normalisation, so dequantisation costs no extra pass.
  * Tiles are numbered in closed form: request ``b`` owns tiles
    ``cu_seqlens_q[b] // BLOCK_Q + b`` onwards, so a program finds its request by
    a binary search over ``cu_seqlens_q`` -- no host synchronisation, no tile list.
  * When there are too few tiles to fill the GPU (short extends), the key
    tiles of each query tile (its context, then its new tokens) are split into
    ``num_splits`` even ranges processed by separate programs; each writes a
    normalised fp32 partial output and its lse, and a small second kernel
    combines them.  With one split the first kernel writes the final output
    directly.
  * Every offset that multiplies a block id or a token index by a stride is
    computed in 64 bits.

Host cost (the call runs once per layer per step): the arguments are checked
once per launch key (``triton_launcher.LaunchCache``) and both kernels launch
through their compiled kernels.  A ``PagedContextWorkspace``, made once per
step by ``paged_context_workspace``, holds the LSE and split partials every
layer's call writes (no allocation per call) and can bind the step's metadata
tensors, whose geometry the calls then take from it.
"""

import functools
import math
from dataclasses import dataclass, field

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.utils.platform_utils import num_compute_units
from vllm.v1.attention.ops.triton_launcher import (
    KernelLaunch,
    LaunchCache,
    fast_path,
    tensor_geometry,
)

__all__ = [
    "PagedContextWorkspace",
    "paged_context_attention",
    "paged_context_workspace",
    "paged_context_workspace_size",
    "use_paged_context",
]

# Tile shape (query rows x context tokens per iteration, warps, pipeline
# stages).  Query rows = tokens x heads of one GQA group; every K/V element a
# program loads is used by BLOCK_M rows, so 128 rows halve the K/V traffic
# from L2 against 64.  On the H200, with lazy rescaling, this tile ran the
# context part at 288-343 TFLOP/s and no other tile of a 7-tile sweep was
# more than 4% faster on any shape; in the sweeps of the whole fused call
# (context + new tokens) it had the best worst case of 9 tiles
# (benchmarks/notes/paged_context.md).  BLOCK_N is a multiple of the
# 16-token page.
_BLOCK_M = 128
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2
# D > 128: the per-iteration K/V tiles and the accumulator double; halve the
# context tile and double the warps to stay within registers / shared memory.
_BLOCK_N_LARGE_D = 32
_NUM_WARPS_LARGE_D = 8
# Split the context when there are fewer than this many programs per SM
# worth of work (one full wave of two co-resident programs per SM).
_PROGRAMS_PER_SM = 2
# Never split finer than this many context tokens per split (enough
# iterations to amortise the partial-output write), nor into more than this
# many splits (the partial buffer is splits x T x Hq x D fp32).
_MIN_TOKENS_PER_SPLIT = 1024
_MAX_SPLITS = 16
# Heads per program of the split-combining kernel (its [BLOCK_H, D] fp32
# accumulator stays in registers up to D 256).
_COMBINE_BLOCK_H = 16

# fp32 queries (tests, reference runs) use exact FMA dots, not tensor cores;
# smaller tiles keep them in registers.
_FP32_BLOCK_M = 64
_FP32_BLOCK_N = 32

# CDNA (AMD gfx942 / gfx950, wave64): (block_m, block_n, warps, stages) for
# D <= 128 and for D > 128, from the AMD compile tier's facts (no AMD timing
# exists; docs/compile-tier.md).  The H200 tile above takes 256 VGPRs + ~130
# AGPRs there (one wave per SIMD) and spills at D 256.  8 warps keep the
# 128-row tile (the K/V reuse) with half the rows per wave; one stage and a
# 32-key tile (16 at D 256) leave room for the fp8 conversions: no spill on
# either target for any shape of the matrix, and the two waves per SIMD
# (two programs per CU) the context split assumes.
_CDNA_TILES = {
    False: (128, 32, 8, 1),
    True: (128, 16, 8, 1),
}

# Interpreter (CPU) launches: small tiles keep numpy work per program small.
_INTERP_BLOCK_M = 16
_INTERP_BLOCK_N = 16

_LOG2E = 1.4426950408889634

# Lazy rescaling slack in log2 units (see _attend_tile); 0 rescales
# the accumulator on every context tile.
_RESCALE_SLACK = 8.0
# Running max of a row that has seen no score yet: finite, so that
# exp2(-inf - _NO_SCORE) is 0 and exp2(_NO_SCORE - m) is 0 without NaNs.
_NO_SCORE = tl.constexpr(-1.0e30)

_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


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
            acc, l_i, m_i, q, k_ptr, v_ptr, block_row_ptr, row_base, t * BLOCK_N,
            limit, pos_base, q_pos, k_head_off, v_head_off, stride_kb, stride_kt,
            stride_vb, stride_vt, qk_scale, window_left, offs_n, offs_d,
            PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, PAGED, False, False, USE_WINDOW,
            DOT_IEEE, RESCALE_SLACK,
        )  # fmt: skip
    for t in range(tl.maximum(t_begin, full_end), t_end):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, block_row_ptr, row_base, t * BLOCK_N,
            limit, pos_base, q_pos, k_head_off, v_head_off, stride_kb, stride_kt,
            stride_vb, stride_vt, qk_scale, window_left, offs_n, offs_d,
            PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, PAGED, True, CAUSAL, USE_WINDOW,
            DOT_IEEE, RESCALE_SLACK,
        )  # fmt: skip
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
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_row_ptr, 0, t_begin, t_end,
        context_len, 0, q_pos, kv_head.to(tl.int64) * stride_kh,
        kv_head.to(tl.int64) * stride_vh, stride_kb, stride_kt, stride_vb, stride_vt,
        qk_scale, window_left, offs_n, offs_d, context_len // BLOCK_N,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, False, USE_WINDOW, DOT_IEEE,
        RESCALE_SLACK,
    )  # fmt: skip
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
            acc, l_i, m_i, q, k_new_ptr, v_new_ptr, block_row_ptr, q_begin.to(tl.int64),
            new_tile_lo + tl.maximum(v_begin - ctx_tiles, 0),
            new_tile_lo + tl.maximum(v_end - ctx_tiles, 0), new_end, context_len, q_pos,
            kv_head.to(tl.int64) * stride_knh, kv_head.to(tl.int64) * stride_vnh, 0,
            stride_knt, 0, stride_vnt, qk_scale_log2, window_left, offs_n, offs_d,
            (first_local + 1) // BLOCK_N, BLOCK_N, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD,
            False, True, USE_WINDOW, DOT_IEEE, RESCALE_SLACK,
        )  # fmt: skip

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
    """The tile for one target, head size, GQA group and query dtype.

    ``target`` is the Triton ``GPUTarget`` the kernel compiles for (``None``:
    the CPU interpreter).  A pure function of its arguments: the launch path
    and the AMD compile tier (scripts/compile_tier) both call it.
    """
    large_d = next_power_of_2(head_size) > 128
    warps = _NUM_WARPS_LARGE_D if large_d else _NUM_WARPS
    stages = _NUM_STAGES
    if target is None:
        block_m, block_n = _INTERP_BLOCK_M, _INTERP_BLOCK_N
    elif dtype == torch.float32:  # FMA dots: keep the tiles in registers
        block_m, block_n = _FP32_BLOCK_M, _FP32_BLOCK_N
    elif target.backend == "hip":
        block_m, block_n, warps, stages = _CDNA_TILES[large_d]
    else:
        block_m = _BLOCK_M
        block_n = _BLOCK_N_LARGE_D if large_d else _BLOCK_N
    group_pad = next_power_of_2(group)
    block_m = max(block_m, group_pad)
    return _Tile(block_m, block_m // group_pad, block_n, warps, stages)


def _combine_config(num_heads: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of ``_combine_splits_kernel`` (every target)."""
    return min(next_power_of_2(num_heads), _COMBINE_BLOCK_H), _NUM_WARPS


@functools.cache
def _gpu_target():
    """The Triton target of this process's GPU, read once."""
    return triton.runtime.driver.active.get_current_target()


def _check(cond: bool, msg, exc: type[Exception] = ValueError) -> None:
    # msg: a string, or a callable building it (formatted only on failure, so
    # the checks cost little host time per call).
    if not cond:
        raise exc(f"paged_context_attention: {msg() if callable(msg) else msg}")


def _check_scale(name: str, scale, device: torch.device) -> torch.Tensor:
    if isinstance(scale, (int, float)):
        return torch.full((1,), float(scale), dtype=torch.float32, device=device)
    _check(
        isinstance(scale, torch.Tensor),
        lambda: (
            f"{name} must be a float or a one-element float32 tensor, got {type(scale)}"
        ),
        TypeError,
    )
    _check(
        scale.numel() == 1 and scale.dtype == torch.float32,
        lambda: (
            f"{name} must be a one-element float32 tensor, got shape "
            f"{tuple(scale.shape)} dtype {scale.dtype}"
        ),
    )
    _check(
        scale.device == device,
        lambda: f"{name} is on {scale.device}, the cache on {device}",
    )
    return scale


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
    workspace: "PagedContextWorkspace | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend each new token of each extend to its request's cached context.

    Args:
        query: ``[T, Hq, D]`` fp16/bf16/fp32 new-token queries.
        key_cache: ``[num_blocks, block_size, Hkv, D]`` view of the paged
            cache's keys (module docstring): the query dtype, or fp8 with
            ``k_scale`` given.
        value_cache: the values, same shape and dtype as ``key_cache``.
        block_table: ``[>= B, max_blocks]`` int32/int64 block ids per request.
        cu_seqlens_q: ``[B + 1]`` int32/int64 offsets of each request's tokens
            in ``query`` (``cu_seqlens_q[0] == 0``).
        seq_lens: ``[B]`` int32/int64 context + new tokens per request.
        scale: softmax scale.
        key: optional ``[T, Hkv, D]`` keys of the new tokens themselves, in the
            query dtype (the step's ``key``, not read from the cache).  With
            ``value``, each new token also attends causally to its request's
            new tokens up to and including itself, so ``(out, lse)`` is the
            whole extend attention and no merge follows.
        value: the new tokens' values, same shape and dtype as ``key``.
        sliding_window: ``None`` (full context) or the window ``W >= 1`` in
            tokens: the token at position ``p`` sees positions ``> p - W``.
        k_scale: per-tensor key dequantisation scale (one-element float32
            tensor or float), required for fp8 caches, ignored otherwise.
        v_scale: the same for values.
        out: optional ``[T, Hq, D]`` output in the query dtype.
        lse: optional ``[Hq, T]`` float32 log-sum-exp output (natural log).
        max_context_len: optional host upper bound on the context lengths;
            only caps how finely the context is split across programs.
        num_splits: force the number of context splits (>= 1); default: enough
            programs to fill the device.
        workspace: optional ``paged_context_workspace`` of this call's shapes:
            the LSE (when ``lse`` is not given) and the split partials are
            written to its buffers instead of new ones, and its split count is
            used.  One per step serves every layer (they run in stream order).

    Returns:
        ``(out, lse)``.  Never reads device values on the host.  The arguments
        are checked once per launch key (shapes, strides, dtypes, devices and
        the host scalars; module ``triton_launcher``).

    """
    bound = None
    launch_key: tuple | None = None
    if fast_path():
        try:
            ws_key = lse_key = meta_key = None
            if workspace is not None:
                ws_key = workspace.key
                if lse is None:
                    lse = workspace.lse  # its geometry is in ws_key
                elif lse is not workspace.lse:
                    lse_key = (lse.shape, lse.stride(), lse.dtype, lse.device)
                # Metadata bound to the workspace: the same tensors, their
                # geometry in ws_key.
                bound_meta = (
                    block_table is workspace.block_table
                    and cu_seqlens_q is workspace.cu_seqlens_q
                    and seq_lens is workspace.seq_lens
                )
            elif lse is not None:
                lse_key = (lse.shape, lse.stride(), lse.dtype, lse.device)
            if workspace is None or not bound_meta:
                meta_key = (
                    block_table.shape, block_table.stride(), block_table.dtype,
                    block_table.device, cu_seqlens_q.shape, cu_seqlens_q.stride(),
                    cu_seqlens_q.dtype, cu_seqlens_q.device, seq_lens.shape,
                    seq_lens.stride(), seq_lens.dtype, seq_lens.device,
                )  # fmt: skip
            launch_key = (
                query.shape, query.stride(), query.dtype, query.device,
                key_cache.shape, key_cache.stride(), key_cache.dtype,
                key_cache.device, value_cache.shape, value_cache.stride(),
                value_cache.dtype, value_cache.device, meta_key, scale, type(scale),
                sliding_window, type(sliding_window), max_context_len,
                type(max_context_len), num_splits, type(num_splits),
                None if key is None else tensor_geometry(key),
                None if value is None else tensor_geometry(value),
                None if out is None else tensor_geometry(out),
                lse is None, lse_key, ws_key,
            )  # fmt: skip
            if key_cache.dtype in _FP8_DTYPES:  # only fp8 caches read the scales
                # (Python float scales become tensors per call: not cached.)
                launch_key += (tensor_geometry(k_scale), tensor_geometry(v_scale))
            bound = _LAUNCHES.get(launch_key)
        except (AttributeError, TypeError):  # not tensors, unhashable: checked below
            launch_key = None
    if lse is None and isinstance(workspace, PagedContextWorkspace):
        lse = workspace.lse
    if bound is None:
        bound = _LAUNCHES.bind(
            launch_key, _bind, query, key_cache, value_cache, block_table,
            cu_seqlens_q, seq_lens, scale, key, value, sliding_window, k_scale, v_scale,
            out, lse, max_context_len, num_splits, workspace,
        )  # fmt: skip

    if out is None:
        out = torch.empty_like(query)
    if lse is None:
        lse = torch.empty(bound.lse_shape, dtype=torch.float32, device=query.device)
    if bound.attend is None:  # no requests or no tokens
        return out, lse
    if bound.scales is not None:  # converted from floats for this call
        k_scale, v_scale = bound.scales
    elif not bound.fp8:  # never read
        k_scale = v_scale = seq_lens
    if key is None:  # never read
        key, value = key_cache, value_cache
    if bound.combine is None:  # one split: the kernel writes out / lse
        bound.attend(
            query, key_cache, value_cache, key, value, block_table, cu_seqlens_q,
            seq_lens, k_scale, v_scale, out, lse,
        )  # fmt: skip
        return out, lse
    if workspace is None:
        part_out = torch.empty(
            bound.part_shapes[0], dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            bound.part_shapes[1], dtype=torch.float32, device=query.device
        )
    else:
        part_out, part_lse = workspace.partial_out, workspace.partial_lse
    bound.attend(query, key_cache, value_cache, key, value, block_table, cu_seqlens_q,
                 seq_lens, k_scale, v_scale, part_out, part_lse)  # fmt: skip
    bound.combine(part_out, part_lse, out, lse, cu_seqlens_q)
    return out, lse


# paged_context_attention's checked launches by key.
_LAUNCHES = LaunchCache()


@dataclass(frozen=True)
class _Bound:
    """What a launch key fixes: the launches and the buffers a call needs."""

    lse_shape: tuple[int, int]
    fp8: bool
    attend: KernelLaunch | None  # None: nothing to compute
    combine: KernelLaunch | None = None  # None: one split
    part_shapes: tuple | None = None  # (partial out, partial lse) when splitting
    scales: tuple | None = None  # float scales converted for one (uncached) call


@dataclass(frozen=True, eq=False)
class PagedContextWorkspace:
    """Buffers that one step's ``paged_context_attention`` calls share.

    Made by ``paged_context_workspace`` for the step's shapes: ``lse``
    ``[Hq, T]``, and with ``num_splits > 1`` the split partials
    ``partial_out`` ``[S, T, Hq, D]`` and ``partial_lse`` ``[S, Hq, T]``
    (float32, contiguous).  ``block_table`` / ``cu_seqlens_q`` / ``seq_lens``:
    the step's request metadata when bound (calls that pass these very
    tensors take their geometry from ``key`` instead of reading it again).
    Compared by identity.
    """

    lse: torch.Tensor
    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None
    num_splits: int
    block_table: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    # What the checks of the workspace (and of the metadata bound to it) look
    # at: its launch-key part.
    key: tuple | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        try:
            parts = tuple(
                None if t is None else tensor_geometry(t)
                for t in (self.lse, self.partial_out, self.partial_lse,
                          self.block_table, self.cu_seqlens_q, self.seq_lens)
            )  # fmt: skip
        except AttributeError:  # not tensors: paged_context_attention says so
            return
        object.__setattr__(self, "key", (*parts, self.num_splits))


def paged_context_workspace(
    num_tokens: int,
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    block_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> PagedContextWorkspace:
    """Buffers for one step's calls of ``T = num_tokens`` queries of ``num_reqs``
    requests (``Hq = num_heads``, ``Hkv = num_kv_heads``, ``D = head_size``,
    query dtype ``dtype``): the split count the calls would choose
    (``max_context_len`` / ``num_splits`` as for ``paged_context_attention``),
    the LSE and the split partials.  Call once per step.

    ``buffers``: three 1-D float32 tensors of at least
    ``paged_context_workspace_size(...)`` elements each (persistent, reserved
    where memory profiling sees them); the workspace is then views of them and
    nothing is allocated.  Without them the buffers are allocated here.

    ``block_table``, ``cu_seqlens_q``, ``seq_lens``: optionally the step's
    metadata tensors, bound to the workspace: every layer's call that passes
    these same tensors (the same objects) reads their geometry once, here,
    instead of on every call (the checks still run once per launch key)."""
    for name, v in (("num_tokens", num_tokens), ("num_reqs", num_reqs),
                    ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("head_size", head_size)):  # fmt: skip
        _check(
            isinstance(v, int) and v >= 0,
            lambda name=name, v=v: f"{name} must be an int >= 0, got {v!r}",
        )
    _check(
        num_kv_heads >= 1 and num_heads % num_kv_heads == 0,
        lambda: (
            f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
        ),
    )
    device = torch.device(device)
    target = None if device.type != "cuda" else _gpu_target()
    tile = _tile_config(target, head_size, num_heads // num_kv_heads, dtype)
    splits = _split_count(
        num_tokens, num_reqs, num_kv_heads, tile, device, max_context_len, num_splits
    )
    shapes: list[tuple[int, ...]] = [(num_heads, num_tokens)]
    if splits > 1:
        shapes += [
            (splits, num_tokens, num_heads, head_size),
            (splits, num_heads, num_tokens),
        ]
    if buffers is None:
        parts = [torch.empty(x, dtype=torch.float32, device=device) for x in shapes]
    else:
        parts = []
        for name, buf, shape in zip(
            ("lse", "partial_out", "partial_lse"), buffers, shapes
        ):
            n = math.prod(shape)
            _check(
                buf.dim() == 1 and buf.dtype == torch.float32 and buf.numel() >= n
                and buf.device == device,
                lambda name=name, buf=buf, n=n: (
                    f"buffers: {name} must be a 1-D float32 tensor of >= {n} elements "
                    f"on {device}, got {tuple(buf.shape)} {buf.dtype} on {buf.device}"
                ),
            )  # fmt: skip
            parts.append(buf[:n].view(shape))
    lse, part_out, part_lse = (*parts, None, None)[:3]
    return PagedContextWorkspace(
        lse, part_out, part_lse, splits, block_table, cu_seqlens_q, seq_lens
    )


def paged_context_workspace_size(
    max_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[int, int, int]:
    """Float32 elements of the (lse, partial_out, partial_lse) buffers that hold
    ``paged_context_workspace`` of every step of at most ``max_tokens`` new
    tokens (any request count, context length; default split counts).

    The bound: ``Hq * T_max`` for the LSE; for the partials the largest
    ``S * T`` over ``T <= T_max`` at one request (the split count ``S`` only
    falls as the request count grows), times ``Hq * D`` and ``Hq``.  ``S <= 16``,
    so at most ``16 * T_max * Hq * D`` and ``16 * T_max * Hq``; with the device
    filled by fewer splits it is ``S * T <= T + 2 * SMs * BLOCK_Q / Hkv``.
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


def _split_count(
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    tile: _Tile,
    device,
    max_context_len: int | None,
    num_splits: int | None,
) -> int:
    """Context splits per query tile: ``num_splits``, or enough programs to
    fill the device (one under the interpreter)."""
    if num_splits is not None:
        return num_splits
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    base = (num_tokens // tile.block_q + num_reqs) * num_kv_heads
    want = cdiv(_PROGRAMS_PER_SM * num_compute_units(device.index or 0), base)
    cap = _MAX_SPLITS
    if max_context_len is not None:
        cap = min(cap, max(1, max_context_len // _MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap))


def _bind(
    query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, key,
    value, sliding_window, k_scale, v_scale, out, lse, max_context_len, num_splits,
    workspace,
) -> _Bound:  # fmt: skip
    """Check paged_context_attention's arguments; return what its key fixes."""
    _check(
        isinstance(query, torch.Tensor) and query.dim() == 3,
        "query must be a [T, Hq, D] tensor",
        TypeError,
    )
    _check(
        query.dtype in _QUERY_DTYPES,
        lambda: f"query dtype must be one of {_QUERY_DTYPES}, got {query.dtype}",
        TypeError,
    )
    num_tokens, num_heads, head_size = query.shape
    device = query.device
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(
            isinstance(cache, torch.Tensor) and cache.dim() == 4,
            lambda name=name: (
                f"{name} must be a [num_blocks, block_size, Hkv, D] tensor"
            ),
            TypeError,
        )
        _check(
            cache.device == device,
            lambda name=name, cache=cache: (
                f"{name} is on {cache.device}, query on {device}"
            ),
        )
        _check(
            cache.stride(3) == 1,
            lambda name=name: f"{name} must be contiguous in its last dim",
        )
    _check(
        key_cache.shape == value_cache.shape,
        lambda: (
            f"key_cache {tuple(key_cache.shape)} and value_cache "
            f"{tuple(value_cache.shape)} shapes differ"
        ),
    )
    _check(
        key_cache.dtype == value_cache.dtype,
        lambda: (
            f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) "
            "dtypes differ"
        ),
        TypeError,
    )
    num_blocks, page_size, num_kv_heads, cache_head_size = key_cache.shape
    _check(
        cache_head_size == head_size,
        lambda: f"cache head size {cache_head_size} != query head size {head_size}",
    )
    _check(
        16 <= head_size <= 256,
        lambda: f"head size must be in [16, 256], got {head_size}",
    )
    _check(
        num_kv_heads >= 1 and num_heads % num_kv_heads == 0,
        lambda: (
            f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
        ),
    )
    _check(query.stride(2) == 1, "query must be contiguous in its last dim")
    fp8 = key_cache.dtype in _FP8_DTYPES
    _check(
        fp8 or key_cache.dtype == query.dtype,
        lambda: (
            f"cache dtype {key_cache.dtype} must equal the query dtype {query.dtype} "
            "or be fp8"
        ),
        TypeError,
    )
    if fp8:
        _check(
            query.dtype != torch.float32,
            "an fp8 cache needs fp16/bf16 queries",
            TypeError,
        )
        _check(
            k_scale is not None and v_scale is not None,
            "an fp8 cache needs k_scale and v_scale",
        )
        given_k, given_v = k_scale, v_scale
        k_scale = _check_scale("k_scale", k_scale, device)
        v_scale = _check_scale("v_scale", v_scale, device)

    for name, t, ndim in (
        ("block_table", block_table, 2),
        ("cu_seqlens_q", cu_seqlens_q, 1),
        ("seq_lens", seq_lens, 1),
    ):
        _check(
            isinstance(t, torch.Tensor) and t.dim() == ndim,
            lambda name=name, ndim=ndim: f"{name} must be a {ndim}-d tensor",
            TypeError,
        )
        _check(
            t.dtype in _INDEX_DTYPES,
            lambda name=name, t=t: f"{name} must be int32 or int64, got {t.dtype}",
            TypeError,
        )
        _check(
            t.device == device,
            lambda name=name, t=t: f"{name} is on {t.device}, query on {device}",
        )
    num_reqs = seq_lens.shape[0]
    _check(
        cu_seqlens_q.shape[0] == num_reqs + 1,
        lambda: (
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected {num_reqs + 1}"
        ),
    )
    _check(
        block_table.shape[0] >= num_reqs,
        lambda: f"block_table has {block_table.shape[0]} rows for {num_reqs} requests",
    )
    _check(block_table.stride(1) == 1, "block_table rows must be contiguous")
    _check(
        cu_seqlens_q.stride(0) == 1 and seq_lens.stride(0) == 1,
        "cu_seqlens_q and seq_lens must be contiguous",
    )

    with_new = key is not None or value is not None
    if with_new:
        for name, t in (("key", key), ("value", value)):
            _check(
                isinstance(t, torch.Tensor) and t.dim() == 3,
                lambda name=name: f"{name} must be a [T, Hkv, D] tensor",
                TypeError,
            )
            _check(
                t.shape == (num_tokens, num_kv_heads, head_size),
                lambda name=name, t=t: (
                    f"{name} must be {(num_tokens, num_kv_heads, head_size)}, got "
                    f"{tuple(t.shape)}"
                ),
            )
            _check(
                t.dtype == query.dtype,
                lambda name=name, t=t: (
                    f"{name} dtype {t.dtype} must equal the query dtype {query.dtype}"
                ),
                TypeError,
            )
            _check(
                t.device == device,
                lambda name=name, t=t: f"{name} is on {t.device}, query on {device}",
            )
            _check(
                t.stride(2) == 1,
                lambda name=name: f"{name} must be contiguous in its last dim",
            )

    if sliding_window is not None:
        _check(
            isinstance(sliding_window, int) and sliding_window >= 1,
            lambda: (
                f"sliding_window must be None or an int >= 1, got {sliding_window!r}"
            ),
        )
    if max_context_len is not None:
        _check(
            isinstance(max_context_len, int) and max_context_len >= 0,
            lambda: f"max_context_len must be an int >= 0, got {max_context_len!r}",
        )
    if num_splits is not None:
        _check(
            isinstance(num_splits, int) and 1 <= num_splits <= 256,
            lambda: f"num_splits must be an int in [1, 256], got {num_splits!r}",
        )

    if out is not None:
        _check(
            out.shape == query.shape
            and out.dtype == query.dtype
            and out.device == device,
            lambda: (
                f"out must be {tuple(query.shape)} {query.dtype} on {device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            ),
        )
        _check(out.stride(2) == 1, "out must be contiguous in its last dim")
    if lse is not None:
        _check(
            lse.shape == (num_heads, num_tokens)
            and lse.dtype == torch.float32
            and lse.device == device,
            lambda: (
                f"lse must be ({num_heads}, {num_tokens}) float32 on {device}, got "
                f"{tuple(lse.shape)} {lse.dtype} on {lse.device}"
            ),
        )
    scales = None
    if fp8 and (k_scale is not given_k or v_scale is not given_v):
        scales = (k_scale, v_scale)
    lse_shape = (num_heads, num_tokens)
    if workspace is not None:
        _check(
            isinstance(workspace, PagedContextWorkspace) and workspace.key is not None,
            lambda: (
                "workspace must be a PagedContextWorkspace made by "
                f"paged_context_workspace, got {type(workspace).__name__}"
            ),
            TypeError,
        )
        _check(
            num_splits is None or num_splits == workspace.num_splits,
            lambda: (
                f"num_splits ({num_splits}) differs from the workspace's "
                f"({workspace.num_splits})"
            ),
        )
        num_splits = workspace.num_splits
        if num_splits > 1:
            shapes = (
                (num_splits, num_tokens, num_heads, head_size),
                (num_splits, num_heads, num_tokens),
            )
            for name, t, shape in zip(
                ("partial_out", "partial_lse"),
                (workspace.partial_out, workspace.partial_lse),
                shapes,
            ):
                _check(
                    isinstance(t, torch.Tensor)
                    and tuple(t.shape) == shape
                    and t.dtype == torch.float32
                    and t.device == device
                    and t.is_contiguous(),
                    lambda name=name, t=t, shape=shape: (
                        f"workspace.{name} must be a contiguous {shape} float32 tensor "
                        f"on {device} (a workspace made for this call's shapes), got "
                        f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}"
                    ),
                )
    if num_reqs == 0 or num_tokens == 0:
        return _Bound(lse_shape, fp8, None)

    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_size)
    # The target is read once per process; this runs once per launch key.
    target = None if device.type != "cuda" else _gpu_target()
    tile = _tile_config(target, head_size, group, query.dtype)
    num_q_tiles = num_tokens // tile.block_q + num_reqs
    num_splits = _split_count(
        num_tokens, num_reqs, num_kv_heads, tile, device, max_context_len, num_splits
    )
    # The strides of the out / lse the call allocates when not given.
    out_strides = (
        out if out is not None else torch.empty_like(query, device="meta")
    ).stride()
    lse_strides = lse.stride() if lse is not None else (num_tokens, 1)
    if num_splits == 1:
        o_strides = (0, *out_strides[:2])
        l_strides = (0, *lse_strides)
        part_shapes = None
    else:
        part_shapes = (
            (num_splits, num_tokens, num_heads, head_size),
            (num_splits, num_heads, num_tokens),
        )
        o_strides = (
            num_tokens * num_heads * head_size,
            num_heads * head_size,
            head_size,
        )
        l_strides = (num_heads * num_tokens, num_tokens, 1)
    attend = KernelLaunch(
        _paged_context_attention_kernel,
        (num_q_tiles, num_kv_heads, num_splits),
        (
            num_reqs,
            num_splits,
            float(scale) * _LOG2E,
            (sliding_window - 1) if sliding_window is not None else 0,
            query.stride(0),
            query.stride(1),
            *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            key.stride(0) if with_new else 0,
            key.stride(1) if with_new else 0,
            value.stride(0) if with_new else 0,
            value.stride(1) if with_new else 0,
            block_table.stride(0),
            *o_strides,
            *l_strides,
        ),
        dict(
            GROUP=group,
            GROUP_PAD=next_power_of_2(group),
            BLOCK_Q=tile.block_q,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            HEAD_DIM=head_size,
            HEAD_DIM_PAD=head_dim_pad,
            PAGE_SIZE=page_size,
            USE_WINDOW=sliding_window is not None,
            FP8=fp8,
            WITH_NEW=with_new,
            DOT_IEEE=query.dtype == torch.float32,
            RESCALE_SLACK=_RESCALE_SLACK,
        ),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if num_splits == 1:
        return _Bound(lse_shape, fp8, attend, scales=scales)
    block_h, combine_warps = _combine_config(num_heads)
    combine = KernelLaunch(
        _combine_splits_kernel,
        (num_tokens, cdiv(num_heads, block_h)),
        (
            num_reqs,
            num_splits,
            num_heads,
            *_partial_strides(part_shapes),
            *out_strides[:2],
            *lse_strides,
        ),
        dict(HEAD_DIM=head_size, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h),
        num_warps=combine_warps,
    )
    return _Bound(lse_shape, fp8, attend, combine, part_shapes, scales)


def _partial_strides(part_shapes):
    """Strides (split, token, head) of the partial output and (split, head,
    token) of the partial LSE: contiguous buffers of ``part_shapes``."""
    (s, t, h, d), _ = part_shapes
    return (t * h * d, h * d, d, h * t, t, 1)


def use_paged_context(extend_query_lens: torch.Tensor, max_tokens: int) -> bool:
    """Whether a step's extends should attend to their context from the paged cache.

    The rule the AITER FA backend applies once per step: the extends bring at
    most ``max_tokens`` new tokens *in total* (``max_tokens <= 0`` disables
    the paged route).  The gain over gather + a dense varlen kernel comes
    from parallelism: with few new tokens the dense kernel has few (query
    block x head) tiles and leaves most of the device idle, while this kernel
    splits the context across programs and needs no new-token pass or merge.
    It shrinks as the step's total grows, whatever the per-request split
    (``benchmarks/bench_paged_context.py``, ``gather_fa2`` baseline; figures in
    benchmarks/RESULTS.md).  The rule counts the total, which also keeps every
    long chunk on the gather path.  ``extend_query_lens`` is
    the host tensor of the extends' new-token counts; no extends: False.
    """
    if max_tokens <= 0 or extend_query_lens.numel() == 0:
        return False
    return int(extend_query_lens.sum()) <= max_tokens
