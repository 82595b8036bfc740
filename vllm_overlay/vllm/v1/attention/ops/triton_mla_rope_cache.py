# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused RoPE + MLA KV-cache write (DeepSeek-style multi-head latent attention).

One launch replaces "rotary embedding on ``q_pe`` / ``k_pe``, then
``concat_and_cache_mla``, then (decode) ``torch.cat([ql_nope, q_pe])``".

Two entry points:

  * ``mla_rope_concat_and_cache`` (decode form): returns
    ``q_out[t, h] = [ql_nope[t, h] | rope(q_pe[t, h])]`` and writes the cache;
    its inputs are not modified.
  * ``mla_rope_and_cache`` (prefill form): rotates ``q_pe`` and ``k_pe`` in
    place (they may be strided views such as ``q[..., P:]``) and writes the
    cache.

Layouts (``T`` tokens, ``H`` query heads, ``L`` = kv_lora_rank, ``R`` =
rotary dim, even):

  * ``ql_nope``  ``[T, H, L]``   q_nope already multiplied by W_UK (any token /
                                 head strides, last stride 1).
  * ``q_pe``     ``[T, H, R]``   rotary part of q (any token / head strides,
                                 last stride 1).
  * ``kv_c``     ``[T, L]``      normalised latent (token stride free).
  * ``k_pe``     ``[T, R]`` or ``[T, 1, R]`` (token stride free).
  * ``kv_cache`` ``[num_blocks, block_size, L + R]``; row of a token =
                 ``[kv_c | rope(k_pe)]``.  Block / slot strides are free.
  * ``slot_mapping`` ``[S]`` int32 / int64, ``S <= T``: cache slot of token
                 ``t`` (block ``slot // block_size``, row ``slot % block_size``).
                 ``slot < 0`` (padding) and tokens ``t >= S`` (CUDA-graph
                 padding past the real tokens) write nothing to the cache.
  * ``positions`` ``[T]`` int32 / int64, each in ``[0, max_pos)``.
  * ``cos_sin_cache`` ``[max_pos, R]`` fp32 / fp16 / bf16, vLLM's layout:
                 ``cat(cos, sin)`` on the last dim, ``R / 2`` entries each.
  * ``q_out``    ``[T, H, L + R]`` (decode form; allocated when not given; any
                 token / head strides, last stride 1).

RoPE runs in fp32 and the result is rounded to the model dtype (the dtype of
``q_pe``), exactly the value the unfused rotary embedding would hand to the
cache write.  NeoX style (``is_neox=True``) rotates the halves
``(x[:R/2], x[R/2:])``, GPT-J style (DeepSeek-V2/V3) the interleaved pairs
``(x[0::2], x[1::2])``; pair ``i`` uses ``cos[i]``, ``sin[i]``:
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``.

``kv_cache_dtype`` takes vLLM's strings: ``"auto"`` / ``"bfloat16"`` /
``"float16"`` (the cache has the model dtype; values are copied, bit-exact),
``"fp8"`` / ``"fp8_e4m3"`` (e4m3) and ``"fp8_e5m2"``.  An fp8 cache may be an
fp8 tensor or uint8 as vLLM allocates it; uint8 is read as the platform's e4m3
type (``current_platform.fp8_dtype()``) or e5m2.  fp8 values are
``value / k_scale`` (IEEE fp32 division) saturated to the type's finite range
and rounded to nearest-even, as vLLM's ``concat_and_cache_mla`` does; the
decode form quantises ``q_out`` the same way with ``q_scale`` when ``q_scale``
is given.  Scales are one-element fp32 tensors read on the device, so a
captured CUDA graph picks up new values.

Design: grid ``(token blocks, head blocks + 1)``.  Programs with axis-1 index
below the head-block count handle ``BLOCK_T`` tokens x ``BLOCK_H`` heads of q
(decode: the ``ql_nope`` copy and the rotated ``q_pe`` into ``q_out``;
prefill: ``q_pe`` rotated in place); the last column of programs writes the
cache rows (and, for prefill, ``k_pe``) of its ``BLOCK_T`` tokens.  cos/sin are
loaded once per token and broadcast over heads; GPT-J pairs are split and
re-joined in registers so every load and store is a contiguous vector.  A
program issues its bulk loads (q / kv_c / k_pe) before the small dependent
ones (slot, position -> cos/sin), so their DRAM latencies overlap.  FMA
contraction is off: ``x1 cos - x2 sin`` rounds like the unfused fp32 RoPE and
both forms write identical cache bytes.  All token, head, block and slot
offsets are computed in 64 bits.  No host synchronisation: both forms are
CUDA-graph capturable.

Host cost: a layer calls one form per step and token kind, 61 times a step
for DeepSeek-V3; both check their arguments once per launch key (shapes,
strides, dtypes, devices, ``is_neox``, ``kv_cache_dtype``;
``triton_launcher.LaunchCache``) and launch through the compiled kernel.  The
rows' slots, positions and cos/sin cache are the same tensors in every layer:
``mla_rope_rows`` reads their geometry once per step (``rows=``).
"""

from dataclasses import dataclass, field

import torch

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.attention.ops.triton_launcher import (
    KernelLaunch,
    LaunchCache,
    fast_path,
    tensor_geometry,
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

# Elements of q (``BLOCK_T * BLOCK_H * row width``) one program moves.  8K
# elements (decode: 16 heads x 512+64 of one token; prefill: 8 tokens x 16
# heads x 64) keep 16-byte vectors in flight in every thread without spilling
# and give a decode batch of T tokens ``T * H / 16`` programs.
_Q_TILE_ELEMS = 8192

# Most heads one program handles (the head block is also bounded by
# _Q_TILE_ELEMS).  16 = heads per GPU of DeepSeek-V3 at TP 8.
_MAX_BLOCK_H = 16

# The prefill form shrinks BLOCK_T until there are at least this many token
# blocks (or BLOCK_T is 1), so short batches still spread over the SMs.
_MIN_TOKEN_BLOCKS = 128

# Warps per program: tiles of at least _BIG_TILE_ELEMS elements use 8 warps,
# smaller ones 4 (32 or fewer elements per thread either way).
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


# --------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------


def decode_q_out_shape(
    ql_nope: torch.Tensor, q_pe: torch.Tensor
) -> tuple[int, int, int]:
    """Shape of the decode form's ``q_out``: ``[T, H, L + R]``."""
    return (ql_nope.shape[0], ql_nope.shape[1], ql_nope.shape[2] + q_pe.shape[2])


def decode_q_out_dtype(
    ql_nope: torch.Tensor, q_scale: torch.Tensor | None
) -> torch.dtype:
    """Dtype of the ``q_out`` the decode form allocates.

    fp8 when ``q_scale`` is given, else the query dtype.
    """
    return current_platform.fp8_dtype() if q_scale is not None else ql_nope.dtype


def _require(cond: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    if not cond:
        raise exc(msg)


def _check_tensor(name: str, t, dims: int | tuple[int, ...]) -> None:
    _require(
        isinstance(t, torch.Tensor),
        f"{name} must be a torch.Tensor, got {type(t).__name__}",
        TypeError,
    )
    dims = (dims,) if isinstance(dims, int) else dims
    _require(
        t.dim() in dims,
        f"{name} must have {' or '.join(map(str, dims))} dims, "
        f"got shape {tuple(t.shape)}",
    )


def _check_scale(name: str, scale, device: torch.device) -> None:
    _require(scale is not None, f"{name} is required for an fp8 output")
    _require(
        isinstance(scale, torch.Tensor),
        f"{name} must be a one-element float32 tensor, got {type(scale).__name__}",
        TypeError,
    )
    _require(
        scale.dtype == torch.float32,
        f"{name} must be float32, got {scale.dtype}",
        TypeError,
    )
    _require(
        scale.numel() == 1,
        f"{name} must have one element, got shape {tuple(scale.shape)}",
    )
    _require(scale.device == device, f"{name} is on {scale.device}, expected {device}")


def _cache_store_view(
    kv_cache: torch.Tensor, kv_cache_dtype: str, model_dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """The cache as the kernel stores into it, and the fp8 saturation bound.

    The bound is 0 for non-fp8 caches.
    """
    _require(
        isinstance(kv_cache_dtype, str), "kv_cache_dtype must be a string", TypeError
    )
    if kv_cache_dtype in _UNQUANTIZED_CACHE_DTYPES:
        _require(
            kv_cache.dtype == model_dtype,
            f'kv_cache_dtype "{kv_cache_dtype}" needs a {model_dtype} cache, '
            f"got {kv_cache.dtype}",
            TypeError,
        )
        return kv_cache, 0.0
    if kv_cache_dtype in _E4M3_CACHE_DTYPES:
        family, default = _E4M3_DTYPES, current_platform.fp8_dtype()
    elif kv_cache_dtype in _E5M2_CACHE_DTYPES:
        family, default = _E5M2_DTYPES, torch.float8_e5m2
    else:
        raise ValueError(
            f'unsupported kv_cache_dtype "{kv_cache_dtype}"; expected one of '
            f"{_UNQUANTIZED_CACHE_DTYPES + _E4M3_CACHE_DTYPES + _E5M2_CACHE_DTYPES}"
        )
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(default)
    _require(
        kv_cache.dtype in family,
        f'kv_cache_dtype "{kv_cache_dtype}" needs a uint8 cache or one of {family}, '
        f"got {kv_cache.dtype}",
        TypeError,
    )
    return kv_cache, _FP8_MAX[kv_cache.dtype]


def _check_common(
    q_pe,
    kv_c,
    k_pe,
    kv_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    kv_cache_dtype,
    k_scale,
):
    """Validate the arguments both forms share; returns normalised views."""
    _check_tensor("q_pe", q_pe, 3)
    _check_tensor("kv_c", kv_c, 2)
    _check_tensor("k_pe", k_pe, (2, 3))
    _check_tensor("kv_cache", kv_cache, 3)
    _check_tensor("slot_mapping", slot_mapping, 1)
    _check_tensor("positions", positions, 1)
    _check_tensor("cos_sin_cache", cos_sin_cache, 2)

    device = q_pe.device
    for name, t in (
        ("kv_c", kv_c),
        ("k_pe", k_pe),
        ("kv_cache", kv_cache),
        ("slot_mapping", slot_mapping),
        ("positions", positions),
        ("cos_sin_cache", cos_sin_cache),
    ):
        _require(
            t.device == device, f"{name} is on {t.device}, expected {device} (as q_pe)"
        )

    dtype = q_pe.dtype
    _require(
        dtype in _MODEL_DTYPES,
        f"q_pe must be one of {_MODEL_DTYPES}, got {dtype}",
        TypeError,
    )
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        _require(
            t.dtype == dtype,
            f"{name} dtype {t.dtype} differs from q_pe dtype {dtype}",
            TypeError,
        )
    _require(
        cos_sin_cache.dtype in _MODEL_DTYPES,
        f"cos_sin_cache must be one of {_MODEL_DTYPES}, got {cos_sin_cache.dtype}",
        TypeError,
    )
    for name, t in (("slot_mapping", slot_mapping), ("positions", positions)):
        _require(
            t.dtype in _INDEX_DTYPES,
            f"{name} must be int32 or int64, got {t.dtype}",
            TypeError,
        )

    if k_pe.dim() == 3:
        _require(
            k_pe.shape[1] == 1,
            f"k_pe must be [T, R] or [T, 1, R], got {tuple(k_pe.shape)}",
        )
        k_pe = k_pe.select(1, 0)  # a view: in-place rotation still reaches the caller

    num_tokens, _, rot_dim = q_pe.shape
    lora_rank = kv_c.shape[1]
    _require(
        rot_dim > 0 and rot_dim % 2 == 0, f"rotary dim must be even, got {rot_dim}"
    )
    _require(lora_rank > 0, "kv_c must have a non-empty last dim")
    _require(
        k_pe.shape == (num_tokens, rot_dim),
        f"k_pe must be [T={num_tokens}, R={rot_dim}], got {tuple(k_pe.shape)}",
    )
    _require(
        kv_c.shape[0] == num_tokens,
        f"kv_c has {kv_c.shape[0]} tokens, q_pe has {num_tokens}",
    )
    _require(
        positions.shape[0] == num_tokens,
        f"positions has {positions.shape[0]} tokens, q_pe has {num_tokens}",
    )
    _require(
        slot_mapping.shape[0] <= num_tokens,
        f"slot_mapping has {slot_mapping.shape[0]} entries, more than the "
        f"{num_tokens} tokens",
    )
    _require(
        kv_cache.shape[2] == lora_rank + rot_dim,
        f"kv_cache rows are {kv_cache.shape[2]} wide, expected L + R = "
        f"{lora_rank} + {rot_dim}",
    )
    _require(
        cos_sin_cache.shape[1] == rot_dim,
        f"cos_sin_cache must be [max_pos, R={rot_dim}], "
        f"got {tuple(cos_sin_cache.shape)}",
    )
    for name, t in (
        ("q_pe", q_pe),
        ("kv_c", kv_c),
        ("k_pe", k_pe),
        ("kv_cache", kv_cache),
        ("cos_sin_cache", cos_sin_cache),
    ):
        _require(
            t.stride(-1) == 1 or t.shape[-1] == 1,
            f"{name} must have a unit stride on its last dim, got strides {t.stride()}",
        )
    for name, t in (("slot_mapping", slot_mapping), ("positions", positions)):
        _require(t.stride(0) == 1 or t.shape[0] <= 1, f"{name} must be contiguous")

    cache_view, kv_fp8_max = _cache_store_view(kv_cache, kv_cache_dtype, dtype)
    if kv_fp8_max > 0:
        _check_scale("k_scale", k_scale, device)
    return k_pe, cache_view, kv_fp8_max


def _pow2(n: int) -> int:
    return next_power_of_2(int(n))


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _tile_config(
    num_tokens: int, num_heads: int, lora_rank: int, rot_dim: int, decode: bool
) -> tuple[int, int, int, int, int]:
    """``(BLOCK_L, BLOCK_HALF, BLOCK_T, BLOCK_H, num_warps)`` of one launch.

    The same on every target (the AMD compile tier, scripts/compile_tier,
    checks the result on gfx942, gfx950 and sm_90); a pure function of the
    shapes, called by the launch path and the compile tier.
    """
    block_l = _pow2(lora_rank)
    block_half = _pow2(rot_dim // 2)
    # Widest per-head row a q program tiles: the ql_nope copy (decode) or q_pe.
    row_elems = block_l if decode else 2 * block_half
    block_h = min(
        _pow2(num_heads), _MAX_BLOCK_H, _pow2_floor(_Q_TILE_ELEMS // row_elems)
    )
    block_t = (
        1
        if decode
        else min(
            _pow2_floor(_Q_TILE_ELEMS // (block_h * row_elems)),
            _pow2_floor(max(1, num_tokens // _MIN_TOKEN_BLOCKS)),
        )
    )
    tile = max(block_t * block_h * row_elems, block_t * (block_l + 2 * block_half))
    return block_l, block_half, block_t, block_h, 8 if tile >= _BIG_TILE_ELEMS else 4


def _kernel_launch(
    *,
    q_pe,
    q_out,
    kv_c,
    k_pe,
    cache,
    slot_mapping,
    cos_sin_cache,
    is_neox,
    kv_fp8_max,
    q_fp8_max,
    decode,
    ql_nope=None,
) -> KernelLaunch:
    """The kernel's launch for these (checked) arguments.

    Call it with ``(ql_nope, q_pe, q_out, kv_c, k_pe, cache, slot_mapping,
    positions, cos_sin_cache, k_scale, q_scale)``; pointers the form does not
    read must still be tensors (``q_pe`` / ``positions`` stand in).
    """
    num_tokens, num_heads, rot_dim = q_pe.shape
    lora_rank = kv_c.shape[1]
    block_l, block_half, block_t, block_h, num_warps = _tile_config(
        num_tokens, num_heads, lora_rank, rot_dim, decode
    )
    grid = (cdiv(num_tokens, block_t), cdiv(num_heads, block_h) + 1)
    # Strides of the pointers the chosen form does not read: those of q_pe.
    ql_nope = q_pe if ql_nope is None else ql_nope
    q_out = q_pe if q_out is None else q_out
    return KernelLaunch(
        _mla_rope_cache_kernel,
        grid,
        (
            num_tokens,
            slot_mapping.shape[0],
            num_heads,
            cache.shape[1],
            ql_nope.stride(0),
            ql_nope.stride(1),
            q_pe.stride(0),
            q_pe.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            kv_c.stride(0),
            k_pe.stride(0),
            cache.stride(0),
            cache.stride(1),
            cos_sin_cache.stride(0),
        ),
        dict(
            L=lora_rank,
            HALF=rot_dim // 2,
            BLOCK_L=block_l,
            BLOCK_HALF=block_half,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            IS_NEOX=bool(is_neox),
            DECODE=decode,
            Q_FP8_MAX=q_fp8_max,
            KV_FP8_MAX=kv_fp8_max,
        ),
        num_warps=num_warps,
        # No FMA contraction: x1 cos - x2 sin rounds like the unfused fp32
        # RoPE, and both forms (separately compiled) write identical bytes.
        enable_fp_fusion=False,
    )


@dataclass(frozen=True, eq=False)
class MLARopeRows:
    """One step's per-token metadata of a kind of rows, shared by every layer.

    Made by ``mla_rope_rows``: the rows' ``slot_mapping`` and ``positions``
    and the ``cos_sin_cache``.  A call of either form that passes these very
    tensors (the same objects) with ``rows=`` takes their geometry from
    ``key`` instead of reading it again; other tensors are read (and checked)
    as without ``rows``.  Compared by identity.
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    # Their launch-key part (None: not tensors; the calls say what is wrong).
    key: tuple | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        try:
            key = tuple(
                tensor_geometry(t)
                for t in (self.slot_mapping, self.positions, self.cos_sin_cache)
            )
        except AttributeError:
            return
        object.__setattr__(self, "key", key)


def mla_rope_rows(
    slot_mapping: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> MLARopeRows:
    """Bind one step's rows' metadata for every layer's call (``rows=``)."""
    return MLARopeRows(slot_mapping, positions, cos_sin_cache)


class MLARopeStepRows:
    """What every fused layer of one forward shares: its positions, slot
    mapping and cos/sin cache, and per kind of rows their slices and
    ``MLARopeRows`` (made on first use).  From ``mla_rope_step_rows``."""

    __slots__ = ("given_positions", "slot_mapping", "num_tokens", "cos_sin_cache",
                 "positions", "_rows")  # fmt: skip

    def __init__(self, positions, slot_mapping, num_tokens, cos_sin_cache):
        self.given_positions = positions
        self.slot_mapping = slot_mapping
        self.num_tokens = num_tokens
        self.cos_sin_cache = cos_sin_cache
        self.positions = positions[:num_tokens]
        self._rows: dict = {}

    def rows(self, start: int, end: int):
        """(slots, positions, MLARopeRows) of rows ``start:end``."""
        rows = self._rows.get((start, end))
        if rows is None:
            slots = self.slot_mapping[start:end]
            positions = self.positions[start:end]
            rows = self._rows[(start, end)] = (
                slots, positions, MLARopeRows(slots, positions, self.cos_sin_cache)
            )  # fmt: skip
        return rows


# The last forward's rows: the next layer of the same forward finds its own
# tensors (the same objects) there.  Kept eager only (a traced forward has fake
# tensors).  Only views are kept, so a capture's rows are safe to reuse.
_LAST_STEP_ROWS: list = [None]


def mla_rope_step_rows(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    cos_sin_cache: torch.Tensor,
) -> MLARopeStepRows:
    """The rows of a forward over ``num_tokens`` tokens: the previous call's
    when it got these very tensors (the layers of one forward), else new.
    While torch.compile traces, always new (the traced code never reads or
    guards on the eager calls' rows)."""
    if torch.compiler.is_compiling():
        return MLARopeStepRows(positions, slot_mapping, num_tokens, cos_sin_cache)
    last = _LAST_STEP_ROWS[0]
    if (
        last is not None
        and last.given_positions is positions
        and last.slot_mapping is slot_mapping
        and last.num_tokens == num_tokens
        and last.cos_sin_cache is cos_sin_cache
    ):
        return last
    rows = _LAST_STEP_ROWS[0] = MLARopeStepRows(
        positions, slot_mapping, num_tokens, cos_sin_cache
    )
    return rows


def _common_key(
    q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache, is_neox,
    kv_cache_dtype, k_scale, rows,
):  # fmt: skip
    """Launch-key part of the arguments both forms take (raises
    AttributeError / TypeError for non-tensors: the checks say what is wrong)."""
    if (
        rows is not None
        and rows.key is not None
        and slot_mapping is rows.slot_mapping
        and positions is rows.positions
        and cos_sin_cache is rows.cos_sin_cache
    ):
        meta = rows.key
    else:
        meta = (
            tensor_geometry(slot_mapping),
            tensor_geometry(positions),
            tensor_geometry(cos_sin_cache),
        )
    return (
        q_pe.shape, q_pe.stride(), q_pe.dtype, q_pe.device,
        kv_c.shape, kv_c.stride(), kv_c.dtype, kv_c.device,
        k_pe.shape, k_pe.stride(), k_pe.dtype, k_pe.device,
        kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
        meta, is_neox, type(is_neox), kv_cache_dtype,
        None if k_scale is None
        else (k_scale.shape, k_scale.dtype, k_scale.device),
    )  # fmt: skip


# Checked launches of the two forms by key: (KernelLaunch, or None when there
# are no tokens; the dtype the cache is stored as; decode: q_out's dtype when
# the call allocates it).
_DECODE_LAUNCHES = LaunchCache()
_PREFILL_LAUNCHES = LaunchCache()


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

    See the module docstring for layouts.  Returns ``q_out`` ``[T, H, L + R]``
    (the given one, or a new tensor: model dtype, or the platform's e4m3 fp8
    type divided by ``q_scale`` when ``q_scale`` is given).  Inputs are not
    modified; rows of padded tokens in ``q_out`` are computed all the same.
    ``rows``: optionally ``mla_rope_rows(slot_mapping, positions,
    cos_sin_cache)`` of this step (read once for all layers).
    """
    bound = key = None
    if fast_path():
        try:
            key = _common_key(
                q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache,
                is_neox, kv_cache_dtype, k_scale, rows,
            ) + (
                ql_nope.shape, ql_nope.stride(), ql_nope.dtype, ql_nope.device,
                None if q_out is None
                else (q_out.shape, q_out.stride(), q_out.dtype, q_out.device),
                None if q_scale is None
                else (q_scale.shape, q_scale.dtype, q_scale.device),
            )  # fmt: skip
            bound = _DECODE_LAUNCHES.get(key)
        except (AttributeError, TypeError):  # not tensors, unhashable: checked below
            key = None
    if bound is None:
        bound = _DECODE_LAUNCHES.bind(
            key, _bind_decode, ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
            positions, cos_sin_cache, is_neox, kv_cache_dtype, k_scale, q_out, q_scale,
        )  # fmt: skip
    launch, cache_dtype, q_out_dtype = bound
    if q_out is None:
        q_out = torch.empty(
            decode_q_out_shape(ql_nope, q_pe), dtype=q_out_dtype, device=q_pe.device
        )
    if launch is not None:
        # (An fp8 cache allocated as uint8 is stored through its fp8 view.)
        cache = (
            kv_cache if kv_cache.dtype is cache_dtype else kv_cache.view(cache_dtype)
        )
        launch(
            ql_nope, q_pe, q_out, kv_c, k_pe, cache, slot_mapping, positions,
            cos_sin_cache, positions if k_scale is None else k_scale,
            positions if q_scale is None else q_scale,
        )  # fmt: skip
    return q_out


def _bind_decode(
    ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache,
    is_neox, kv_cache_dtype, k_scale, q_out, q_scale,
):  # fmt: skip
    """Check the decode form's arguments; return what its launch key fixes."""
    k_pe, cache, kv_fp8_max = _check_common(
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        kv_cache_dtype,
        k_scale,
    )
    _check_tensor("ql_nope", ql_nope, 3)
    num_tokens, num_heads, rot_dim = q_pe.shape
    lora_rank = kv_c.shape[1]
    _require(
        ql_nope.device == q_pe.device,
        f"ql_nope is on {ql_nope.device}, expected {q_pe.device}",
    )
    _require(
        ql_nope.dtype == q_pe.dtype,
        f"ql_nope dtype {ql_nope.dtype} differs from q_pe dtype {q_pe.dtype}",
        TypeError,
    )
    _require(
        ql_nope.shape == (num_tokens, num_heads, lora_rank),
        f"ql_nope must be [T={num_tokens}, H={num_heads}, L={lora_rank}], "
        f"got {tuple(ql_nope.shape)}",
    )
    _require(ql_nope.stride(-1) == 1, "ql_nope must have a unit stride on its last dim")

    q_fp8_max = 0.0
    if q_scale is not None:
        _check_scale("q_scale", q_scale, q_pe.device)
    q_out_dtype = decode_q_out_dtype(ql_nope, q_scale)
    if q_out is not None:
        _check_tensor("q_out", q_out, 3)
        _require(
            q_out.device == q_pe.device,
            f"q_out is on {q_out.device}, expected {q_pe.device}",
        )
        _require(
            q_out.shape == (num_tokens, num_heads, lora_rank + rot_dim),
            f"q_out must be [T={num_tokens}, H={num_heads}, "
            f"L+R={lora_rank + rot_dim}], "
            f"got {tuple(q_out.shape)}",
        )
        _require(q_out.stride(-1) == 1, "q_out must have a unit stride on its last dim")
        if q_scale is None:
            _require(
                q_out.dtype == q_pe.dtype,
                f"q_out must be {q_pe.dtype} (or fp8 with q_scale), got {q_out.dtype}",
                TypeError,
            )
        else:
            _require(
                q_out.dtype in _FP8_MAX,
                f"q_scale is given, so q_out must be an fp8 tensor, got {q_out.dtype}",
                TypeError,
            )
    if q_scale is not None:
        q_fp8_max = _FP8_MAX[q_out_dtype if q_out is None else q_out.dtype]
    if num_tokens == 0 or num_heads == 0:
        return None, cache.dtype, q_out_dtype
    launch = _kernel_launch(
        ql_nope=ql_nope,
        q_pe=q_pe,
        q_out=q_out
        if q_out is not None
        else torch.empty(decode_q_out_shape(ql_nope, q_pe), device="meta"),
        kv_c=kv_c,
        k_pe=k_pe,
        cache=cache,
        slot_mapping=slot_mapping,
        cos_sin_cache=cos_sin_cache,
        is_neox=is_neox,
        kv_fp8_max=kv_fp8_max,
        q_fp8_max=q_fp8_max,
        decode=True,
    )
    return launch, cache.dtype, q_out_dtype


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

    See the module docstring for layouts.  Every one of the ``T`` tokens is
    rotated; only tokens with a slot ``>= 0`` are written to the cache.
    ``rows`` as for ``mla_rope_concat_and_cache``.
    """
    bound = key = None
    if fast_path():
        try:
            key = _common_key(
                q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache,
                is_neox, kv_cache_dtype, k_scale, rows,
            )  # fmt: skip
            bound = _PREFILL_LAUNCHES.get(key)
        except (AttributeError, TypeError):  # not tensors, unhashable: checked below
            key = None
    if bound is None:
        bound = _PREFILL_LAUNCHES.bind(
            key, _bind_prefill, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions,
            cos_sin_cache, is_neox, kv_cache_dtype, k_scale,
        )  # fmt: skip
    launch, cache_dtype = bound
    if launch is not None:
        cache = (
            kv_cache if kv_cache.dtype is cache_dtype else kv_cache.view(cache_dtype)
        )
        launch(
            q_pe, q_pe, q_pe, kv_c, k_pe, cache, slot_mapping, positions, cos_sin_cache,
            positions if k_scale is None else k_scale, positions,
        )  # fmt: skip


def _bind_prefill(
    q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache, is_neox,
    kv_cache_dtype, k_scale,
):  # fmt: skip
    """Check the prefill form's arguments; return what its launch key fixes."""
    k_pe, cache, kv_fp8_max = _check_common(
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        kv_cache_dtype,
        k_scale,
    )
    if q_pe.shape[0] == 0:
        return None, cache.dtype
    launch = _kernel_launch(
        q_pe=q_pe,
        q_out=None,
        kv_c=kv_c,
        k_pe=k_pe,
        cache=cache,
        slot_mapping=slot_mapping,
        cos_sin_cache=cos_sin_cache,
        is_neox=is_neox,
        kv_fp8_max=kv_fp8_max,
        q_fp8_max=0.0,
        decode=False,
    )
    return launch, cache.dtype
