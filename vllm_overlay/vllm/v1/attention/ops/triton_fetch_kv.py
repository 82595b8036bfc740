# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gather the cached K/V of a batch of requests into dense varlen buffers.

``fetch_kv`` copies, for every request ``b``, the cached tokens at logical
positions ``seq_starts[b] .. seq_starts[b] + len_b - 1`` into output rows
``cu_seqlens_kv[b] .. cu_seqlens_kv[b + 1] - 1`` (``len_b`` is the difference
of those two).  Logical position ``p`` of request ``b`` lives in physical block
``block_table[b, p // block_size]``, slot ``p % block_size``.  Attention
backends use it to hand a varlen attention kernel the context of extends
(chunked prefill), sliding windows and KV-sharing layers.

Layouts (``H`` = num_kv_heads, ``D`` = head_size, ``bs`` = block_size):

  * ``"NHD"``: ``key_cache`` / ``value_cache`` are ``[num_blocks, bs, H, D]``
    views with any strides.  vLLM's packed cache
    ``(num_blocks, H, bs, 2 * D)`` viewed as K = ``[..., :D]`` and
    V = ``[..., D:]`` after ``transpose(1, 2)`` is the common case; there one
    (block, head) pair is a contiguous ``bs x 2D`` tile holding K and V.
  * ``"SHUFFLE"``: the tensors upstream's ``cp_mha_gather_cache`` takes, i.e.
    ``[num_blocks, bs, H, D]`` views whose blocks are dense
    (``stride(1) == H * D``, ``stride(2) == D``, ``stride(3) == 1``; the block
    stride is free), with each block's bytes holding, per head,
    K as ``[D // x, bs, x]`` and V as ``[bs // x, D, x]``, where
    ``x = 16 // cache element size`` (one 16-byte vector).

Outputs ``key_out`` / ``value_out`` are ``[num_tokens, H, D]`` (any strides);
only rows ``cu_seqlens_kv[0] .. cu_seqlens_kv[-1] - 1`` are written.

Dtypes: the cache and output dtypes match (a plain copy, bit-exact), or the
cache is fp8 (e4m3fn / e4m3fnuz / e5m2 / e5m2fnuz) and the outputs are
fp16 / bf16 / fp32: then ``out = (float32(cache) * scale).to(out dtype)`` with
the per-tensor ``k_scale`` / ``v_scale`` (one-element float tensors).

Design: one program moves one (cache page, kv head) tile per side -- ``bs``
slots x ``D``, a contiguous ``bs x 2D`` run in the packed layout -- or, when
such tiles are small (NHD only), ``PAGES_PER_PROGRAM`` consecutive pages of one
request, so each program has about ``_TILE_BYTES`` in flight.  Pages are
loaded whole (they are allocated; rows of a group past the request's last page
read block 0), so loads need no row mask and stay 16-byte vectors in both
layouts; stores are masked to the slots the request wants.  A program has
at most as many warps as leave each thread whole 16-byte vectors of its tile
(fewer than 4 for small SHUFFLE pages; the AMD compile tier checks the
widths in the generated code).  Work items are
numbered so that request ``b`` owns items ``W(b) .. W(b) + n_b - 1`` with
``W(b) = cu_seqlens_kv[b] // rows + 2 * b`` (``rows`` = slots per program) --
a closed form of ``cu_seqlens_kv``, so no work list, cumulative sum or host
synchronisation is needed and the call is CUDA-graph capturable.  A request
of ``len_b`` tokens needs at most ``len_b // rows + 2`` items, so the items of
consecutive requests never collide and at most two per request stay idle; a
program finds its request by counting the ``W(b)`` not above its item number,
in the same vector loads that fetch the request's row range and start.  All
cache and output offsets are computed in 64 bits.

Plan path: that lookup and the block-table loads of a program's pages are two
dependent memory round trips before its first data load, and a launch that
fits in one wave has nothing to hide them behind (a copy has none).
``fetch_kv_plan`` does both once per batch, in a small kernel with one program
per work item (same numbering, same lookup code), and writes one int32 row per
item: the output row of its first wanted slot, the wanted rows ``lo .. hi - 1``
of its tile (``lo == hi``: idle) and the block id of each of its pages (0 past
the request).  With ``fetch_kv(..., plan=)`` a program loads its row (header
and block ids are independent loads of one row: one round trip) and goes
straight to the data.  A plan depends only on the request metadata and the
rows per item (block size x pages per program), not on the cache, its heads
or its dtypes beyond their sizes, so one plan per step serves every layer;
``fetch_kv`` refuses a plan built for other rows or another batch size.  Both
paths move the same pages and write the same bytes.

Host cost: both wrappers check their arguments once per launch key (shapes,
strides, dtypes, devices, host scalars; ``triton_launcher.LaunchCache``) and
launch through the compiled kernel (``triton_launcher.KernelLaunch``), so a
layer's call costs a key lookup and a driver launch.  With a plan, the request
metadata is checked where the plan is built (once per step); ``fetch_kv`` then
checks only that it has the plan's batch size and index dtypes (its kernel
reads the plan, not the metadata).
"""

import functools
from dataclasses import dataclass, field

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.ops.triton_launcher import (
    KernelLaunch,
    LaunchCache,
    fast_path,
    tensor_geometry,
)

__all__ = ["FetchKVPlan", "fetch_kv", "fetch_kv_plan"]

# Size of a vector access in bytes; the SHUFFLE layout interleaves in units of
# 16 bytes (x = 16 // element size), and both layouts are moved in 16-byte
# vectors by the tile loads/stores.
_VECTOR_BYTES = 16

# Requests scanned per step when a program looks up which request its work
# item belongs to (one vector load per step; one step covers up to this many
# requests minus one).
_MAX_REQ_STEP = 1024

# Bytes of one side (K or V, the larger of cache and output element) that a
# program aims to move: one (page, head) tile, or several pages of one request
# when pages are small.  Enough bytes in flight per program hide the latency of
# its block-table lookup; with 4 warps an 8 KiB 16-bit tile is four 16-byte
# vectors per thread per side, which reaches copy bandwidth on H200 without
# spilling.  Smaller tiles (a SHUFFLE page is one page per program) get fewer
# warps, so that every thread still moves whole 16-byte vectors (_num_warps).
_TILE_BYTES = 8192
_MAX_PAGES_PER_PROGRAM = 8
_NUM_WARPS = 4

# A plan row: out_first, lo, hi, 0, then the block id of each page of the
# item; int32, padded to a power of two (see fetch_kv_plan).
_PLAN_HEADER = 4
_PLAN_NUM_WARPS = 1
_INT32_MAX = 2**31 - 1

_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_DEQUANT_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LAYOUTS = ("NHD", "SHUFFLE")


@dataclass(frozen=True, eq=False)
class FetchKVPlan:
    """A work plan for ``fetch_kv``, made by ``fetch_kv_plan``.

    ``table`` is int32 ``[num_items, width]`` on the device, one row per work
    item; the other fields are the host values it was built for, which
    ``fetch_kv`` checks against its call.  Compared by identity.
    """

    table: torch.Tensor
    block_size: int
    pages_per_program: int
    num_tokens: int  # upper bound on cu_seqlens_kv[-1] the plan covers
    num_reqs: int
    # What fetch_kv's checks of the plan look at (its launch-cache key part).
    key: tuple | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        t = self.table
        if isinstance(t, torch.Tensor):
            object.__setattr__(self, "key", (
                tensor_geometry(t), self.block_size, self.pages_per_program,
                self.num_tokens, self.num_reqs,
            ))  # fmt: skip

    @property
    def rows_per_item(self) -> int:
        return self.block_size * self.pages_per_program

    @property
    def num_items(self) -> int:
        return self.table.shape[0]


@triton.jit
def _locate_item(
    item,
    cu_seqlens_ptr,
    seq_starts_ptr,
    num_reqs,
    stride_cu,
    stride_ss,
    PAGE: tl.constexpr,
    PAGES_PER_PROGRAM: tl.constexpr,
    REQ_STEP: tl.constexpr,
):
    """Find what work item ``item`` covers.

    Returns ``(busy, req, out_start, pos_start, pos_end, first_page,
    end_page)``: the item is pages ``first_page .. first_page +
    PAGES_PER_PROGRAM - 1`` of request ``req``, whose positions ``pos_start ..
    pos_end - 1`` go to output rows from ``out_start``; pages from
    ``end_page`` on are past the request.  ``busy`` is false for an idle item
    (``req < 0``, ``pos_end <= pos_start`` or ``first_page >= end_page``).
    """
    ROWS: tl.constexpr = PAGES_PER_PROGRAM * PAGE
    # Which request owns this item: req = #{b : W(b) <= item} - 1 with
    # W(b) = cu[b] // ROWS + 2 b (strictly increasing).  The same vector loads
    # also yield the request's cu[req], cu[req + 1] and seq_starts[req], so
    # the lookup costs one memory round trip (one step up to REQ_STEP - 1
    # requests).
    count = tl.zeros((), dtype=tl.int32)
    out_start = tl.zeros((), dtype=tl.int64)
    out_end = tl.zeros((), dtype=tl.int64)
    pos_start = tl.zeros((), dtype=tl.int64)
    for req0 in range(0, num_reqs + 1, REQ_STEP):
        reqs = req0 + tl.arange(0, REQ_STEP)
        cu = tl.load(
            cu_seqlens_ptr + reqs.to(tl.int64) * stride_cu,
            mask=reqs <= num_reqs,
            other=0,
        ).to(tl.int64)
        starts = tl.load(
            seq_starts_ptr + reqs.to(tl.int64) * stride_ss,
            mask=reqs < num_reqs,
            other=0,
        ).to(tl.int64)
        hit = (reqs < num_reqs) & (cu // ROWS + 2 * reqs <= item)
        count += tl.sum(hit.to(tl.int32), axis=0)
        # Hits form a prefix, so index count - 1 (count) is in this step or
        # a later one whenever it is in this step at all.
        is_req = reqs == count - 1
        is_next = reqs == count
        found = tl.max(is_req.to(tl.int32), axis=0) > 0
        out_start = tl.where(found, tl.sum(tl.where(is_req, cu, 0), axis=0), out_start)
        pos_start = tl.where(
            found, tl.sum(tl.where(is_req, starts, 0), axis=0), pos_start
        )
        found_next = tl.max(is_next.to(tl.int32), axis=0) > 0
        out_end = tl.where(
            found_next, tl.sum(tl.where(is_next, cu, 0), axis=0), out_end
        )
    req = count - 1
    pos_end = pos_start + (out_end - out_start)
    end_page = (pos_end + PAGE - 1) // PAGE
    first_page = (
        pos_start // PAGE + (item - (out_start // ROWS + 2 * req)) * PAGES_PER_PROGRAM
    )
    busy = (req >= 0) & (pos_end > pos_start) & (first_page < end_page)
    return busy, req, out_start, pos_start, pos_end, first_page, end_page


@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt_req"],
    do_not_specialize_on_alignment=[
        "block_table_ptr",
        "cu_seqlens_ptr",
        "seq_starts_ptr",
    ],
)
def _fetch_kv_plan_kernel(
    plan_ptr,  # [num_items, PLAN_WIDTH] int32
    block_table_ptr,  # [num_reqs, max_blocks]
    cu_seqlens_ptr,  # [num_reqs + 1]
    seq_starts_ptr,  # [num_reqs]
    num_reqs,
    stride_bt_req,
    stride_bt_blk,
    stride_cu,
    stride_ss,
    PAGE: tl.constexpr,
    PAGES_PER_PROGRAM: tl.constexpr,
    PLAN_WIDTH: tl.constexpr,  # power of two >= PLAN_HEADER + PAGES_PER_PROGRAM
    PLAN_HEADER: tl.constexpr,
    REQ_STEP: tl.constexpr,
):
    ROWS: tl.constexpr = PAGES_PER_PROGRAM * PAGE
    item = tl.program_id(0)
    busy, req, out_start, pos_start, pos_end, first_page, end_page = _locate_item(
        item,
        cu_seqlens_ptr,
        seq_starts_ptr,
        num_reqs,
        stride_cu,
        stride_ss,
        PAGE,
        PAGES_PER_PROGRAM,
        REQ_STEP,
    )
    # Row: [out_first, lo, hi, 0, block of each page (0 past the request), 0...]
    # Tile rows lo .. hi - 1 are positions first_page * PAGE + lo .. and go to
    # output rows out_first ..; an idle item has lo == hi == 0.
    cols = tl.arange(0, PLAN_WIDTH)
    page = first_page + (cols - PLAN_HEADER)  # int64
    is_page = (cols >= PLAN_HEADER) & (cols < PLAN_HEADER + PAGES_PER_PROGRAM)
    block = tl.load(
        block_table_ptr + req.to(tl.int64) * stride_bt_req + page * stride_bt_blk,
        # (An idle item's bound is first_page: no page.  Not busy & ...: the
        # Triton 3.9 interpreter makes a scalar & tensor an int32 mask.)
        mask=is_page & (page < tl.where(busy, end_page, first_page)),
        other=0,
    ).to(tl.int64)
    tile_start = first_page * PAGE
    lo = tl.maximum(pos_start - tile_start, 0)
    hi = tl.minimum(pos_end - tile_start, ROWS)
    out_first = out_start + (tile_start + lo - pos_start)
    lo = tl.where(busy, lo, 0)
    hi = tl.where(busy, hi, 0)
    out_first = tl.where(busy, out_first, 0)
    row = tl.where(
        cols == 0,
        out_first,
        tl.where(cols == 1, lo, tl.where(cols == 2, hi, block)),
    )
    tl.store(plan_ptr + item.to(tl.int64) * PLAN_WIDTH + cols, row.to(tl.int32))


@triton.jit(
    do_not_specialize=["num_reqs", "num_kv_heads", "stride_bt_req"],
    do_not_specialize_on_alignment=[
        "block_table_ptr",
        "cu_seqlens_ptr",
        "seq_starts_ptr",
        "plan_ptr",
        "k_scale_ptr",
        "v_scale_ptr",
    ],
)
def _fetch_kv_kernel(
    key_cache_ptr,  # [num_blocks, PAGE, H, D] (NHD) / shuffled blocks
    value_cache_ptr,
    key_out_ptr,  # [num_tokens, H, D]
    value_out_ptr,
    block_table_ptr,  # [num_reqs, max_blocks]
    cu_seqlens_ptr,  # [num_reqs + 1]
    seq_starts_ptr,  # [num_reqs]
    plan_ptr,  # [num_items, PLAN_WIDTH] int32 (read only when PLAN)
    k_scale_ptr,  # [1] (read only when DEQUANT)
    v_scale_ptr,
    num_reqs,
    num_kv_heads,
    stride_bt_req,
    stride_bt_blk,
    stride_cu,
    stride_ss,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    stride_ko_tok,
    stride_ko_head,
    stride_ko_dim,
    stride_vo_tok,
    stride_vo_head,
    stride_vo_dim,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_SIZE
    PAGE: tl.constexpr,  # cache block size (tokens per page)
    PAGES_PER_PROGRAM: tl.constexpr,
    SHUFFLE: tl.constexpr,
    X: tl.constexpr,  # SHUFFLE vector width in elements
    DEQUANT: tl.constexpr,
    PLAN: tl.constexpr,  # read the item from a fetch_kv_plan row
    PLAN_WIDTH: tl.constexpr,
    PLAN_HEADER: tl.constexpr,
    REQ_STEP: tl.constexpr,  # requests scanned per lookup step
):
    ROWS: tl.constexpr = PAGES_PER_PROGRAM * PAGE
    pid = tl.program_id(0)
    item = pid // num_kv_heads
    head = (pid % num_kv_heads).to(tl.int64)
    rows = tl.arange(0, ROWS)
    slots = rows % PAGE

    if PLAN:
        # One round trip before the data: the header fields and the page
        # blocks are independent loads of the item's plan row (32 or 64
        # aligned bytes).
        plan_row = plan_ptr + item.to(tl.int64) * PLAN_WIDTH
        out_first = tl.load(plan_row).to(tl.int64)
        lo = tl.load(plan_row + 1)
        hi = tl.load(plan_row + 2)
        block = tl.load(plan_row + PLAN_HEADER + rows // PAGE).to(tl.int64)
        if hi <= lo:
            return
        row_ok = (rows >= lo) & (rows < hi)
        out_rows = out_first + (rows - lo)  # int64
    else:
        busy, req, out_start, pos_start, pos_end, first_page, end_page = _locate_item(
            item,
            cu_seqlens_ptr,
            seq_starts_ptr,
            num_reqs,
            stride_cu,
            stride_ss,
            PAGE,
            PAGES_PER_PROGRAM,
            REQ_STEP,
        )
        if not busy:
            return
        page = first_page + rows // PAGE  # int64
        bt_ptrs = (
            block_table_ptr + req.to(tl.int64) * stride_bt_req + page * stride_bt_blk
        )
        if PAGES_PER_PROGRAM == 1:
            block = tl.load(bt_ptrs).to(tl.int64)
        else:
            block = tl.load(bt_ptrs, mask=page < end_page, other=0).to(tl.int64)
        pos = page * PAGE + slots
        row_ok = (pos >= pos_start) & (pos < pos_end)
        out_rows = out_start + (pos - pos_start)  # int64

    dims = tl.arange(0, BLOCK_D)
    if SHUFFLE:
        # Per (block, head): K is [D // X, PAGE, X], V is [PAGE // X, D, X].
        tile = head * (HEAD_SIZE * PAGE)
        k_src = (
            key_cache_ptr
            + (block * stride_kc_blk + tile + slots * X)[:, None]
            + (dims // X * (PAGE * X) + dims % X)[None, :]
        )
        v_src = (
            value_cache_ptr
            + (block * stride_vc_blk + tile + slots // X * (HEAD_SIZE * X) + slots % X)[
                :, None
            ]
            + (dims * X)[None, :]
        )
    else:
        k_src = (
            key_cache_ptr
            + (
                block * stride_kc_blk
                + head * stride_kc_head
                + slots.to(tl.int64) * stride_kc_slot
            )[:, None]
            + (dims * stride_kc_dim)[None, :]
        )
        v_src = (
            value_cache_ptr
            + (
                block * stride_vc_blk
                + head * stride_vc_head
                + slots.to(tl.int64) * stride_vc_slot
            )[:, None]
            + (dims * stride_vc_dim)[None, :]
        )

    # Pages are loaded whole: they are allocated, and rows of pages past the
    # request's last one read block 0 (their table entry is masked to 0, or
    # their plan entry is 0), so
    # loads need no row mask and stay 16-byte vectors in both layouts; the
    # stores are masked to the wanted slots.
    if BLOCK_D == HEAD_SIZE:
        k = tl.load(k_src)
        v = tl.load(v_src)
    else:
        col_ok = (dims < HEAD_SIZE)[None, :]
        k = tl.load(k_src, mask=col_ok, other=0.0)
        v = tl.load(v_src, mask=col_ok, other=0.0)

    if DEQUANT:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    k = k.to(key_out_ptr.dtype.element_ty)
    v = v.to(value_out_ptr.dtype.element_ty)

    store_mask = row_ok[:, None] & (dims < HEAD_SIZE)[None, :]
    k_dst = (
        key_out_ptr
        + (out_rows * stride_ko_tok + head * stride_ko_head)[:, None]
        + (dims * stride_ko_dim)[None, :]
    )
    v_dst = (
        value_out_ptr
        + (out_rows * stride_vo_tok + head * stride_vo_head)[:, None]
        + (dims * stride_vo_dim)[None, :]
    )
    tl.store(k_dst, k, mask=store_mask)
    tl.store(v_dst, v, mask=store_mask)


def _check_tensor(name: str, t, ndim: int, fn: str = "fetch_kv") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(
            f"{fn}: {name} must have {ndim} dims, got shape {tuple(t.shape)}"
        )


def _check_index_args(
    block_table: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    seq_starts: torch.Tensor,
    fn: str,
    device: torch.device | None = None,
    device_of: str = "block_table",
) -> None:
    """Types, dims, device, dtypes and shapes of the request metadata.

    ``device``: where they must be (``device_of`` names what is there);
    default: ``block_table``'s device.
    """
    for name, t, ndim in (
        ("block_table", block_table, 2),
        ("cu_seqlens_kv", cu_seqlens_kv, 1),
        ("seq_starts", seq_starts, 1),
    ):
        _check_tensor(name, t, ndim, fn)
        if device is None:
            device = t.device
        if t.device != device:
            raise ValueError(f"{fn}: {name} is on {t.device}, {device_of} on {device}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{fn}: {name} must be int32 or int64, got {t.dtype}")
    num_reqs = seq_starts.shape[0]
    if cu_seqlens_kv.shape[0] != num_reqs + 1:
        raise ValueError(
            f"{fn}: cu_seqlens_kv must have num_reqs + 1 = {num_reqs + 1} entries "
            f"(seq_starts has {num_reqs}), got {cu_seqlens_kv.shape[0]}"
        )
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"{fn}: block_table has {block_table.shape[0]} rows for {num_reqs} requests"
        )


def _pages_per_program(
    block_size: int,
    head_size: int,
    cache_element_size: int,
    out_element_size: int,
    shuffle: bool,
) -> int:
    """Pages one program moves: about _TILE_BYTES per side (see the docstring)."""
    if shuffle:
        # With several pages per program Triton 3.6 no longer sees that the
        # SHUFFLE V rows are contiguous in groups of x and falls back to scalar
        # loads; one page per program keeps them 16-byte vectors.
        return 1
    side_bytes = block_size * head_size * max(cache_element_size, out_element_size)
    return min(
        _MAX_PAGES_PER_PROGRAM,
        1 << (max(1, _TILE_BYTES // side_bytes).bit_length() - 1),
    )


def _num_warps(
    warp_size: int,
    rows: int,
    head_size: int,
    cache_element_size: int,
    out_element_size: int,
) -> int:
    """Warps of one program, from the target's warp size and the tile.

    _NUM_WARPS, or fewer when the tile has fewer 16-byte vectors of its
    narrower side than that many warps have threads (each thread would then
    move 8 bytes or less per access).
    """
    elements = rows * next_power_of_2(head_size)
    vectors = elements * min(cache_element_size, out_element_size) // _VECTOR_BYTES
    warps = max(1, min(_NUM_WARPS, vectors // warp_size))
    return 1 << (warps.bit_length() - 1)


@functools.cache
def _gpu_warp_size() -> int:
    """Threads per warp of this process's GPU (Triton's target), read once."""
    return triton.runtime.driver.active.get_current_target().warp_size


def _num_items(num_tokens: int, rows: int, num_reqs: int) -> int:
    # A request of len tokens needs at most len // rows + 2 items, so its
    # items lie below W(b + 1) <= cu[-1] // rows + 2 (b + 1).
    return num_tokens // rows + 2 * num_reqs


def _plan_width(pages_per_program: int) -> int:
    return next_power_of_2(_PLAN_HEADER + pages_per_program)


def _req_step(num_reqs: int) -> int:
    """REQ_STEP for a batch of ``num_reqs``: a power of four from 16 (16, 64,
    256, 1024), so a serving run meets at most four variants (all warmed up)."""
    step = 16
    while step <= num_reqs and step < _MAX_REQ_STEP:
        step *= 4
    return min(step, _MAX_REQ_STEP)


def _check_scale(name: str, scale, device: torch.device) -> None:
    if scale is None:
        raise ValueError(
            f"fetch_kv: {name} is required to dequantise an fp8 cache into a "
            "non-fp8 output"
        )
    if not isinstance(scale, torch.Tensor):
        raise TypeError(
            f"fetch_kv: {name} must be a one-element tensor, got {type(scale).__name__}"
        )
    if scale.numel() != 1 or not scale.dtype.is_floating_point:
        raise ValueError(
            f"fetch_kv: {name} must be a one-element float tensor, got "
            f"shape {tuple(scale.shape)} dtype {scale.dtype}"
        )
    if scale.device != device:
        raise ValueError(
            f"fetch_kv: {name} is on {scale.device}, the cache on {device}"
        )


def _check_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    seq_starts: torch.Tensor,
    k_scale,
    v_scale,
    kv_cache_layout: str,
    max_num_tokens,
) -> tuple[bool, int]:
    """Validate the arguments; return (dequant, upper bound on fetched tokens)."""
    if kv_cache_layout not in _LAYOUTS:
        raise ValueError(
            f"fetch_kv: kv_cache_layout must be one of {_LAYOUTS}, "
            f"got {kv_cache_layout!r}"
        )
    for name, t, ndim in (
        ("key_cache", key_cache, 4),
        ("value_cache", value_cache, 4),
        ("key_out", key_out, 3),
        ("value_out", value_out, 3),
    ):
        _check_tensor(name, t, ndim)
        if t.device != key_cache.device:
            raise ValueError(
                f"fetch_kv: {name} is on {t.device}, key_cache on {key_cache.device}"
            )

    num_blocks, page, num_kv_heads, head_size = key_cache.shape
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"fetch_kv: value_cache shape {tuple(value_cache.shape)} != "
            f"key_cache shape {tuple(key_cache.shape)}"
        )
    if key_out.shape != value_out.shape:
        raise ValueError(
            f"fetch_kv: value_out shape {tuple(value_out.shape)} != "
            f"key_out shape {tuple(key_out.shape)}"
        )
    if tuple(key_out.shape[1:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"fetch_kv: outputs must be [num_tokens, {num_kv_heads}, {head_size}] "
            f"to match the cache, got {tuple(key_out.shape)}"
        )
    if page <= 0 or page & (page - 1):
        raise ValueError(f"fetch_kv: block_size must be a power of two, got {page}")

    cache_dtype, out_dtype = key_cache.dtype, key_out.dtype
    if value_cache.dtype != cache_dtype:
        raise TypeError(
            f"fetch_kv: key_cache is {cache_dtype}, value_cache is {value_cache.dtype}"
        )
    if value_out.dtype != out_dtype:
        raise TypeError(
            f"fetch_kv: key_out is {out_dtype}, value_out is {value_out.dtype}"
        )
    if cache_dtype == out_dtype:
        dequant = False
    elif cache_dtype in _FP8_DTYPES and out_dtype in _DEQUANT_OUT_DTYPES:
        dequant = True
        _check_scale("k_scale", k_scale, key_cache.device)
        _check_scale("v_scale", v_scale, key_cache.device)
    else:
        raise TypeError(
            f"fetch_kv: cannot fetch a {cache_dtype} cache into {out_dtype} "
            "outputs; the dtypes must match, or the cache must be fp8 (viewed as "
            "the platform's fp8 dtype, not uint8) and the outputs fp16/bf16/fp32"
        )

    if kv_cache_layout == "SHUFFLE":
        x = _VECTOR_BYTES // key_cache.element_size()
        if head_size % x or page % x:
            raise ValueError(
                f"fetch_kv: SHUFFLE needs head_size ({head_size}) and block_size "
                f"({page}) to be multiples of x = {x}"
            )
        dense = (num_kv_heads * head_size, head_size, 1)
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if tuple(t.stride()[1:]) != dense:
                raise ValueError(
                    f"fetch_kv: SHUFFLE needs each block of {name} dense (strides [*, "
                    f"{dense[0]}, {dense[1]}, 1]), got strides {tuple(t.stride())}"
                )

    _check_index_args(
        block_table,
        cu_seqlens_kv,
        seq_starts,
        "fetch_kv",
        key_cache.device,
        "key_cache",
    )
    num_reqs = seq_starts.shape[0]

    num_tokens = key_out.shape[0]
    if max_num_tokens is not None:
        if not isinstance(max_num_tokens, int) or not 0 <= max_num_tokens <= num_tokens:
            raise ValueError(
                f"fetch_kv: max_num_tokens must be an int in [0, {num_tokens}] (an "
                f"upper bound on cu_seqlens_kv[-1]), got {max_num_tokens!r}"
            )
        num_tokens = max_num_tokens
    return dequant, (num_tokens if num_reqs else 0)


def _check_plan(
    plan,
    key_cache: torch.Tensor,
    key_out: torch.Tensor,
    num_reqs: int,
    pages_per_program: int,
    kv_cache_layout: str,
    max_num_tokens,
) -> int:
    """Check that ``plan`` was built for this call; return its token bound."""
    if not isinstance(plan, FetchKVPlan):
        raise TypeError(
            "fetch_kv: plan must be a FetchKVPlan made by fetch_kv_plan, got "
            f"{type(plan).__name__}"
        )
    _, page, _, head_size = key_cache.shape
    if (plan.block_size, plan.pages_per_program) != (page, pages_per_program):
        raise ValueError(
            f"fetch_kv: the plan was built for block_size {plan.block_size} and "
            f"{plan.pages_per_program} pages per program; this call (head_size "
            f"{head_size}, {key_cache.element_size()}-byte cache, "
            f"{key_out.element_size()}-byte outputs, {kv_cache_layout}) needs "
            f"block_size {page} and {pages_per_program}: build the plan with the "
            "call's block_size, head_size, dtypes and layout"
        )
    if plan.num_reqs != num_reqs:
        raise ValueError(
            f"fetch_kv: the plan was built for {plan.num_reqs} requests, the call "
            f"has {num_reqs}"
        )
    width = _plan_width(pages_per_program)
    items = _num_items(plan.num_tokens, plan.rows_per_item, num_reqs)
    table = plan.table
    if (
        not isinstance(table, torch.Tensor)
        or table.dtype != torch.int32
        or tuple(table.shape) != (items, width)
        or (items > 0 and table.stride() != (width, 1))
    ):
        raise ValueError(
            f"fetch_kv: plan.table must be an int32 [{items}, {width}] tensor with "
            "contiguous rows (as fetch_kv_plan makes it)"
        )
    if table.device != key_cache.device:
        raise ValueError(
            f"fetch_kv: the plan is on {table.device}, key_cache on {key_cache.device}"
        )
    if plan.num_tokens > key_out.shape[0]:
        raise ValueError(
            f"fetch_kv: the plan covers up to {plan.num_tokens} tokens, the outputs "
            f"have {key_out.shape[0]} rows"
        )
    if max_num_tokens is not None and max_num_tokens != plan.num_tokens:
        raise ValueError(
            f"fetch_kv: max_num_tokens ({max_num_tokens}) differs from the plan's "
            f"num_tokens ({plan.num_tokens})"
        )
    if key_cache.shape[0] > _INT32_MAX:
        raise ValueError(
            f"fetch_kv: a plan holds int32 block ids; the cache has "
            f"{key_cache.shape[0]} blocks"
        )
    return plan.num_tokens if num_reqs else 0


def fetch_kv_plan(
    block_table: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    seq_starts: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    head_size: int,
    cache_dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    kv_cache_layout: str = "NHD",
    out: torch.Tensor | None = None,
) -> FetchKVPlan:
    """Precompute ``fetch_kv``'s work items for one batch of requests.

    Runs one small kernel on the device (never reads device values on the
    host, so it may be captured in a CUDA graph) that does, once, what every
    ``fetch_kv`` program otherwise does first: find its request and look up
    the block ids of its pages.  Pass the result as ``fetch_kv(..., plan=)``
    to every call that fetches this batch -- typically all layers of a step
    -- with the same ``block_table``, ``cu_seqlens_kv`` and ``seq_starts``
    values: the plan holds what it read from them, and ``fetch_kv`` cannot
    check values without a host synchronisation.

    Args:
        block_table: ``[>= num_reqs, max_blocks]`` int32/int64 physical block
            ids per request, as for ``fetch_kv``.
        cu_seqlens_kv: ``[num_reqs + 1]`` output row offsets, as for
            ``fetch_kv``.
        seq_starts: ``[num_reqs]`` first logical position fetched per request,
            as for ``fetch_kv``.
        num_tokens: host upper bound on ``cu_seqlens_kv[-1]``; the plan has
            one row per work item of a batch of up to this many tokens, and
            ``fetch_kv`` launches that many items (as for its
            ``max_num_tokens``).
        block_size: block size of the caches the plan will be used with.
        head_size: head size of those caches.
        cache_dtype: dtype of those caches; only its element size matters, so
            an fp8 cache may be given as ``torch.uint8``.
        out_dtype: dtype of the outputs (default ``cache_dtype``); only its
            element size matters.
        kv_cache_layout: ``"NHD"`` or ``"SHUFFLE"``.  With ``block_size``,
            ``head_size`` and the element sizes it fixes the rows each work
            item covers; ``fetch_kv`` refuses a plan built for other rows.
        out: optional int32 buffer for the plan, e.g. the ``table`` of a plan
            built for a larger ``num_tokens`` (a persistent buffer): at least
            as many rows, the same width, contiguous rows; the plan uses its
            first rows.

    """
    bound = None
    key: tuple | None = None
    if fast_path():
        try:
            key = (
                block_table.shape, block_table.stride(), block_table.dtype,
                block_table.device, cu_seqlens_kv.shape, cu_seqlens_kv.stride(),
                cu_seqlens_kv.dtype, cu_seqlens_kv.device, seq_starts.shape,
                seq_starts.stride(), seq_starts.dtype, seq_starts.device, num_tokens,
                type(num_tokens), block_size, type(block_size), head_size,
                type(head_size), cache_dtype, out_dtype, kv_cache_layout,
                None if out is None
                else (out.shape, out.stride(), out.dtype, out.device),
            )  # fmt: skip
            bound = _PLAN_LAUNCHES.get(key)
        except (AttributeError, TypeError):  # not tensors, unhashable: checked below
            key = None
    if bound is None:
        bound = _PLAN_LAUNCHES.bind(
            key, _bind_fetch_kv_plan, block_table, cu_seqlens_kv, seq_starts,
            num_tokens, block_size, head_size, cache_dtype, out_dtype, kv_cache_layout,
            out,
        )  # fmt: skip
    table_shape, pages_per_program, launch = bound
    if out is None:
        table = torch.empty(table_shape, dtype=torch.int32, device=block_table.device)
    else:
        table = out[: table_shape[0]]
    if launch is not None:
        launch(table, block_table, cu_seqlens_kv, seq_starts)
    return FetchKVPlan(
        table=table,
        block_size=block_size,
        pages_per_program=pages_per_program,
        num_tokens=num_tokens,
        num_reqs=seq_starts.shape[0],
    )


# fetch_kv_plan's checked launches by key: ((num_items, width), pages per
# program, KernelLaunch or None when there is nothing to plan).
_PLAN_LAUNCHES = LaunchCache()


def _bind_fetch_kv_plan(
    block_table, cu_seqlens_kv, seq_starts, num_tokens, block_size, head_size,
    cache_dtype, out_dtype, kv_cache_layout, out,
):  # fmt: skip
    """Check fetch_kv_plan's arguments; return what its launch key fixes."""
    fn = "fetch_kv_plan"
    if kv_cache_layout not in _LAYOUTS:
        raise ValueError(
            f"{fn}: kv_cache_layout must be one of {_LAYOUTS}, got {kv_cache_layout!r}"
        )
    _check_index_args(block_table, cu_seqlens_kv, seq_starts, fn)
    for name, value in (("block_size", block_size), ("head_size", head_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")
    if block_size & (block_size - 1):
        raise ValueError(f"{fn}: block_size must be a power of two, got {block_size}")
    if out_dtype is None:
        out_dtype = cache_dtype
    for name, dtype in (("cache_dtype", cache_dtype), ("out_dtype", out_dtype)):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: {name} must be a torch.dtype, got {dtype!r}")
    if not isinstance(num_tokens, int) or not 0 <= num_tokens <= _INT32_MAX:
        raise ValueError(
            f"{fn}: num_tokens must be an int in [0, {_INT32_MAX}] (an upper bound "
            f"on cu_seqlens_kv[-1]), got {num_tokens!r}"
        )

    pages_per_program = _pages_per_program(
        block_size,
        head_size,
        cache_dtype.itemsize,
        out_dtype.itemsize,
        kv_cache_layout == "SHUFFLE",
    )
    num_reqs = seq_starts.shape[0]
    num_items = _num_items(num_tokens, pages_per_program * block_size, num_reqs)
    width = _plan_width(pages_per_program)
    if out is not None:
        _check_tensor("out", out, 2, fn)
        if (
            out.dtype != torch.int32
            or out.shape[0] < num_items
            or out.shape[1] != width
            or out.stride() != (width, 1)
        ):
            raise ValueError(
                f"{fn}: out must be an int32 [>= {num_items}, {width}] tensor with "
                f"contiguous rows, got {out.dtype} shape {tuple(out.shape)} strides "
                f"{tuple(out.stride())}"
            )
        if out.device != block_table.device:
            raise ValueError(
                f"{fn}: out is on {out.device}, block_table on {block_table.device}"
            )
    launch = None
    if num_items > 0:
        launch = KernelLaunch(
            _fetch_kv_plan_kernel,
            (num_items,),
            (
                num_reqs,
                *block_table.stride(),
                cu_seqlens_kv.stride(0),
                seq_starts.stride(0),
            ),
            dict(
                PAGE=block_size,
                PAGES_PER_PROGRAM=pages_per_program,
                PLAN_WIDTH=width,
                PLAN_HEADER=_PLAN_HEADER,
                REQ_STEP=_req_step(num_reqs),
            ),
            num_warps=_PLAN_NUM_WARPS,
        )
    return (num_items, width), pages_per_program, launch


def fetch_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    seq_starts: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_cache_layout: str = "NHD",
    max_num_tokens: int | None = None,
    plan: FetchKVPlan | None = None,
) -> None:
    """Gather each request's cached K/V into ``key_out`` / ``value_out``.

    Args:
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` cache
            view (see the module docstring for layouts).
        value_cache: same shape and dtype as ``key_cache``.
        key_out: ``[num_tokens, num_kv_heads, head_size]``; rows
            ``cu_seqlens_kv[0] .. cu_seqlens_kv[-1] - 1`` are written.
        value_out: same shape and dtype as ``key_out``.
        block_table: ``[>= num_reqs, max_blocks]`` int32/int64 physical block
            ids per request.
        cu_seqlens_kv: ``[num_reqs + 1]`` output row offsets (device tensor).
        seq_starts: ``[num_reqs]`` first logical position fetched per request.
        k_scale: one-element float tensor; required (and used) only when an
            fp8 cache is dequantised into non-fp8 outputs.
        v_scale: likewise for the values.
        kv_cache_layout: ``"NHD"`` or ``"SHUFFLE"``.
        max_num_tokens: optional host upper bound on ``cu_seqlens_kv[-1]``
            (default ``key_out.shape[0]``); only sizes the launch grid, so a
            caller that knows the fetched total avoids launching idle programs
            into a large workspace.  With a plan, the plan's ``num_tokens`` is
            the bound, and ``max_num_tokens`` (if given) must equal it.
        plan: optional ``fetch_kv_plan`` of the same ``block_table``,
            ``cu_seqlens_kv`` and ``seq_starts``, built for this call's block
            size, head size, dtypes and layout (checked); the kernel then reads
            each item from it instead of looking the item up.  The outputs are
            the same with or without it.

    Never reads device values on the host, so it may be captured in a CUDA
    graph.

    """
    bound = None
    key: tuple | None = None
    if fast_path():
        try:
            key = (
                key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device,
                value_cache.shape, value_cache.stride(), value_cache.dtype,
                value_cache.device, key_out.shape, key_out.stride(), key_out.dtype,
                key_out.device, value_out.shape, value_out.stride(), value_out.dtype,
                value_out.device, block_table.dtype, cu_seqlens_kv.dtype,
                seq_starts.dtype, seq_starts.shape, kv_cache_layout, max_num_tokens,
                type(max_num_tokens),
            )  # fmt: skip
            if plan is None:
                key += (
                    block_table.shape, block_table.stride(), block_table.device,
                    cu_seqlens_kv.shape, cu_seqlens_kv.stride(), cu_seqlens_kv.device,
                    seq_starts.stride(), seq_starts.device,
                )  # fmt: skip
            else:
                key += (plan.key,)
            if key_cache.dtype is not key_out.dtype:  # dequantisation reads the scales
                key += (
                    None if k_scale is None
                    else (k_scale.shape, k_scale.dtype, k_scale.device),
                    None if v_scale is None
                    else (v_scale.shape, v_scale.dtype, v_scale.device),
                )  # fmt: skip
            bound = _FETCH_KV_LAUNCHES.get(key)
        except (AttributeError, TypeError):  # not tensors, unhashable: checked below
            key = None
    if bound is None:
        bound = _FETCH_KV_LAUNCHES.bind(
            key, _bind_fetch_kv, key_cache, value_cache, key_out, value_out,
            block_table, cu_seqlens_kv, seq_starts, k_scale, v_scale, kv_cache_layout,
            max_num_tokens, plan,
        )  # fmt: skip
    launch, dequant = bound
    if launch is None:
        return
    # Arguments the kernel does not read are filled with a tensor of fixed
    # dtype: with a plan the request metadata (the plan's table), without
    # dequantisation the scales.
    unread = cu_seqlens_kv if plan is None else plan.table
    if not dequant:
        k_scale = v_scale = unread
    if plan is None:
        launch(key_cache, value_cache, key_out, value_out, block_table, cu_seqlens_kv,
               seq_starts, unread, k_scale, v_scale)  # fmt: skip
    else:
        launch(key_cache, value_cache, key_out, value_out, unread, unread, unread,
               unread, k_scale, v_scale)  # fmt: skip


# fetch_kv's checked launches by key: (KernelLaunch or None when there is
# nothing to fetch, dequantise).
_FETCH_KV_LAUNCHES = LaunchCache()


def _bind_fetch_kv(
    key_cache, value_cache, key_out, value_out, block_table, cu_seqlens_kv,
    seq_starts, k_scale, v_scale, kv_cache_layout, max_num_tokens, plan,
):  # fmt: skip
    """Check fetch_kv's arguments; return what its launch key fixes."""
    dequant, num_tokens = _check_args(
        key_cache,
        value_cache,
        key_out,
        value_out,
        block_table,
        cu_seqlens_kv,
        seq_starts,
        k_scale,
        v_scale,
        kv_cache_layout,
        max_num_tokens,
    )
    _, page, num_kv_heads, head_size = key_cache.shape
    num_reqs = seq_starts.shape[0]
    shuffle = kv_cache_layout == "SHUFFLE"
    pages_per_program = _pages_per_program(
        page, head_size, key_cache.element_size(), key_out.element_size(), shuffle
    )
    if plan is not None:
        num_tokens = _check_plan(
            plan,
            key_cache,
            key_out,
            num_reqs,
            pages_per_program,
            kv_cache_layout,
            max_num_tokens,
        )
    if num_tokens == 0:
        return None, dequant
    if plan is None:
        num_items = _num_items(num_tokens, pages_per_program * page, num_reqs)
        meta_strides = (
            *block_table.stride(),
            cu_seqlens_kv.stride(0),
            seq_starts.stride(0),
        )
    else:
        num_items = plan.num_items
        meta_strides = (0, 0, 0, 0)  # not read: the kernel reads the plan
    launch = KernelLaunch(
        _fetch_kv_kernel,
        (num_items * num_kv_heads,),
        (
            num_reqs,
            num_kv_heads,
            *meta_strides,
            *key_cache.stride(),
            *value_cache.stride(),
            *key_out.stride(),
            *value_out.stride(),
        ),
        dict(
            HEAD_SIZE=head_size,
            BLOCK_D=next_power_of_2(head_size),
            PAGE=page,
            PAGES_PER_PROGRAM=pages_per_program,
            SHUFFLE=shuffle,
            X=_VECTOR_BYTES // key_cache.element_size() if shuffle else 1,
            DEQUANT=dequant,
            PLAN=plan is not None,
            PLAN_WIDTH=_plan_width(pages_per_program),
            PLAN_HEADER=_PLAN_HEADER,
            REQ_STEP=_req_step(num_reqs),
        ),
        num_warps=_num_warps(
            _gpu_warp_size() if key_cache.is_cuda else 32,
            pages_per_program * page,
            head_size,
            key_cache.element_size(),
            key_out.element_size(),
        ),
    )
    return launch, dequant
