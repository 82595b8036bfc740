# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused RoPE + MLA KV-cache write (DeepSeek-style multi-head latent attention).

One launch for RoPE, ``concat_and_cache_mla`` and (decode) the query concat:
``mla_rope_concat_and_cache`` returns ``q_out = [ql_nope | rope(q_pe)]``,
``mla_rope_and_cache`` (prefill) rotates ``q_pe`` / ``k_pe`` in place; both
write the cache rows.

Layouts (``T`` tokens, ``H`` heads, ``L`` = kv_lora_rank, ``R`` even rotary
dim; last strides 1, other strides free): ``ql_nope`` ``[T, H, L]``, ``q_pe``
``[T, H, R]``, ``kv_c`` ``[T, L]``, ``k_pe`` ``[T, R]`` or ``[T, 1, R]``,
``kv_cache`` ``[num_blocks, block_size, L + R]`` (a token's row: ``[kv_c |
rope(k_pe)]``), ``q_out`` ``[T, H, L + R]``, contiguous int32 / int64
``slot_mapping`` ``[S <= T]`` and ``positions`` ``[T]``, ``cos_sin_cache``
``[max_pos, R]`` (vLLM's ``cat(cos, sin)``).  Tokens with ``slot < 0`` or
``t >= S`` (CUDA-graph padding) write no cache row.

RoPE runs in fp32, rounded to the model dtype as the unfused rotary embedding
would (NeoX style: the halves; GPT-J style, DeepSeek's: interleaved pairs).
``kv_cache_dtype`` is vLLM's: "auto" / "bfloat16" / "float16" copy bit-exact;
"fp8" / "fp8_e4m3" / "fp8_e5m2" store ``value / k_scale`` saturated, rounded
to nearest-even, as ``concat_and_cache_mla`` (a uint8 cache is the platform's
e4m3 type or e5m2); with ``q_scale`` the decode form quantises ``q_out``
likewise.  Scales are one-element fp32 tensors read on the device.

Grid ``(token blocks, head blocks + 1)``, the last column the cache rows (and
prefill's ``k_pe``); no FMA contraction, 64-bit offsets, no host sync.  Checks
are cached (``cached_launch``); what every layer passes alike once per step
(``rows=``, ``mla_rope_rows``).
"""

from dataclasses import dataclass

import torch

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.attention.ops.triton_launcher import (
    KernelLaunch,
    OptionalTensors4,
    Tensors3,
    Tensors4,
    cached_launch,
)

__all__ = [
    "MLARopeRows",
    "MLARopeStepRows",
    "decode_q_out_dtype",
    "decode_q_out_shape",
    "mla_rope_and_cache",
    "mla_rope_concat_and_cache",
    "mla_rope_rows",
    "mla_rope_step_rows",
]

# Elements of q (``BLOCK_T * BLOCK_H * row width``) one program moves: 16-byte
# vectors in flight in every thread without spilling; a decode batch of T
# tokens gets ``T * H / 16`` programs.
_Q_TILE_ELEMS = 8192
# Most heads one program handles: DeepSeek-V3's heads per GPU at TP 8.
_MAX_BLOCK_H = 16
# Prefill shrinks BLOCK_T to have at least this many token blocks (or BLOCK_T 1).
_MIN_TOKEN_BLOCKS = 128
# Tiles of at least this many elements use 8 warps, smaller ones 4.
_BIG_TILE_ELEMS = 4096

_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_UNQUANTIZED_CACHE_DTYPES = ("auto", "bfloat16", "float16")
_E4M3_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_E5M2_CACHE_DTYPES = ("fp8_e5m2",)

# Largest finite value of each fp8 type: fp8 results saturate to +-this.
_FP8_MAX = {
    getattr(torch, name): float(torch.finfo(getattr(torch, name)).max)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
}
_E4M3_DTYPES = tuple(d for d in _FP8_MAX if "e4m3" in str(d))
_E5M2_DTYPES = tuple(d for d in _FP8_MAX if "e5m2" in str(d))


@triton.jit
def _load_pairs(
    ptr,
    row,
    row_mask,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Load the rotary pairs of ``[D0, D1]`` vectors starting at ``ptr + row``.

    ``row`` / ``row_mask`` are ``[D0, D1, 1]``; returns ``(x1, x2)`` as fp32
    ``[D0, D1, BLOCK_HALF]`` (first / second element of each pair).
    """
    if IS_NEOX:
        i = tl.arange(0, BLOCK_HALF)[None, None, :]
        mask = row_mask & (i < HALF)
        x1 = tl.load(ptr + row + i, mask=mask, other=0.0)
        x2 = tl.load(ptr + row + HALF + i, mask=mask, other=0.0)
    else:
        j = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        x = tl.load(ptr + row + j, mask=row_mask & (j < 2 * HALF), other=0.0)
        x1, x2 = tl.split(tl.reshape(x, (D0, D1, BLOCK_HALF, 2)))
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _store_pairs(
    ptr,
    row,
    row_mask,
    o1,
    o2,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Inverse of ``_load_pairs``: store pairs ``(o1, o2)`` (already converted)."""
    if IS_NEOX:
        i = tl.arange(0, BLOCK_HALF)[None, None, :]
        mask = row_mask & (i < HALF)
        tl.store(ptr + row + i, o1, mask=mask)
        tl.store(ptr + row + HALF + i, o2, mask=mask)
    else:
        j = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        o = tl.reshape(tl.join(o1, o2), (D0, D1, 2 * BLOCK_HALF))
        tl.store(ptr + row + j, o, mask=row_mask & (j < 2 * HALF))


@triton.jit
def _fp8_saturate(x, scale, FP8_MAX: tl.constexpr):
    """``x / scale`` (IEEE fp32 division) clamped to the fp8 type's finite range."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)


@triton.jit
def _cos_sin(
    positions_ptr,
    cos_sin_ptr,
    tok64,
    tok_ok,
    stride_cs_p,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Cos / sin of each token's position as fp32 ``[BLOCK_T, 1, BLOCK_HALF]``."""
    pos = tl.load(positions_ptr + tok64, mask=tok_ok, other=0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = tok_ok[:, None] & (i < HALF)[None, :]
    ptr = cos_sin_ptr + pos[:, None] * stride_cs_p + i[None, :]
    cos = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    return cos[:, None, :], sin[:, None, :]


@triton.jit
def _q_heads(
    ql_nope_ptr,
    q_pe_ptr,
    q_out_ptr,
    q_scale_ptr,
    positions_ptr,
    cos_sin_ptr,
    tok64,
    tok_ok,
    head,
    num_heads,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_qo_t,
    stride_qo_h,
    stride_cs_p,
    L: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DECODE: tl.constexpr,
    Q_FP8_MAX: tl.constexpr,
):
    """Q of BLOCK_T tokens x BLOCK_H heads.

    Decode writes q_out; prefill rotates q_pe in place.
    """
    model_ty = q_pe_ptr.dtype.element_ty
    head64 = head.to(tl.int64)
    th_mask = (tok_ok[:, None] & (head < num_heads)[None, :])[:, :, None]
    # The bulk loads go first; positions -> cos/sin (a dependent load pair) after.
    if DECODE:
        qn_row = (tok64[:, None] * stride_qn_t + head64[None, :] * stride_qn_h)[
            :, :, None
        ]
        l_off = tl.arange(0, BLOCK_L)[None, None, :]
        l_mask = th_mask & (l_off < L)
        nope = tl.load(ql_nope_ptr + qn_row + l_off, mask=l_mask)
    qp_row = (tok64[:, None] * stride_qp_t + head64[None, :] * stride_qp_h)[:, :, None]
    x1, x2 = _load_pairs(
        q_pe_ptr, qp_row, th_mask, HALF, BLOCK_HALF, BLOCK_T, BLOCK_H, IS_NEOX
    )
    cos, sin = _cos_sin(
        positions_ptr, cos_sin_ptr, tok64, tok_ok, stride_cs_p, HALF, BLOCK_HALF
    )
    o1 = (x1 * cos - x2 * sin).to(model_ty)
    o2 = (x2 * cos + x1 * sin).to(model_ty)
    if DECODE:
        out_ty = q_out_ptr.dtype.element_ty
        qo_row = (tok64[:, None] * stride_qo_t + head64[None, :] * stride_qo_h)[
            :, :, None
        ]
        if Q_FP8_MAX > 0:
            q_scale = tl.load(q_scale_ptr)
            nope = _fp8_saturate(nope, q_scale, Q_FP8_MAX)
            o1 = _fp8_saturate(o1, q_scale, Q_FP8_MAX)
            o2 = _fp8_saturate(o2, q_scale, Q_FP8_MAX)
        tl.store(q_out_ptr + qo_row + l_off, nope.to(out_ty), mask=l_mask)
        _store_pairs(
            q_out_ptr + L,
            qo_row,
            th_mask,
            o1.to(out_ty),
            o2.to(out_ty),
            HALF,
            BLOCK_HALF,
            BLOCK_T,
            BLOCK_H,
            IS_NEOX,
        )
    else:
        _store_pairs(
            q_pe_ptr,
            qp_row,
            th_mask,
            o1,
            o2,
            HALF,
            BLOCK_HALF,
            BLOCK_T,
            BLOCK_H,
            IS_NEOX,
        )


@triton.jit
def _cache_rows(
    kv_c_ptr,
    k_pe_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    positions_ptr,
    cos_sin_ptr,
    tok,
    tok64,
    tok_ok,
    num_slots,
    block_size,
    stride_kvc_t,
    stride_kpe_t,
    stride_cache_b,
    stride_cache_s,
    stride_cs_p,
    L: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DECODE: tl.constexpr,
    KV_FP8_MAX: tl.constexpr,
):
    """Cache rows ``[kv_c | rope(k_pe)]`` of BLOCK_T tokens.

    The prefill form also rotates k_pe in place.
    """
    model_ty = k_pe_ptr.dtype.element_ty
    # The bulk loads go first (masked by token bounds only, so they do not wait
    # for the slot load); slots, positions and cos/sin after.
    l_off = tl.arange(0, BLOCK_L)
    kvc = tl.load(
        kv_c_ptr + tok64[:, None] * stride_kvc_t + l_off[None, :],
        mask=tok_ok[:, None] & (l_off < L)[None, :],
    )
    kpe_row = (tok64 * stride_kpe_t)[:, None, None]
    t_mask = tok_ok[:, None, None]
    x1, x2 = _load_pairs(
        k_pe_ptr, kpe_row, t_mask, HALF, BLOCK_HALF, BLOCK_T, 1, IS_NEOX
    )
    slot = tl.load(slot_mapping_ptr + tok64, mask=tok < num_slots, other=-1).to(
        tl.int64
    )
    cos, sin = _cos_sin(
        positions_ptr, cos_sin_ptr, tok64, tok_ok, stride_cs_p, HALF, BLOCK_HALF
    )
    o1 = (x1 * cos - x2 * sin).to(model_ty)
    o2 = (x2 * cos + x1 * sin).to(model_ty)
    if not DECODE:
        _store_pairs(
            k_pe_ptr, kpe_row, t_mask, o1, o2, HALF, BLOCK_HALF, BLOCK_T, 1, IS_NEOX
        )

    write = tok_ok & (slot >= 0)
    cache_row = (slot // block_size) * stride_cache_b + (
        slot % block_size
    ) * stride_cache_s
    kv_mask = write[:, None] & (l_off < L)[None, :]
    if KV_FP8_MAX > 0:
        k_scale = tl.load(k_scale_ptr)
        kvc = _fp8_saturate(kvc, k_scale, KV_FP8_MAX)
        o1 = _fp8_saturate(o1, k_scale, KV_FP8_MAX)
        o2 = _fp8_saturate(o2, k_scale, KV_FP8_MAX)
    cache_ty = kv_cache_ptr.dtype.element_ty
    tl.store(
        kv_cache_ptr + cache_row[:, None] + l_off[None, :],
        kvc.to(cache_ty),
        mask=kv_mask,
    )
    _store_pairs(
        kv_cache_ptr + L,
        cache_row[:, None, None],
        write[:, None, None],
        o1.to(cache_ty),
        o2.to(cache_ty),
        HALF,
        BLOCK_HALF,
        BLOCK_T,
        1,
        IS_NEOX,
    )


@triton.jit(
    do_not_specialize=["num_tokens", "num_slots", "num_heads"],
    do_not_specialize_on_alignment=[
        "slot_mapping_ptr",
        "positions_ptr",
        "k_scale_ptr",
        "q_scale_ptr",
    ],
)
def _mla_rope_cache_kernel(
    ql_nope_ptr,  # [T, H, L]        (decode form only)
    q_pe_ptr,  # [T, H, R]
    q_out_ptr,  # [T, H, L + R]      (decode form only)
    kv_c_ptr,  # [T, L]
    k_pe_ptr,  # [T, R]
    kv_cache_ptr,  # [num_blocks, block_size, L + R]
    slot_mapping_ptr,  # [num_slots]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, R]
    k_scale_ptr,  # [1] fp32          (fp8 cache only)
    q_scale_ptr,  # [1] fp32          (fp8 q_out only)
    num_tokens,
    num_slots,
    num_heads,
    block_size,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_qo_t,
    stride_qo_h,
    stride_kvc_t,
    stride_kpe_t,
    stride_cache_b,
    stride_cache_s,
    stride_cs_p,
    L: tl.constexpr,
    HALF: tl.constexpr,  # R // 2
    BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DECODE: tl.constexpr,  # decode form: write q_out, leave q_pe / k_pe alone
    Q_FP8_MAX: tl.constexpr,  # > 0: q_out is fp8, quantised with q_scale
    KV_FP8_MAX: tl.constexpr,  # > 0: cache is fp8, quantised with k_scale
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    tok64 = tok.to(tl.int64)
    num_head_blocks = (num_heads + BLOCK_H - 1) // BLOCK_H
    if pid_h < num_head_blocks:
        _q_heads(
            ql_nope_ptr,
            q_pe_ptr,
            q_out_ptr,
            q_scale_ptr,
            positions_ptr,
            cos_sin_ptr,
            tok64,
            tok_ok,
            pid_h * BLOCK_H + tl.arange(0, BLOCK_H),
            num_heads,
            stride_qn_t,
            stride_qn_h,
            stride_qp_t,
            stride_qp_h,
            stride_qo_t,
            stride_qo_h,
            stride_cs_p,
            L,
            HALF,
            BLOCK_L,
            BLOCK_HALF,
            BLOCK_T,
            BLOCK_H,
            IS_NEOX,
            DECODE,
            Q_FP8_MAX,
        )
    else:
        _cache_rows(
            kv_c_ptr,
            k_pe_ptr,
            kv_cache_ptr,
            slot_mapping_ptr,
            k_scale_ptr,
            positions_ptr,
            cos_sin_ptr,
            tok,
            tok64,
            tok_ok,
            num_slots,
            block_size,
            stride_kvc_t,
            stride_kpe_t,
            stride_cache_b,
            stride_cache_s,
            stride_cs_p,
            L,
            HALF,
            BLOCK_L,
            BLOCK_HALF,
            BLOCK_T,
            IS_NEOX,
            DECODE,
            KV_FP8_MAX,
        )


def decode_q_out_shape(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple:
    """Shape of the decode form's ``q_out``: ``[T, H, L + R]``."""
    return (ql_nope.shape[0], ql_nope.shape[1], ql_nope.shape[2] + q_pe.shape[2])


def decode_q_out_dtype(ql_nope: torch.Tensor, q_scale) -> torch.dtype:
    """Dtype of the decode form's new ``q_out``: fp8 e4m3 with ``q_scale``."""
    return current_platform.fp8_dtype() if q_scale is not None else ql_nope.dtype


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _tile_config(
    num_tokens: int, num_heads: int, lora_rank: int, rot_dim: int, decode: bool
) -> tuple[int, int, int, int, int]:
    """``(BLOCK_L, BLOCK_HALF, BLOCK_T, BLOCK_H, num_warps)`` of one launch:
    a pure function of the shapes, the same on every target (the compile
    tier, scripts/compile_tier, checks it on gfx942, gfx950 and sm_90)."""
    block_l = next_power_of_2(lora_rank)
    block_half = next_power_of_2(rot_dim // 2)
    # Widest per-head row a q program tiles: the ql_nope copy (decode) or q_pe.
    row_elems = block_l if decode else 2 * block_half
    by_tile = _pow2_floor(_Q_TILE_ELEMS // row_elems)
    block_h = min(next_power_of_2(num_heads), _MAX_BLOCK_H, by_tile)
    block_t = 1
    if not decode:
        by_tile = _pow2_floor(_Q_TILE_ELEMS // (block_h * row_elems))
        block_t = min(by_tile, _pow2_floor(max(1, num_tokens // _MIN_TOKEN_BLOCKS)))
    tile = max(block_t * block_h * row_elems, block_t * (block_l + 2 * block_half))
    return block_l, block_half, block_t, block_h, 8 if tile >= _BIG_TILE_ELEMS else 4


@dataclass(frozen=True, eq=False)
class _Rows:
    """What the checks of the rows' metadata found; one per geometry (keyed by
    identity)."""

    index_dtypes: tuple  # slot_mapping's and positions'
    num_slots: int
    num_positions: int
    rot_dim: int
    stride_cs: int
    device: torch.device
    is_neox: bool
    kv_cache_dtype: str


@cached_launch
def _check_rows(tensors: Tensors3, neox: bool, kv: str) -> _Rows:
    slot_mapping, positions, cos_sin_cache = tensors
    assert slot_mapping.dim() == positions.dim() == 1, "slot_mapping, positions: 1-D"
    assert slot_mapping.is_contiguous() and positions.is_contiguous(), "strided"
    cs_shape, cs_strides = cos_sin_cache.shape, cos_sin_cache.stride()
    assert len(cs_shape) == 2 and cs_strides[1] == 1, "cos_sin_cache: [.., R]"
    assert cos_sin_cache.dtype in _MODEL_DTYPES, "cos_sin_cache: a float type"
    device = positions.device
    assert slot_mapping.device == cos_sin_cache.device == device, "one device"
    dtypes = (slot_mapping.dtype, positions.dtype)
    sizes = (slot_mapping.shape[0], positions.shape[0], cs_shape[1], cs_strides[0])
    return _Rows(dtypes, *sizes, device, bool(neox), kv)


class MLARopeRows:
    """One step's slot mapping, positions and cos/sin cache of a kind of rows,
    checked once for calls passing these very tensors (``rows=``)."""

    __slots__ = ("slot_mapping", "positions", "cos_sin_cache", "checked")

    def __init__(self, slot_mapping, positions, cos_sin_cache):
        self.slot_mapping = slot_mapping
        self.positions = positions
        self.cos_sin_cache = cos_sin_cache
        self.checked: _Rows | None = None  # by the first call


def mla_rope_rows(
    slot_mapping: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> MLARopeRows:
    """Bind one step's rows' metadata for every layer's call (``rows=``)."""
    return MLARopeRows(slot_mapping, positions, cos_sin_cache)


def _rows(slot_mapping, positions, cos_sin_cache, neox, kv, rows) -> _Rows:
    """The shared arguments' checks (kept by ``rows`` holding these tensors)."""
    shared = (slot_mapping, positions, cos_sin_cache)
    mine = rows is not None and rows.slot_mapping is slot_mapping
    mine = mine and rows.positions is positions and rows.cos_sin_cache is cos_sin_cache
    if not mine:
        return _check_rows(shared, neox, kv)
    c = rows.checked
    if c is None or (c.is_neox, c.kv_cache_dtype) != (neox, kv):
        c = rows.checked = _check_rows(shared, neox, kv)
    return c


class MLARopeStepRows:
    """What every fused layer of one forward shares: its positions, slot
    mapping and cos/sin cache, and per kind of rows their slices and
    ``MLARopeRows`` (made on first use).  From ``mla_rope_step_rows``."""

    def __init__(self, positions, slot_mapping, num_tokens, cos_sin_cache):
        self.given_positions, self.slot_mapping = positions, slot_mapping
        self.num_tokens, self.cos_sin_cache = num_tokens, cos_sin_cache
        self.positions = positions[:num_tokens]
        self._rows: dict = {}

    def rows(self, start: int, end: int) -> tuple:
        """(slots, positions, MLARopeRows) of rows ``start:end``."""
        rows = self._rows.get((start, end))
        if rows is None:
            slots, positions = self.slot_mapping[start:end], self.positions[start:end]
            rows = (slots, positions, MLARopeRows(slots, positions, self.cos_sin_cache))
            self._rows[(start, end)] = rows
        return rows


# The last forward's rows, found by the next layer of the same forward (eager
# only: a traced forward has fake tensors).  Views only: safe in a capture.
_LAST_STEP_ROWS: list = [None]


def mla_rope_step_rows(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    cos_sin_cache: torch.Tensor,
) -> MLARopeStepRows:
    """The rows of a forward over ``num_tokens`` tokens: the previous call's
    when it got these very tensors (the layers of one forward), else new
    (always new while torch.compile traces)."""
    args = (positions, slot_mapping, num_tokens, cos_sin_cache)
    if torch.compiler.is_compiling():
        return MLARopeStepRows(*args)
    last = _LAST_STEP_ROWS[0]
    same = last is not None and last.given_positions is positions
    same = same and last.slot_mapping is slot_mapping and last.num_tokens == num_tokens
    if not (same and last.cos_sin_cache is cos_sin_cache):
        last = _LAST_STEP_ROWS[0] = MLARopeStepRows(*args)
    return last


def _check_scale(fn: str, name: str, scale) -> None:
    dtype = getattr(scale, "dtype", type(scale).__name__)
    if dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(f"{fn}: {name} must be a one-element float32 tensor: {dtype}")


def _cache_dtype(fn, kv_cache, kv_cache_dtype, dtype, k_scale):
    """The dtype the kernel stores the cache as, and its fp8 bound (0: not fp8)."""
    cache_dtype = kv_cache.dtype
    if kv_cache_dtype in _UNQUANTIZED_CACHE_DTYPES:
        if cache_dtype != dtype:
            raise TypeError(f'{fn}: kv_cache_dtype "{kv_cache_dtype}" needs {dtype}')
        return cache_dtype, 0.0
    if kv_cache_dtype in _E4M3_CACHE_DTYPES:
        fp8s, default = _E4M3_DTYPES, current_platform.fp8_dtype()
    elif kv_cache_dtype in _E5M2_CACHE_DTYPES:
        fp8s, default = _E5M2_DTYPES, torch.float8_e5m2
    else:
        raise ValueError(f"{fn}: unsupported kv_cache_dtype {kv_cache_dtype!r}")
    if cache_dtype == torch.uint8:
        cache_dtype = default
    if cache_dtype not in fp8s:
        raise TypeError(f"{fn}: {kv_cache_dtype} needs a uint8 cache or one of {fp8s}")
    _check_scale(fn, "k_scale", k_scale)
    return cache_dtype, _FP8_MAX[cache_dtype]


def _check(fn, q_pe, kv_c, k_pe, kv_cache, rows, k_scale, *decode_args):
    """Both forms' checks (decode: also ``ql_nope, q_out, q_scale``): the launch
    (None: nothing to do), the cache's stored dtype and a new ``q_out``'s."""
    decode = bool(decode_args)
    ql_nope, q_out, q_scale = decode_args or (q_pe, q_pe, None)  # prefill: stand-ins
    dtypes = (q_pe.dtype, kv_c.dtype, k_pe.dtype, ql_nope.dtype)
    dtype = dtypes[0]
    if dtype not in _MODEL_DTYPES or dtypes.count(dtype) != 4:
        raise TypeError(f"{fn}: q_pe, kv_c, k_pe, ql_nope need one of {_MODEL_DTYPES}")
    if not set(rows.index_dtypes) <= set(_INDEX_DTYPES):
        raise TypeError(f"{fn}: slot_mapping and positions must be int32 or int64")
    stored, kv_max = _cache_dtype(fn, kv_cache, rows.kv_cache_dtype, dtype, k_scale)

    # Shapes and strides: what would make the kernel read or write out of bounds.
    assert q_pe.dim() == 3, "q_pe must be [T, H, R]"
    tokens, heads, rot_dim = q_pe.shape
    assert kv_c.dim() == 2 and kv_c.shape[0] == tokens, "kv_c must be [T, L]"
    lora_rank = kv_c.shape[1]
    width = lora_rank + rot_dim
    assert lora_rank > 0 and rot_dim > 0 and rot_dim % 2 == 0, "rotary dim must be even"
    assert k_pe.shape in ((tokens, rot_dim), (tokens, 1, rot_dim)), "k_pe: [T(, 1), R]"
    cache_shape = kv_cache.shape
    assert len(cache_shape) == 3 and cache_shape[2] == width, "kv_cache: [.., L + R]"
    assert rows.rot_dim == rot_dim, "cos_sin_cache: [.., R]"
    assert rows.num_positions == tokens, "positions must be [T]"
    assert rows.num_slots <= tokens, "slot_mapping: [S <= T]"
    q_max = 0.0
    out_dtype = decode_q_out_dtype(ql_nope, q_scale)
    if decode:
        assert ql_nope.shape == (tokens, heads, lora_rank), "ql_nope must be [T, H, L]"
        if q_out is not None:
            assert q_out.shape == (tokens, heads, width), "q_out must be [T, H, L + R]"
        out = out_dtype if q_out is None else q_out.dtype
        if q_scale is not None:
            _check_scale(fn, "q_scale", q_scale)
            q_max = _FP8_MAX.get(out, 0.0)
            if not q_max:
                raise TypeError(f"{fn}: q_scale is given, so q_out must be fp8")
        elif out != dtype:
            raise TypeError(f"{fn}: q_out must be {dtype} (or fp8 with q_scale)")
    on = (ql_nope, q_pe, q_out, kv_c, k_pe, kv_cache, k_scale, q_scale)
    assert all(t is None or t.device == rows.device for t in on), "one device"
    qn, qp, kc, kp = ql_nope.stride(), q_pe.stride(), kv_c.stride(), k_pe.stride()
    qo = (heads * width, width, 1) if q_out is None else q_out.stride()
    cs = kv_cache.stride()
    assert qn[2] == qp[2] == qo[2] == kc[1] == kp[-1] == cs[2] == 1, "unit last stride"
    if tokens == 0 or (decode and heads == 0):
        return None, stored, out_dtype
    tile = _tile_config(tokens, heads, lora_rank, rot_dim, decode)
    block_l, block_half, block_t, block_h, warps = tile
    grid = (cdiv(tokens, block_t), cdiv(heads, block_h) + 1)
    sizes = (tokens, rows.num_slots, heads, cache_shape[1], qn[0], qn[1], qp[0], qp[1])
    scalars = sizes + (qo[0], qo[1], kc[0], kp[0], cs[0], cs[1], rows.stride_cs)
    dims = dict(L=lora_rank, HALF=rot_dim // 2, BLOCK_L=block_l, BLOCK_HALF=block_half)
    blocks = dict(BLOCK_T=block_t, BLOCK_H=block_h, IS_NEOX=rows.is_neox, DECODE=decode)
    flags = dict(Q_FP8_MAX=q_max, KV_FP8_MAX=kv_max, **dims, **blocks)
    # No FMA contraction: x1 cos - x2 sin rounds like the unfused fp32 RoPE,
    # and both forms (separately compiled) write identical bytes.
    options = dict(num_warps=warps, enable_fp_fusion=False)
    launch = KernelLaunch(_mla_rope_cache_kernel, grid, scalars, flags, **options)
    return launch, stored, out_dtype


# Each form's checks (decode: ql_nope, q_out, k_scale, q_scale; None: not read).
@cached_launch
def _mla_rope_concat_and_cache_launch(
    inputs: Tensors4, rows: _Rows, decode: OptionalTensors4
):
    ql_nope, q_out, k_scale, q_scale = decode
    args = (*inputs, rows, k_scale, ql_nope, q_out, q_scale)
    return _check("mla_rope_concat_and_cache", *args)


@cached_launch
def _mla_rope_and_cache_launch(
    inputs: Tensors4, rows: _Rows, k_scale: torch.Tensor | None
):
    return _check("mla_rope_and_cache", *inputs, rows, k_scale)


def mla_rope_concat_and_cache(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    rows: MLARopeRows | None = None,
) -> torch.Tensor:
    """Decode form: ``q_out = [ql_nope | rope(q_pe)]`` and the cache write.

    Returns ``q_out`` (the given one, or a new ``decode_q_out_dtype`` tensor);
    with ``q_scale`` it is fp8, divided by ``q_scale``.  Inputs are not
    modified; rows of padded tokens in ``q_out`` are computed all the same.
    ``rows``: this step's ``mla_rope_rows(slot_mapping, positions,
    cos_sin_cache)``, checked once for every layer.
    """
    meta = _rows(slot_mapping, positions, cos_sin_cache, is_neox, kv_cache_dtype, rows)
    if kv_cache_dtype in _UNQUANTIZED_CACHE_DTYPES:
        k_scale = None  # not read
    inputs, decode = (q_pe, kv_c, k_pe, kv_cache), (ql_nope, q_out, k_scale, q_scale)
    launch, cache_dtype, q_out_dtype = _mla_rope_concat_and_cache_launch(
        inputs, meta, decode
    )
    if q_out is None:
        q_out = ql_nope.new_empty(decode_q_out_shape(ql_nope, q_pe), dtype=q_out_dtype)
    if launch is not None:
        # An fp8 cache allocated as uint8 is stored through its fp8 view.
        if kv_cache.dtype is not cache_dtype:
            kv_cache = kv_cache.view(cache_dtype)
        k_scale = positions if k_scale is None else k_scale  # stand-ins
        q_scale = positions if q_scale is None else q_scale
        tensors = (ql_nope, q_pe, q_out, kv_c, k_pe, kv_cache, slot_mapping, positions)
        launch(*tensors, cos_sin_cache, k_scale, q_scale)
    return q_out


def mla_rope_and_cache(
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    rows: MLARopeRows | None = None,
) -> None:
    """Prefill form: rotate ``q_pe`` and ``k_pe`` in place and write the cache.

    Every one of the ``T`` tokens is rotated; only tokens with a slot ``>= 0``
    are written to the cache.  ``rows`` as for ``mla_rope_concat_and_cache``.
    """
    meta = _rows(slot_mapping, positions, cos_sin_cache, is_neox, kv_cache_dtype, rows)
    if kv_cache_dtype in _UNQUANTIZED_CACHE_DTYPES:
        k_scale = None  # not read
    inputs = (q_pe, kv_c, k_pe, kv_cache)
    launch, cache_dtype, _ = _mla_rope_and_cache_launch(inputs, meta, k_scale)
    if launch is not None:
        if kv_cache.dtype is not cache_dtype:
            kv_cache = kv_cache.view(cache_dtype)
        tensors = (q_pe, q_pe, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions)
        k_scale = positions if k_scale is None else k_scale
        launch(*tensors, cos_sin_cache, k_scale, positions)
