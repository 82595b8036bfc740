# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused RoPE + MLA KV-cache write (DeepSeek-style multi-head latent attention).

One launch for RoPE, ``concat_and_cache_mla`` and (decode) the query concat:
``mla_rope_concat_and_cache`` returns ``q_out = [ql_nope | rope(q_pe)]``,
``mla_rope_and_cache`` (prefill) rotates ``q_pe`` / ``k_pe`` in place; both
write the cache rows.

Layouts (``T`` tokens, ``H`` heads, ``L`` = kv_lora_rank, ``R`` even rotary
dim; last strides 1, other strides free): ``ql_nope`` ``[T, H, L]``, ``q_pe``
``[T, H, R]``, ``kv_c`` ``[>= T, L]``, ``k_pe`` ``[>= T, R]`` or ``[>= T, 1,
R]`` (their first ``T`` rows are read: a step's rows, its decode rows first,
need no slicing), ``kv_cache`` ``[num_blocks, block_size, L + R]`` (a
token's row: ``[kv_c | rope(k_pe)]``), ``q_out`` ``[T, H, L + R]``,
contiguous int32 / int64
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
prefill's ``k_pe``); no FMA contraction, 64-bit offsets, no host sync.  A call
checks the tensors it is given and launches; ``slot_mapping`` and
``positions`` are a step's rows, whose index dtype, layout and device the
caller checked once per step (``MLARopeStepRows`` in MLA's attention
metadata): here only their lengths are checked, as they bound what the kernel
reads.  The launch (a ``KernelCall``: grid, sizes, strides, constexprs) is
built by a step's first layer of a geometry and kept in the step's
``launches``; the step's other layers of that geometry launch it with their
tensors.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.attention.ops.triton_launch import KernelCall

__all__ = [
    "INDEX_DTYPES",
    "MLARopeLaunch",
    "decode_q_out_dtype",
    "decode_q_out_shape",
    "mla_rope_and_cache",
    "mla_rope_concat_and_cache",
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
# slot_mapping and positions (checked once per step, by their builder).
INDEX_DTYPES = (torch.int32, torch.int64)
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


class _Tile(NamedTuple):
    """A launch configuration of ``_mla_rope_cache_kernel``."""

    block_l: int
    block_half: int
    block_t: int  # tokens per program
    block_h: int  # heads per q program
    num_warps: int


def _tile_config(
    num_tokens: int, num_heads: int, lora_rank: int, rot_dim: int, decode: bool
) -> _Tile:
    """The tile of one launch: a pure function of the shapes, the same on
    every target (the compile tier, scripts/compile_tier, checks it on gfx942
    and gfx950)."""
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
    return _Tile(
        block_l=block_l,
        block_half=block_half,
        block_t=block_t,
        block_h=block_h,
        num_warps=8 if tile >= _BIG_TILE_ELEMS else 4,
    )


def _check_scale(fn: str, name: str, scale: torch.Tensor | None) -> None:
    dtype = getattr(scale, "dtype", type(scale).__name__)
    if dtype != torch.float32 or scale.numel() != 1:  # type: ignore[union-attr]
        raise TypeError(f"{fn}: {name} must be a one-element float32 tensor: {dtype}")


def _stored_cache_dtype(
    fn: str,
    kv_cache: torch.Tensor,
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    k_scale: torch.Tensor | None,
) -> torch.dtype:
    """The dtype the kernel stores the cache rows as (an fp8 cache allocated
    as uint8 is stored through its fp8 view)."""
    if kv_cache_dtype in _UNQUANTIZED_CACHE_DTYPES:
        if kv_cache.dtype != model_dtype:
            raise TypeError(
                f'{fn}: kv_cache_dtype "{kv_cache_dtype}" needs a {model_dtype} cache'
            )
        return kv_cache.dtype
    if kv_cache_dtype in _E4M3_CACHE_DTYPES:
        fp8_dtypes, allocated_as = _E4M3_DTYPES, current_platform.fp8_dtype()
    elif kv_cache_dtype in _E5M2_CACHE_DTYPES:
        fp8_dtypes, allocated_as = _E5M2_DTYPES, torch.float8_e5m2
    else:
        raise ValueError(f"{fn}: unsupported kv_cache_dtype {kv_cache_dtype!r}")
    stored = allocated_as if kv_cache.dtype == torch.uint8 else kv_cache.dtype
    if stored not in fp8_dtypes:
        raise TypeError(
            f"{fn}: {kv_cache_dtype} needs a uint8 cache or one of {fp8_dtypes}"
        )
    _check_scale(fn, "k_scale", k_scale)
    return stored


@dataclass(frozen=True)
class MLARopeLaunch:
    """One step's launch of one layer geometry (one form): the kernel's grid
    and every non-tensor argument fixed (``call``), the dtype the cache is
    stored as, and which scales the kernel reads.  Built by the step's first
    layer of that geometry and kept in the step's ``launches``."""

    call: KernelCall
    cache_dtype: torch.dtype
    reads_k_scale: bool
    reads_q_scale: bool


def _check_and_launch(
    fn: str,
    *,
    ql_nope: torch.Tensor | None,
    q_pe: torch.Tensor,
    q_out: torch.Tensor | None,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    launches: dict | None,
) -> torch.Tensor | None:
    """Check one layer's tensors and launch either form (decode: ``ql_nope``
    given; returns ``q_out``, new when None).  Everything that would make the
    kernel read or write out of bounds is checked before the launch.

    ``launches``: the step's launches by layer geometry (``MLARopeStepRows``
    keeps one per form).  A layer whose tensors have the geometry of one
    already there (the same shapes, strides and dtypes, so the same checks)
    launches it; otherwise the checks run and the launch is built and kept
    there."""
    key = launch = None
    # (A decode call without q_out allocates one: checked, never kept.)
    if launches is not None and (q_out is not None or ql_nope is None):
        key = (
            is_neox,
            kv_cache_dtype,
            None
            if ql_nope is None
            else (ql_nope.shape, ql_nope.stride(), ql_nope.dtype),
            None if q_out is None else (q_out.shape, q_out.stride(), q_out.dtype),
            q_pe.shape,
            q_pe.stride(),
            q_pe.dtype,
            kv_c.shape,
            kv_c.stride(),
            kv_c.dtype,
            k_pe.shape,
            k_pe.stride(),
            k_pe.dtype,
            kv_cache.shape,
            kv_cache.stride(),
            kv_cache.dtype,
            slot_mapping.shape,
            slot_mapping.dtype,
            positions.shape,
            positions.dtype,
            cos_sin_cache.shape,
            cos_sin_cache.stride(),
            cos_sin_cache.dtype,
            None if k_scale is None else k_scale.dtype,
            None if q_scale is None else q_scale.dtype,
        )
        launch = launches.get(key)
    if launch is None:
        decode = ql_nope is not None
        model_dtype = q_pe.dtype
        same = kv_c.dtype == k_pe.dtype == model_dtype
        if (
            model_dtype not in _MODEL_DTYPES
            or not same
            or (ql_nope is not None and ql_nope.dtype != model_dtype)
        ):
            raise TypeError(
                f"{fn}: q_pe, kv_c, k_pe, ql_nope need one of {_MODEL_DTYPES}, "
                "all alike"
            )
        if cos_sin_cache.dtype not in _MODEL_DTYPES:
            raise TypeError(f"{fn}: cos_sin_cache must be one of {_MODEL_DTYPES}")
        stored = _stored_cache_dtype(fn, kv_cache, kv_cache_dtype, model_dtype, k_scale)
        kv_fp8_max = _FP8_MAX.get(stored, 0.0)
        if not kv_fp8_max:
            k_scale = None  # not read

        assert q_pe.dim() == 3, f"{fn}: q_pe must be [T, H, R]"
        num_tokens, num_heads, rot_dim = q_pe.shape
        assert kv_c.dim() == 2 and kv_c.shape[0] >= num_tokens, f"{fn}: kv_c: [>= T, L]"
        lora_rank = kv_c.shape[1]
        width = lora_rank + rot_dim
        assert lora_rank > 0 and rot_dim > 0 and rot_dim % 2 == 0, (
            f"{fn}: rotary dim must be even"
        )
        assert k_pe.shape[0] >= num_tokens and k_pe.shape[1:] in (
            (rot_dim,),
            (1, rot_dim),
        ), f"{fn}: k_pe must be [>= T, R] or [>= T, 1, R]"
        assert kv_cache.dim() == 3 and kv_cache.shape[2] == width, (
            f"{fn}: kv_cache must be [num_blocks, block_size, L + R]"
        )
        assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rot_dim, (
            f"{fn}: cos_sin_cache must be [max_pos, R]"
        )
        assert positions.shape == (num_tokens,), f"{fn}: positions must be [T]"
        assert slot_mapping.dim() == 1 and slot_mapping.shape[0] <= num_tokens, (
            f"{fn}: slot_mapping: [S <= T]"
        )
        q_fp8_max = 0.0
        # Strides of the decode form's ql_nope and q_out (the prefill form
        # reads neither).
        stride_qn = stride_qo = (0, 0, 1)
        if ql_nope is not None:
            assert ql_nope.shape == (num_tokens, num_heads, lora_rank), (
                f"{fn}: ql_nope must be [T, H, L]"
            )
            if q_out is None:
                q_out = ql_nope.new_empty(
                    (num_tokens, num_heads, width),
                    dtype=decode_q_out_dtype(ql_nope, q_scale),
                )
            assert q_out.shape == (num_tokens, num_heads, width), (
                f"{fn}: q_out must be [T, H, L + R]"
            )
            if q_scale is not None:
                _check_scale(fn, "q_scale", q_scale)
                q_fp8_max = _FP8_MAX.get(q_out.dtype, 0.0)
                if not q_fp8_max:
                    raise TypeError(f"{fn}: q_scale is given, so q_out must be fp8")
            elif q_out.dtype != model_dtype:
                raise TypeError(
                    f"{fn}: q_out must be {model_dtype} (or fp8 with q_scale)"
                )
            stride_qn, stride_qo = ql_nope.stride(), q_out.stride()
        device = q_pe.device
        for t in (
            ql_nope,
            q_out,
            kv_c,
            k_pe,
            kv_cache,
            cos_sin_cache,
            k_scale,
            q_scale,
        ):
            assert t is None or t.device == device, f"{fn}: tensors on two devices"
        for t in (ql_nope, q_pe, q_out, kv_c, k_pe, kv_cache, cos_sin_cache):
            assert t is None or t.stride(-1) == 1, f"{fn}: unit last stride"
        if num_tokens == 0 or num_heads == 0:
            return q_out  # nothing to launch

        tile = _tile_config(num_tokens, num_heads, lora_rank, rot_dim, decode)
        grid = (cdiv(num_tokens, tile.block_t), cdiv(num_heads, tile.block_h) + 1)
        call = KernelCall(
            _mla_rope_cache_kernel,
            grid,
            num_tokens=num_tokens,
            num_slots=slot_mapping.shape[0],
            num_heads=num_heads,
            block_size=kv_cache.shape[1],
            stride_qn_t=stride_qn[0],
            stride_qn_h=stride_qn[1],
            stride_qp_t=q_pe.stride(0),
            stride_qp_h=q_pe.stride(1),
            stride_qo_t=stride_qo[0],
            stride_qo_h=stride_qo[1],
            stride_kvc_t=kv_c.stride(0),
            stride_kpe_t=k_pe.stride(0),
            stride_cache_b=kv_cache.stride(0),
            stride_cache_s=kv_cache.stride(1),
            stride_cs_p=cos_sin_cache.stride(0),
            L=lora_rank,
            HALF=rot_dim // 2,
            BLOCK_L=tile.block_l,
            BLOCK_HALF=tile.block_half,
            BLOCK_T=tile.block_t,
            BLOCK_H=tile.block_h,
            IS_NEOX=bool(is_neox),
            DECODE=decode,
            Q_FP8_MAX=q_fp8_max,
            KV_FP8_MAX=kv_fp8_max,
            num_warps=tile.num_warps,
            # No FMA contraction: x1 cos - x2 sin rounds like the unfused fp32
            # RoPE, and both forms (compiled separately) write identical bytes.
            enable_fp_fusion=False,
        )
        launch = MLARopeLaunch(
            call=call,
            cache_dtype=stored,
            reads_k_scale=bool(kv_fp8_max),
            reads_q_scale=bool(q_fp8_max),
        )
        if key is not None:
            launches[key] = launch  # type: ignore[index]
    if kv_cache.dtype != launch.cache_dtype:
        kv_cache = kv_cache.view(launch.cache_dtype)
    launch.call(
        ql_nope_ptr=ql_nope,
        q_pe_ptr=q_pe,
        q_out_ptr=q_out,
        kv_c_ptr=kv_c,
        k_pe_ptr=k_pe,
        kv_cache_ptr=kv_cache,
        slot_mapping_ptr=slot_mapping,
        positions_ptr=positions,
        cos_sin_ptr=cos_sin_cache,
        k_scale_ptr=k_scale if launch.reads_k_scale else None,
        q_scale_ptr=q_scale if launch.reads_q_scale else None,
    )
    return q_out


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
    launches: dict | None = None,
) -> torch.Tensor:
    """Decode form: ``q_out = [ql_nope | rope(q_pe)]`` and the cache write.

    ``launches``: the step's (``MLARopeStepRows.decode.launches``): the
    step's layers after the first of a geometry skip the checks and the
    launch's construction.  Returns ``q_out`` (the given one, or a new
    ``decode_q_out_dtype`` tensor);
    with ``q_scale`` it is fp8, divided by ``q_scale``.  Inputs are not
    modified; rows of padded tokens in ``q_out`` are computed all the same.
    """
    q_out = _check_and_launch(
        "mla_rope_concat_and_cache",
        ql_nope=ql_nope,
        q_pe=q_pe,
        q_out=q_out,
        kv_c=kv_c,
        k_pe=k_pe,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        is_neox=is_neox,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
        q_scale=q_scale,
        launches=launches,
    )
    assert q_out is not None
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
    launches: dict | None = None,
) -> None:
    """Prefill form: rotate ``q_pe`` and ``k_pe`` in place and write the cache.

    Every one of the ``T`` tokens is rotated; only tokens with a slot ``>= 0``
    are written to the cache.  ``launches``: as in the decode form.
    """
    _check_and_launch(
        "mla_rope_and_cache",
        ql_nope=None,
        q_pe=q_pe,
        q_out=None,
        kv_c=kv_c,
        k_pe=k_pe,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        is_neox=is_neox,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
        q_scale=None,
        launches=launches,
    )
