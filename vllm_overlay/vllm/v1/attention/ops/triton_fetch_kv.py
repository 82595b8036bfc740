# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gather the cached K/V of a batch of requests into dense varlen buffers.

``fetch_kv`` copies, for every request ``b``, the cached tokens from logical
position ``seq_starts[b]`` on into output rows ``cu_seqlens_kv[b] ..
cu_seqlens_kv[b + 1] - 1`` (position ``p``: slot ``p % block_size`` of block
``block_table[b, p // block_size]``).  Caches are ``[num_blocks, bs, H, D]``
views, ``"NHD"`` (any strides) or ``"SHUFFLE"`` (``cp_mha_gather_cache``'s
dense blocks: per head K as ``[D // x, bs, x]``, V as ``[bs // x, D, x]``, ``x =
16 // element size``); outputs ``[num_tokens, H, D]``, the cache's dtype (a
bit-exact copy) or float from fp8 (times ``k_scale`` / ``v_scale``).  A program
moves a (page, head) tile a side, or several pages when they are small; request
``b`` owns items from ``cu_seqlens_kv[b] // rows + 2 * b`` (no host sync).
``fetch_kv_plan`` finds each item's request and blocks once per batch.
"""

import functools
from dataclasses import dataclass, field

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.ops.triton_launch import KernelCall

__all__ = ["FetchKVPlan", "fetch_kv", "fetch_kv_plan"]

# Bytes of one vector access; SHUFFLE interleaves in 16-byte units.
_VECTOR_BYTES = 16
# Requests scanned per step of a program's request lookup.
_MAX_REQ_STEP = 1024
# Bytes per side a program aims to move (with 4 warps, copy bandwidth on H200).
_TILE_BYTES = 8192
_MAX_PAGES_PER_PROGRAM = 8
_NUM_WARPS = 4
# A plan row: out_first, lo, hi, 0, the block id of each page of the item.
_PLAN_HEADER = 4
_PLAN_NUM_WARPS = 1
_INT32_MAX = 2**31 - 1

_FP8_DTYPES: tuple = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
_FP8_DTYPES += (torch.float8_e5m2fnuz,)
_DEQUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


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


def _pages_per_program(block_size, head_size, cache_size, out_size, shuffle) -> int:
    """Pages a program moves: ~_TILE_BYTES a side (SHUFFLE: 1, keeping V vectors)."""
    if shuffle:
        return 1
    side_bytes = block_size * head_size * max(cache_size, out_size)
    pages = 1 << (max(1, _TILE_BYTES // side_bytes).bit_length() - 1)
    return min(_MAX_PAGES_PER_PROGRAM, pages)


def _num_warps(warp_size, rows, head_size, cache_size, out_size) -> int:
    """_NUM_WARPS, fewer where a thread would move less than a 16-byte vector."""
    elements = rows * next_power_of_2(head_size)
    vectors = elements * min(cache_size, out_size) // _VECTOR_BYTES
    warps = max(1, min(_NUM_WARPS, vectors // warp_size))
    return 1 << (warps.bit_length() - 1)


@functools.cache
def _gpu_warp_size() -> int:
    return triton.runtime.driver.active.get_current_target().warp_size


def _plan_width(pages_per_program: int) -> int:
    return next_power_of_2(_PLAN_HEADER + pages_per_program)


def _req_step(num_reqs: int) -> int:
    """REQ_STEP, bucketed: a power of four in 16 .. 1024 (four variants)."""
    step = 16
    while step <= num_reqs and step < _MAX_REQ_STEP:
        step *= 4
    return min(step, _MAX_REQ_STEP)


@dataclass
class FetchKVPlan:
    """One batch's ``fetch_kv`` work, built once per step (``fetch_kv_plan``)
    and passed to every layer's ``fetch_kv``.

    ``table``: the int32 work-item rows (``None``: the copy finds each item's
    request itself, from the metadata); the sizes and dtypes are what the
    layers' tensors are checked against; ``copies``: the copy launch of each
    layer geometry (cache and output strides, heads) met in this step.
    """

    block_table: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    seq_starts: torch.Tensor
    table: torch.Tensor | None
    num_tokens: int  # upper bound on cu_seqlens_kv[-1]
    num_reqs: int
    num_items: int
    block_size: int
    head_size: int
    cache_dtype: torch.dtype
    out_dtype: torch.dtype
    kv_cache_layout: str
    pages_per_program: int
    copies: dict[tuple, KernelCall] = field(default_factory=dict, repr=False)


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
    build_table: bool = True,
) -> FetchKVPlan:
    """Check one batch's metadata and precompute ``fetch_kv``'s work items
    (graph-capturable, no host sync).

    For the ``fetch_kv`` calls with these metadata values, ``num_tokens`` (a
    bound on ``cu_seqlens_kv[-1]``), block size, head size, dtypes and layout.
    ``out``: an int32 buffer (a larger plan's table) to use.
    ``build_table=False``: launch nothing; the copies look their items up.
    """
    fn = "fetch_kv_plan"
    out_dtype = out_dtype or cache_dtype
    if kv_cache_layout not in ("NHD", "SHUFFLE"):
        raise ValueError(f"{fn}: unknown kv_cache_layout {kv_cache_layout!r}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"{fn}: block_size must be a power of two, got {block_size}")
    if not 0 <= num_tokens <= _INT32_MAX:
        raise ValueError(f"{fn}: num_tokens {num_tokens} out of range")
    # (The dtypes only size the work items: each layer's are checked by
    # fetch_kv, the cache often being a uint8 allocation viewed as fp8.)
    for name, t in (
        ("block_table", block_table),
        ("cu_seqlens_kv", cu_seqlens_kv),
        ("seq_starts", seq_starts),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{fn}: {name} must be an int32 or int64 tensor")
    (num_reqs,) = seq_starts.shape
    assert cu_seqlens_kv.shape == (num_reqs + 1,), f"{fn}: cu_seqlens_kv length"
    assert block_table.dim() == 2, f"{fn}: block_table must be 2-D"
    assert block_table.shape[0] >= num_reqs, f"{fn}: block_table has too few rows"
    device = seq_starts.device
    if not block_table.device == cu_seqlens_kv.device == device:
        raise ValueError(f"{fn}: the request metadata must be on {device}")

    pages_per_program = _pages_per_program(
        block_size,
        head_size,
        cache_dtype.itemsize,
        out_dtype.itemsize,
        kv_cache_layout != "NHD",
    )
    num_items = num_tokens // (pages_per_program * block_size) + 2 * num_reqs
    width = _plan_width(pages_per_program)
    table = None
    if build_table and out is None:
        table = block_table.new_empty((num_items, width), dtype=torch.int32)
    elif build_table and out is not None:
        if not (
            out.dtype == torch.int32
            and out.shape[0] >= num_items
            and out.shape[1:] == (width,)
        ):
            raise ValueError(f"{fn}: out must be int32 [>= {num_items}, {width}]")
        assert out.stride() == (width, 1), f"{fn}: out rows must be dense"
        table = out[:num_items]
    if table is not None and num_items:
        # Once per step: through kernel[grid] (a KernelCall pays off over a
        # step's layers).
        _fetch_kv_plan_kernel[(num_items,)](
            plan_ptr=table,
            block_table_ptr=block_table,
            cu_seqlens_ptr=cu_seqlens_kv,
            seq_starts_ptr=seq_starts,
            num_reqs=num_reqs,
            stride_bt_req=block_table.stride(0),
            stride_bt_blk=block_table.stride(1),
            stride_cu=cu_seqlens_kv.stride(0),
            stride_ss=seq_starts.stride(0),
            PAGE=block_size,
            PAGES_PER_PROGRAM=pages_per_program,
            PLAN_WIDTH=width,
            PLAN_HEADER=_PLAN_HEADER,
            REQ_STEP=_req_step(num_reqs),
            num_warps=_PLAN_NUM_WARPS,
        )
    return FetchKVPlan(
        block_table=block_table,
        cu_seqlens_kv=cu_seqlens_kv,
        seq_starts=seq_starts,
        table=table,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_items=num_items,
        block_size=block_size,
        head_size=head_size,
        cache_dtype=cache_dtype,
        out_dtype=out_dtype,
        kv_cache_layout=kv_cache_layout,
        pages_per_program=pages_per_program,
    )


def _copy_call(
    plan: FetchKVPlan,
    key_cache,
    value_cache,
    key_out,
    value_out,
    seq_starts,
    kv_cache_layout,
    max_num_tokens,
) -> KernelCall:
    """The copy launch of one layer geometry of ``plan``'s step, after
    checking the layer's tensors against the plan's work items (the step's
    first call of each layer geometry)."""
    fn = "fetch_kv"
    if max_num_tokens not in (None, plan.num_tokens):
        raise ValueError(f"{fn}: max_num_tokens {max_num_tokens} is not the plan's")
    if kv_cache_layout != plan.kv_cache_layout:
        raise ValueError(f"{fn}: kv_cache_layout is not the plan's")
    if seq_starts.shape != (plan.num_reqs,):
        raise ValueError(
            f"{fn}: a plan for {plan.num_reqs} requests; the call has "
            f"{tuple(seq_starts.shape)} seq_starts"
        )
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    if (block_size, head_size) != (plan.block_size, plan.head_size):
        raise ValueError(
            f"{fn}: a plan for block size {plan.block_size}, head size "
            f"{plan.head_size}; the cache has {block_size}, {head_size}"
        )
    cache_dtype = key_cache.dtype
    out_dtype = key_out.dtype
    if value_cache.dtype != cache_dtype or value_out.dtype != out_dtype:
        raise TypeError(f"{fn}: K and V must have the same cache and output dtypes")
    if cache_dtype != out_dtype and not (
        cache_dtype in _FP8_DTYPES and out_dtype in _DEQUANT_DTYPES
    ):
        raise TypeError(
            f"{fn}: cannot fetch a {cache_dtype} cache into {out_dtype}: the "
            "dtypes must match, or the cache be fp8 (not uint8) and the outputs float"
        )
    assert value_cache.shape == key_cache.shape, f"{fn}: K/V cache shapes differ"
    assert value_out.shape == key_out.shape, f"{fn}: K/V output shapes differ"
    assert key_out.shape[1:] == (num_kv_heads, head_size), f"{fn}: output H, D"
    if not plan.num_tokens <= key_out.shape[0]:
        raise ValueError(
            f"{fn}: the plan covers {plan.num_tokens} tokens (max_num_tokens); "
            f"the outputs hold {key_out.shape[0]}"
        )
    device = plan.seq_starts.device
    assert key_cache.device == value_cache.device == device, f"{fn}: cache device"
    assert key_out.device == value_out.device == device, f"{fn}: output device"
    if plan.table is not None and num_blocks > _INT32_MAX:
        raise ValueError(f"{fn}: a plan holds int32 block ids")
    shuffle = plan.kv_cache_layout == "SHUFFLE"
    pages_per_program = _pages_per_program(
        plan.block_size,
        plan.head_size,
        cache_dtype.itemsize,
        out_dtype.itemsize,
        shuffle,
    )
    if pages_per_program != plan.pages_per_program:
        raise ValueError(
            f"{fn}: a plan for {plan.pages_per_program} pages per program; "
            f"{cache_dtype} into {out_dtype} needs {pages_per_program}"
        )
    if shuffle:
        x = _VECTOR_BYTES // cache_dtype.itemsize
        dense = (num_kv_heads * head_size, head_size, 1)
        if (
            head_size % x
            or block_size % x
            or not (key_cache.stride()[1:] == value_cache.stride()[1:] == dense)
        ):
            raise ValueError(
                f"{fn}: SHUFFLE needs dense cache blocks (strides [*, H * D, "
                f"D, 1]) and head_size and block_size multiples of x = {x}"
            )

    cache_size = cache_dtype.itemsize
    out_size = out_dtype.itemsize
    rows = plan.pages_per_program * plan.block_size
    warp_size = _gpu_warp_size() if key_cache.is_cuda else 32
    with_table = plan.table is not None
    return KernelCall(
        _fetch_kv_kernel,
        (plan.num_items * num_kv_heads,),
        # With a plan table the kernel reads no request metadata.
        block_table_ptr=None if with_table else plan.block_table,
        cu_seqlens_ptr=None if with_table else plan.cu_seqlens_kv,
        seq_starts_ptr=None if with_table else plan.seq_starts,
        plan_ptr=plan.table,
        num_reqs=plan.num_reqs,
        num_kv_heads=num_kv_heads,
        stride_bt_req=plan.block_table.stride(0),
        stride_bt_blk=plan.block_table.stride(1),
        stride_cu=plan.cu_seqlens_kv.stride(0),
        stride_ss=plan.seq_starts.stride(0),
        stride_kc_blk=key_cache.stride(0),
        stride_kc_slot=key_cache.stride(1),
        stride_kc_head=key_cache.stride(2),
        stride_kc_dim=key_cache.stride(3),
        stride_vc_blk=value_cache.stride(0),
        stride_vc_slot=value_cache.stride(1),
        stride_vc_head=value_cache.stride(2),
        stride_vc_dim=value_cache.stride(3),
        stride_ko_tok=key_out.stride(0),
        stride_ko_head=key_out.stride(1),
        stride_ko_dim=key_out.stride(2),
        stride_vo_tok=value_out.stride(0),
        stride_vo_head=value_out.stride(1),
        stride_vo_dim=value_out.stride(2),
        HEAD_SIZE=plan.head_size,
        BLOCK_D=next_power_of_2(plan.head_size),
        PAGE=plan.block_size,
        PAGES_PER_PROGRAM=plan.pages_per_program,
        SHUFFLE=shuffle,
        X=_VECTOR_BYTES // cache_size if shuffle else 1,
        DEQUANT=cache_dtype != out_dtype,
        PLAN=with_table,
        PLAN_WIDTH=_plan_width(plan.pages_per_program),
        PLAN_HEADER=_PLAN_HEADER,
        REQ_STEP=_req_step(plan.num_reqs),
        num_warps=_num_warps(warp_size, rows, plan.head_size, cache_size, out_size),
    )


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

    Metadata (int32/int64): ``block_table`` ``[>= num_reqs, max_blocks]``,
    ``cu_seqlens_kv`` ``[num_reqs + 1]`` output row offsets, ``seq_starts``
    ``[num_reqs]``.  ``k_scale`` / ``v_scale``: one-element float32, for an fp8 cache.
    ``max_num_tokens``: host bound on ``cu_seqlens_kv[-1]`` sizing the grid.
    ``plan``: ``fetch_kv_plan`` of the step (built once for all its layers):
    the metadata arguments are then the plan's and are not read again; this
    call checks only its own tensors against the plan.
    """
    if plan is None:
        _, block_size, _, head_size = key_cache.shape
        plan = fetch_kv_plan(
            block_table,
            cu_seqlens_kv,
            seq_starts,
            num_tokens=key_out.shape[0] if max_num_tokens is None else max_num_tokens,
            block_size=block_size,
            head_size=head_size,
            cache_dtype=key_cache.dtype,
            out_dtype=key_out.dtype,
            kv_cache_layout=kv_cache_layout,
            build_table=False,
        )
    elif not isinstance(plan, FetchKVPlan):
        raise TypeError("fetch_kv: plan must be a FetchKVPlan (fetch_kv_plan)")

    # This layer's tensors against the plan: checked by the step's first call
    # of each geometry, which builds the copy launch the others reuse.
    geometry = (
        key_cache.shape,
        key_cache.stride(),
        value_cache.shape,
        value_cache.stride(),
        key_out.shape,
        key_out.stride(),
        value_out.shape,
        value_out.stride(),
        key_cache.dtype,
        value_cache.dtype,
        key_out.dtype,
        value_out.dtype,
        kv_cache_layout,
        max_num_tokens,
    )
    copy = plan.copies.get(geometry)
    if copy is None:
        copy = _copy_call(
            plan,
            key_cache,
            value_cache,
            key_out,
            value_out,
            seq_starts,
            kv_cache_layout,
            max_num_tokens,
        )
        plan.copies[geometry] = copy
    dequant = copy.fixed["DEQUANT"]
    if dequant and not (_float32_scalar(k_scale) and _float32_scalar(v_scale)):
        raise ValueError(
            "fetch_kv: an fp8 cache needs one-element k_scale/v_scale (float32)"
        )
    if plan.num_tokens == 0 or plan.num_reqs == 0:
        return
    copy(
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        key_out_ptr=key_out,
        value_out_ptr=value_out,
        k_scale_ptr=k_scale if dequant else None,
        v_scale_ptr=v_scale if dequant else None,
    )


def _float32_scalar(scale) -> bool:
    return (
        isinstance(scale, torch.Tensor)
        and scale.dtype == torch.float32
        and scale.numel() == 1
    )
