# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused MLA RoPE + KV-cache write (``triton_mla_rope_cache``) against torch.

Reference, computed independently in float64: "rotary embedding, then
``concat_and_cache_mla``, then ``torch.cat([ql_nope, q_pe])``".

What must hold (README "Test tiers": CPU = interpreter on tiny fp32/fp16
shapes, GPU = compiled at real sizes):
  * the ``ql_nope`` part of ``q_out`` and the ``kv_c`` part of each cache row
    are bit-exact (fp8: bit-exact to torch's ``(x / scale).clamp().to(fp8)``);
  * rotated parts are within one ulp of the model dtype plus the fp32
    evaluation error of ``x1 cos - x2 sin`` (one fp8 bucket for fp8);
  * cache rows of padded tokens (slot -1, or past the end of a short
    ``slot_mapping``) and every other cache byte are untouched;
  * the decode form leaves its inputs alone; the prefill form rotates
    ``q_pe`` / ``k_pe`` in place through strided views and nothing else;
  * bad arguments raise before anything is written.

The interpreter's fp8 conversion is wrong (it mis-rounds across binades), so
fp8 cases run on the GPU tier only.  GPU caches have at least 32,768 blocks
and more than 2**31 bytes, with a written slot in the last block.
"""

import functools
import itertools
import math
import re
from dataclasses import dataclass

import pytest
import torch

from vllm.v1.attention.ops.triton_mla_rope_cache import (
    decode_q_out_dtype,
    decode_q_out_shape,
    mla_rope_and_cache,
    mla_rope_concat_and_cache,
)

# Self-contained: these tests also ship to vLLM's tests/kernels/attention/.  They run
# on the GPU when there is one, else on the CPU under TRITON_INTERPRET=1; tests marked
# ``gpu`` need a GPU.
gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (compiled kernels, real sizes)"
)


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# Bytes the cache is filled with before a call; rows the call must not write
# are compared against it.
POISON_BYTE = 0xAB
# Width of the nope part of q in the prefill layout q = [q_nope | q_pe].
QK_NOPE_DIM = 128
# Unit roundoff of the fp32 evaluation of x1*cos - x2*sin; the kernel's error
# before rounding to the model dtype is at most 4 of these times
# |x1 cos| + |x2 sin| (two products, one sum, slack for FMA contraction).
FP32_U = 2.0**-24
FP32_EVAL_TERMS = 4.0
# GPU-tier cache size floor (blocks), and bytes the cache must exceed.
GPU_MIN_BLOCKS = 32768
GPU_MIN_CACHE_BYTES = 2**31 + 1


# ---------------------------------------------------------------------------
# RoPE caches
# ---------------------------------------------------------------------------


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.cache
def yarn_cos_sin_cache_cpu(
    rotary_dim: int,
    base: float,
    factor: float,
    original_max_pos: int,
    beta_fast: float,
    beta_slow: float,
    mscale: float,
    mscale_all_dim: float,
) -> torch.Tensor:
    """DeepSeek YaRN ``cat(cos, sin)`` cache ``[orig_max_pos * factor, R]``, float64."""
    half = rotary_dim // 2
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq_extra = base**-exps
    inv_freq_inter = inv_freq_extra / factor

    def correction_dim(num_rotations: float) -> float:
        return (
            rotary_dim
            * math.log(original_max_pos / (num_rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_weight = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    inv_freq = inv_freq_inter * (1 - extra_weight) + inv_freq_extra * extra_weight
    scale = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    t = torch.arange(int(original_max_pos * factor), dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def rope_cache(rotary_dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    if rotary_dim == 64:  # DeepSeek-V3: factor 40, original 4096 positions
        cache = yarn_cos_sin_cache_cpu(64, 10000.0, 40.0, 4096, 32, 1, 0.707, 0.0)
    else:  # same recipe, small: 256 positions
        cache = yarn_cos_sin_cache_cpu(rotary_dim, 10000.0, 4.0, 64, 32, 1, 0.707, 0.0)
    return cache.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    T: int
    H: int
    L: int
    R: int
    block_size: int
    dtype: torch.dtype
    neox: bool = False
    kv_cache_dtype: str = "auto"
    cache_storage: str = "uint8"  # fp8 caches: "uint8" (as vLLM allocates) or "fp8"
    q_fp8: bool = False
    slot_dtype: torch.dtype = torch.int64
    pos_dtype: torch.dtype = torch.int64
    cos_sin_dtype: torch.dtype = torch.float32
    pad_frac: float = 0.25  # fraction of tokens with slot -1
    short_slots: int = 0  # slot_mapping shorter than T by this many tokens
    num_seqs: int = 0  # 0: every token its own request (decode); else prefill sequences
    preallocated_q_out: bool = False
    on_gpu: bool = False


def _cases() -> list:
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    cpu = [
        Case("gptj_small_f32_bs16", 6, 3, 32, 16, 16, f32),
        Case(
            "neox_small_f16_bs1_i32slots",
            5,
            2,
            32,
            16,
            1,
            f16,
            neox=True,
            slot_dtype=torch.int32,
            pos_dtype=torch.int32,
        ),
        Case("gptj_deepseek_dims_f32_bs64", 3, 2, 512, 64, 64, f32),
        Case(
            "neox_deepseek_dims_f16_bs16_f16_cos",
            3,
            2,
            512,
            64,
            16,
            f16,
            neox=True,
            cos_sin_dtype=f16,
        ),
        Case("gptj_prefill_seqs_f16_bs16", 12, 2, 32, 16, 16, f16, num_seqs=2),
        Case(
            "gptj_graph_padding_short_slots_f32",
            6,
            3,
            32,
            16,
            16,
            f32,
            short_slots=2,
            preallocated_q_out=True,
        ),
        Case(
            "neox_odd_heads_no_padding_f32_bs64",
            4,
            5,
            48,
            24,
            64,
            f32,
            neox=True,
            pad_frac=0.0,
            slot_dtype=torch.int32,
        ),
        Case("gptj_non_pow2_dims_f32_bs16", 4, 3, 40, 12, 16, f32),
    ]
    gpu_cases = [
        Case("gpu_gptj_bf16_h16_bs64", 256, 16, 512, 64, 64, bf16),
        Case(
            "gpu_gptj_bf16_h128_bs16",
            64,
            128,
            512,
            64,
            16,
            bf16,
            slot_dtype=torch.int32,
        ),
        Case(
            "gpu_neox_fp16_h16_bs1",
            100,
            16,
            512,
            64,
            1,
            f16,
            neox=True,
            pos_dtype=torch.int32,
        ),
        Case("gpu_gptj_fp32_h8_bs16", 40, 8, 512, 64, 16, f32),
        Case("gpu_gptj_bf16_prefill_4k_bs64", 4096, 16, 512, 64, 64, bf16, num_seqs=3),
        Case(
            "gpu_gptj_bf16_bf16_cos_bs64",
            33,
            16,
            512,
            64,
            64,
            bf16,
            cos_sin_dtype=bf16,
            short_slots=5,
            preallocated_q_out=True,
        ),
        Case(
            "gpu_gptj_fp8_cache_uint8_bs64",
            128,
            16,
            512,
            64,
            64,
            bf16,
            kv_cache_dtype="fp8",
        ),
        Case(
            "gpu_neox_fp8_e4m3_cache_fp8_tensor_bs16",
            50,
            16,
            512,
            64,
            16,
            f16,
            neox=True,
            kv_cache_dtype="fp8_e4m3",
            cache_storage="fp8",
        ),
        Case(
            "gpu_gptj_fp8_cache_fp8_q_out_h128",
            32,
            128,
            512,
            64,
            64,
            bf16,
            kv_cache_dtype="fp8",
            q_fp8=True,
        ),
        Case(
            "gpu_gptj_fp8_e5m2_cache_bs64",
            64,
            16,
            512,
            64,
            64,
            bf16,
            kv_cache_dtype="fp8_e5m2",
        ),
        Case(
            "gpu_gptj_fp8_prefill_2k_bs64",
            2048,
            16,
            512,
            64,
            64,
            bf16,
            kv_cache_dtype="fp8",
            num_seqs=2,
            slot_dtype=torch.int32,
        ),
    ]
    return [pytest.param(c, id=c.name) for c in cpu] + [
        pytest.param(Case(**{**c.__dict__, "on_gpu": True}), id=c.name, marks=gpu)
        for c in gpu_cases
    ]


CASES = _cases()


def _fp8_cache_dtype(case: Case) -> torch.dtype:
    if case.kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if (
        torch.version.hip is not None
        and "gfx94" in torch.cuda.get_device_properties(0).gcnArchName
    ):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


@dataclass
class Inputs:
    q: torch.Tensor  # [T, H, QK_NOPE_DIM + R]; q_pe is its tail view
    q_pe: torch.Tensor
    ql_nope: torch.Tensor
    kv: torch.Tensor  # [T, L + R]; kv_c / k_pe are views of it
    kv_c: torch.Tensor
    k_pe: torch.Tensor  # [T, 1, R] view
    kv_cache: torch.Tensor
    slots: torch.Tensor  # the full [T] slots (-1 padding)
    slot_mapping: torch.Tensor  # what the kernel gets (maybe shorter)
    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_scale: torch.Tensor | None
    q_scale: torch.Tensor | None
    fp8_dtype: torch.dtype | None


def _num_blocks(case: Case, needed: int) -> int:
    if not case.on_gpu:
        return needed + 3
    elem = (
        1
        if case.kv_cache_dtype.startswith("fp8")
        else torch.finfo(case.dtype).bits // 8
    )
    row_bytes = case.block_size * (case.L + case.R) * elem
    return max(GPU_MIN_BLOCKS, needed + 1, -(-GPU_MIN_CACHE_BYTES // row_bytes))


def make_inputs(case: Case, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    T, H, L, R, bs = case.T, case.H, case.L, case.R, case.block_size
    cos_sin = rope_cache(R, case.cos_sin_dtype, device)
    max_pos = cos_sin.shape[0]

    # Requests and positions: decode = one token per request at a random
    # position; prefill = num_seqs runs of consecutive positions.  One token
    # always sits at max_pos - 1.
    if case.num_seqs == 0:
        seq_of = torch.arange(T)
        pos = torch.randint(0, max_pos, (T,), generator=gen)
        pos[0] = max_pos - 1
    else:
        cuts = sorted(
            torch.randperm(T - 1, generator=gen)[: case.num_seqs - 1].add(1).tolist()
        )
        bounds = [0, *cuts, T]
        seq_of = torch.empty(T, dtype=torch.long)
        pos = torch.empty(T, dtype=torch.long)
        for s, (a, b) in enumerate(itertools.pairwise(bounds)):
            start = (
                max_pos - (b - a)
                if s == 0
                else int(torch.randint(0, max_pos - (b - a), (1,), generator=gen))
            )
            seq_of[a:b] = s
            pos[a:b] = torch.arange(start, start + b - a)

    # Randomly permuted physical blocks (block 0 never used); one touched
    # logical block is mapped to the last physical block.
    logical = sorted({(int(s), int(p) // bs) for s, p in zip(seq_of, pos)})
    num_blocks = _num_blocks(case, len(logical) + 1)
    phys = (torch.randperm(num_blocks - 1, generator=gen)[: len(logical)] + 1).tolist()
    table = dict(zip(logical, phys))
    top_key = (int(seq_of[0]), int(pos[0]) // bs)  # token 0 goes to the last block
    for key, blk in table.items():
        if blk == num_blocks - 1:
            table[key] = table[top_key]
    table[top_key] = num_blocks - 1
    slots = torch.tensor(
        [table[(int(s), int(p) // bs)] * bs + int(p) % bs for s, p in zip(seq_of, pos)],
        dtype=torch.long,
    )
    n_pad = int(case.pad_frac * T)
    if n_pad:  # token 0 is never padding
        slots[torch.randperm(T - 1, generator=gen)[:n_pad] + 1] = -1

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=case.dtype)

    q = randn(T, H, QK_NOPE_DIM + R)
    ql_nope = randn(H, T, L).transpose(
        0, 1
    )  # [T, H, L] as bmm(...).transpose(0, 1) gives
    kv = randn(T, L + R)
    if case.kv_cache_dtype.startswith("fp8"):
        fp8 = _fp8_cache_dtype(case)
        cache = torch.empty(num_blocks, bs, L + R, dtype=torch.uint8, device=device)
        if case.cache_storage == "fp8":
            cache = cache.view(fp8)
    else:
        fp8 = None
        cache = torch.empty(num_blocks, bs, L + R, dtype=case.dtype, device=device)
    cache.view(torch.uint8).fill_(POISON_BYTE)
    k_scale = torch.tensor([0.37], device=device) if fp8 is not None else None
    q_scale = torch.tensor([0.21], device=device) if case.q_fp8 else None
    slot_mapping = slots[: T - case.short_slots].to(
        device=device, dtype=case.slot_dtype
    )
    return Inputs(
        q=q,
        q_pe=q[..., QK_NOPE_DIM:],
        ql_nope=ql_nope,
        kv=kv,
        kv_c=kv[:, :L],
        k_pe=kv[:, L:].unsqueeze(1),
        kv_cache=cache,
        slots=slots,
        slot_mapping=slot_mapping,
        positions=pos.to(device=device, dtype=case.pos_dtype),
        cos_sin=cos_sin,
        k_scale=k_scale,
        q_scale=q_scale,
        fp8_dtype=fp8,
    )


# ---------------------------------------------------------------------------
# Reference and comparisons
# ---------------------------------------------------------------------------


def ref_rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``x`` ``[T, ..., R]`` in float64, and ``|x1 cos| + |x2 sin|`` each."""
    x = x.double()
    cos, sin = cos_sin[positions.long()].double().chunk(2, dim=-1)
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(view), sin.view(view)
    half = x.shape[-1] // 2
    x1, x2 = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    m1 = (x1 * cos).abs() + (x2 * sin).abs()
    m2 = (x2 * cos).abs() + (x1 * sin).abs()
    if neox:
        return torch.cat([o1, o2], -1), torch.cat([m1, m2], -1)
    return torch.stack([o1, o2], -1).flatten(-2), torch.stack([m1, m2], -1).flatten(-2)


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at the magnitude of ``v`` (float64)."""
    fi = torch.finfo(dtype)
    mag = v.abs().clamp_min(fi.smallest_normal)
    return fi.eps * torch.exp2(torch.floor(torch.log2(mag)))


def assert_rotated_close(
    got: torch.Tensor,
    ref: torch.Tensor,
    mag: torch.Tensor,
    model_dtype: torch.dtype,
    scale: torch.Tensor | None,
    what: str,
):
    """Rotated values: one model-dtype ulp (+ fp32 evaluation error); fp8: 1 bucket."""
    tol = ulp(ref, model_dtype) + FP32_EVAL_TERMS * FP32_U * mag
    if scale is not None:
        fmax = torch.finfo(got.dtype).max
        s = float(scale)
        ref = (ref / s).clamp(-fmax, fmax)
        tol = ulp(ref, got.dtype) + tol / s + 2.0**-23 * ref.abs()
    err = (got.double() - ref).abs()
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} rotated values off; "
        f"worst err {float((err - tol).max()):.3g} over tolerance"
    )


def quant_ref(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(fp8).max
    return (x.float() / scale.float()).clamp(-fmax, fmax).to(fp8)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str):
    assert got.shape == want.shape, (
        f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    )
    g = got.contiguous().view(torch.uint8)
    w = want.contiguous().view(torch.uint8)
    bad = g != w
    assert not bad.any(), f"{what}: {int(bad.sum())} bytes differ"


def check_cache(case: Case, inp: Inputs, k_rot, k_mag):
    """Written rows equal the reference; every other byte still holds the poison."""
    T, L, R = case.T, case.L, case.R
    valid = torch.zeros(T, dtype=torch.bool)
    valid[: T - case.short_slots] = inp.slots[: T - case.short_slots] >= 0
    tok = valid.nonzero().flatten()
    slots = inp.slots[tok].to(inp.kv_cache.device)
    tok = tok.to(inp.kv_cache.device)
    rows = inp.kv_cache.view(torch.uint8).view(
        -1, inp.kv_cache.element_size() * (L + R)
    )
    got = rows[slots].view(inp.fp8_dtype or case.dtype)
    if inp.fp8_dtype is not None:
        assert_same_bits(
            got[:, :L],
            quant_ref(inp.kv_c[tok], inp.k_scale, inp.fp8_dtype),
            "cache kv_c part (fp8)",
        )
        scale = inp.k_scale
    else:
        assert_same_bits(got[:, :L], inp.kv_c[tok], "cache kv_c part")
        scale = None
    assert_rotated_close(
        got[:, L:], k_rot[tok], k_mag[tok], case.dtype, scale, "cache k_pe part"
    )
    # Untouched everywhere else: put the poison back into the written rows.
    rows[slots] = POISON_BYTE
    assert bool((inp.kv_cache.view(torch.uint8) == POISON_BYTE).all()), (
        "cache bytes outside the written rows changed (padding written?)"
    )


def _clone_all(inp: Inputs) -> dict:
    return {
        k: v.clone()
        for k, v in inp.__dict__.items()
        if isinstance(v, torch.Tensor) and k not in ("kv_cache",)
    }


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_decode_form_matches_rope_cache_cat(case: Case, device: str):
    inp = make_inputs(case, device)
    before = _clone_all(inp)
    T, H, L, R = case.T, case.H, case.L, case.R
    q_out = None
    if case.preallocated_q_out:  # a strided slice of a bigger, NaN-poisoned buffer
        q_out = torch.full(
            (T, H, L + R + 8), float("nan"), dtype=case.dtype, device=device
        )[..., 4 : 4 + L + R]
    elif case.q_fp8:
        q_out = torch.full((T, H, L + R), float("nan"), device=device).to(inp.fp8_dtype)

    out = mla_rope_concat_and_cache(
        inp.ql_nope,
        inp.q_pe,
        inp.kv_c,
        inp.k_pe,
        inp.kv_cache,
        inp.slot_mapping,
        inp.positions,
        inp.cos_sin,
        case.neox,
        kv_cache_dtype=case.kv_cache_dtype,
        k_scale=inp.k_scale,
        q_out=q_out,
        q_scale=inp.q_scale,
    )

    if q_out is not None:
        assert out is q_out
    else:
        assert out.shape == decode_q_out_shape(inp.ql_nope, inp.q_pe)
        assert out.dtype == decode_q_out_dtype(inp.ql_nope, inp.q_scale)
    for name, t in before.items():  # inputs untouched
        assert_same_bits(getattr(inp, name), t, f"input {name} modified")

    q_rot, q_mag = ref_rope(before["q_pe"], before["positions"], inp.cos_sin, case.neox)
    k_rot, k_mag = ref_rope(
        before["kv"][:, L:], before["positions"], inp.cos_sin, case.neox
    )
    if case.q_fp8:
        assert_same_bits(
            out[..., :L],
            quant_ref(inp.ql_nope, inp.q_scale, out.dtype),
            "q_out nope part (fp8)",
        )
    else:
        assert_same_bits(out[..., :L], inp.ql_nope, "q_out nope part")
    assert_rotated_close(
        out[..., L:], q_rot, q_mag, case.dtype, inp.q_scale, "q_out rope part"
    )
    check_cache(case, inp, k_rot, k_mag)


@pytest.mark.parametrize("case", [p for p in CASES if not p.values[0].q_fp8])
def test_prefill_form_rotates_in_place_and_writes_cache(case: Case, device: str):
    inp = make_inputs(case, device, seed=1)
    before = _clone_all(inp)
    L = case.L
    mla_rope_and_cache(
        inp.q_pe,
        inp.kv_c,
        inp.k_pe,
        inp.kv_cache,
        inp.slot_mapping,
        inp.positions,
        inp.cos_sin,
        case.neox,
        kv_cache_dtype=case.kv_cache_dtype,
        k_scale=inp.k_scale,
    )

    q_rot, q_mag = ref_rope(before["q_pe"], before["positions"], inp.cos_sin, case.neox)
    k_rot, k_mag = ref_rope(
        before["kv"][:, L:], before["positions"], inp.cos_sin, case.neox
    )
    # Every token is rotated, padded ones included (as the unfused rotary embedding).
    assert_rotated_close(inp.q_pe, q_rot, q_mag, case.dtype, None, "q_pe in place")
    assert_rotated_close(
        inp.k_pe[:, 0], k_rot, k_mag, case.dtype, None, "k_pe in place"
    )
    # ... and nothing next to them in the strided parents.
    assert_same_bits(
        inp.q[..., :QK_NOPE_DIM], before["q"][..., :QK_NOPE_DIM], "q_nope modified"
    )
    assert_same_bits(inp.kv[:, :L], before["kv"][:, :L], "kv_c modified")
    for name in ("ql_nope", "slot_mapping", "positions", "cos_sin"):
        assert_same_bits(getattr(inp, name), before[name], f"input {name} modified")
    check_cache(case, inp, k_rot, k_mag)


def test_cache_rows_identical_between_forms(device: str):
    """Decode and prefill forms write the very same cache bytes."""
    case = Case("forms", 7, 2, 32, 16, 4, torch.float32, pad_frac=0.3)
    a, b = make_inputs(case, device, seed=3), make_inputs(case, device, seed=3)
    mla_rope_concat_and_cache(
        a.ql_nope,
        a.q_pe,
        a.kv_c,
        a.k_pe,
        a.kv_cache,
        a.slot_mapping,
        a.positions,
        a.cos_sin,
        False,
    )
    mla_rope_and_cache(
        b.q_pe,
        b.kv_c,
        b.k_pe,
        b.kv_cache,
        b.slot_mapping,
        b.positions,
        b.cos_sin,
        False,
    )
    assert_same_bits(a.kv_cache, b.kv_cache, "cache differs between forms")


def test_decode_form_reads_the_first_rows_of_the_steps_kv(device: str):
    """The decode form given the step's whole kv_c / k_pe (decode rows first,
    then NaN-poisoned prefill rows) writes exactly what it writes given the
    decode rows alone, and leaves the step's rows untouched."""
    args = _valid_args(device)
    T, R = args["k_pe"].shape
    step_kv_c = torch.cat([args["kv_c"], torch.full_like(args["kv_c"], float("nan"))])
    step_k_pe = torch.cat(
        [args["k_pe"], torch.full((5, R), float("nan"), device=device)]
    )
    alone = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()
    }
    want = mla_rope_concat_and_cache(**alone)
    before = step_kv_c.clone(), step_k_pe.clone()
    got = mla_rope_concat_and_cache(**{**args, "kv_c": step_kv_c, "k_pe": step_k_pe})
    assert_same_bits(got, want, "q_out")
    assert_same_bits(args["kv_cache"], alone["kv_cache"], "cache")
    assert_same_bits(step_kv_c, before[0], "kv_c modified")
    assert_same_bits(step_k_pe, before[1], "k_pe modified")


def test_zero_tokens_is_a_no_op(device: str):
    case = Case("empty", 0, 2, 32, 16, 4, torch.float32)
    cs = rope_cache(16, torch.float32, device)
    cache = torch.zeros(4, 4, 48, device=device)
    empty = torch.empty(0, dtype=torch.long, device=device)
    q_pe = torch.empty(0, 2, 16, device=device)
    out = mla_rope_concat_and_cache(
        torch.empty(0, 2, 32, device=device),
        q_pe,
        torch.empty(0, 32, device=device),
        torch.empty(0, 16, device=device),
        cache,
        empty,
        empty,
        cs,
        case.neox,
    )
    assert out.shape == (0, 2, 48)
    mla_rope_and_cache(
        q_pe,
        torch.empty(0, 32, device=device),
        torch.empty(0, 16, device=device),
        cache,
        empty,
        empty,
        cs,
        True,
    )
    assert not cache.any()


@gpu
def test_decode_form_replays_in_cuda_graph_with_new_positions(device: str):
    """Positions, slots and scales are read on the device at replay time."""
    case = Case(
        "graph",
        8,
        16,
        512,
        64,
        64,
        torch.bfloat16,
        kv_cache_dtype="fp8",
        pad_frac=0.0,
        on_gpu=True,
    )
    inp = make_inputs(case, device, seed=5)
    q_out = torch.empty(
        case.T, case.H, case.L + case.R, dtype=case.dtype, device=device
    )

    def call():
        mla_rope_concat_and_cache(
            inp.ql_nope,
            inp.q_pe,
            inp.kv_c,
            inp.k_pe,
            inp.kv_cache,
            inp.slot_mapping,
            inp.positions,
            inp.cos_sin,
            False,
            kv_cache_dtype="fp8",
            k_scale=inp.k_scale,
            q_out=q_out,
        )

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    new = make_inputs(case, device, seed=6)
    inp.kv_cache.view(torch.uint8).fill_(POISON_BYTE)
    for name in ("positions", "slot_mapping", "kv", "q", "ql_nope"):
        getattr(inp, name).copy_(getattr(new, name))
    inp.slots.copy_(new.slots)
    inp.k_scale.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    q_rot, q_mag = ref_rope(inp.q_pe, inp.positions, inp.cos_sin, False)
    k_rot, k_mag = ref_rope(inp.k_pe[:, 0], inp.positions, inp.cos_sin, False)
    assert_same_bits(q_out[..., : case.L], inp.ql_nope, "q_out nope part after replay")
    assert_rotated_close(
        q_out[..., case.L :], q_rot, q_mag, case.dtype, None, "q rope replay"
    )
    check_cache(case, inp, k_rot, k_mag)


# ---------------------------------------------------------------------------
# Argument validation: every error is raised before anything is written.
# ---------------------------------------------------------------------------


def _valid_args(device: str, dtype=torch.float32) -> dict:
    T, H, L, R = 3, 2, 32, 16
    return dict(
        ql_nope=torch.randn(T, H, L, device=device, dtype=dtype),
        q_pe=torch.randn(T, H, R, device=device, dtype=dtype),
        kv_c=torch.randn(T, L, device=device, dtype=dtype),
        k_pe=torch.randn(T, R, device=device, dtype=dtype),
        kv_cache=torch.full((4, 4, L + R), 7.0, device=device, dtype=dtype),
        slot_mapping=torch.tensor([1, 2, 3], device=device),
        positions=torch.tensor([0, 5, 9], device=device),
        cos_sin_cache=rope_cache(R, torch.float32, device),
        is_neox=False,
    )


def test_a_layer_of_another_index_dtype_gets_its_own_launch(device: str):
    """A relaunch does not read the dtypes again: the step's launches are
    keyed by every tensor's dtype, the slot mapping's and positions' too, so
    int32 rows after int64 ones build their own launch, and each call writes
    what a call without the step's launches writes."""
    launches: dict = {}
    for index_dtype in (torch.int64, torch.int32, torch.int64):
        args = _valid_args(device)
        del args["ql_nope"]
        args["slot_mapping"] = args["slot_mapping"].to(index_dtype)
        args["positions"] = args["positions"].to(index_dtype)
        alone = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()
        }
        mla_rope_and_cache(**alone)
        mla_rope_and_cache(**args, launches=launches)
        for name in ("kv_cache", "q_pe", "k_pe"):
            assert_same_bits(args[name], alone[name], f"{index_dtype} {name}")
    assert len(launches) == 2


def _fp8_cache(args: dict) -> dict:
    args["kv_cache"] = torch.zeros(
        args["kv_cache"].shape, dtype=torch.uint8, device=args["kv_cache"].device
    )
    args["kv_cache_dtype"] = "fp8"
    return args


BAD_ARGS = [
    (
        "q_pe_2d",
        lambda a: {**a, "q_pe": a["q_pe"][:, 0]},
        AssertionError,
        "q_pe must be [T, H, R]",
    ),
    (
        "kv_c_dtype_mismatch",
        lambda a: {**a, "kv_c": a["kv_c"].half()},
        TypeError,
        "q_pe, kv_c, k_pe, ql_nope need one of",
    ),
    (
        "q_pe_int",
        lambda a: {**a, "q_pe": a["q_pe"].int()},
        TypeError,
        "q_pe, kv_c, k_pe, ql_nope need one of",
    ),
    (
        "cache_width",
        lambda a: {**a, "kv_cache": a["kv_cache"][..., :-1]},
        AssertionError,
        "L + R",
    ),
    (
        "odd_rotary_dim",
        lambda a: {**a, "q_pe": a["q_pe"][..., :15], "k_pe": a["k_pe"][:, :15]},
        AssertionError,
        "rotary dim must be even",
    ),
    (
        "k_pe_shape",
        lambda a: {**a, "k_pe": a["k_pe"][:, None].expand(3, 2, 16)},
        AssertionError,
        "k_pe",
    ),
    (
        "positions_length",
        lambda a: {**a, "positions": a["positions"][:2]},
        AssertionError,
        "positions must be [T]",
    ),
    (
        "slot_mapping_longer_than_tokens",
        lambda a: {
            **a,
            "slot_mapping": torch.cat([a["slot_mapping"], a["slot_mapping"]]),
        },
        AssertionError,
        "slot_mapping: [S <= T]",
    ),
    (
        "q_pe_last_stride",
        lambda a: {**a, "q_pe": a["q_pe"].transpose(1, 2).contiguous().transpose(1, 2)},
        AssertionError,
        "unit last stride",
    ),
    (
        "cos_sin_width",
        lambda a: {**a, "cos_sin_cache": a["cos_sin_cache"][:, :8]},
        AssertionError,
        "cos_sin_cache",
    ),
    (
        "unknown_kv_cache_dtype",
        lambda a: {**a, "kv_cache_dtype": "fp8_ds_mla"},
        ValueError,
        "unsupported kv_cache_dtype",
    ),
    (
        "auto_with_uint8_cache",
        lambda a: {**_fp8_cache(a), "kv_cache_dtype": "auto"},
        TypeError,
        'kv_cache_dtype "auto" needs',
    ),
    (
        "fp8_without_k_scale",
        lambda a: _fp8_cache(a),
        TypeError,
        "k_scale must be a one-element float32 tensor",
    ),
    (
        "fp8_k_scale_float64",
        lambda a: {
            **_fp8_cache(a),
            "k_scale": torch.ones(1, dtype=torch.float64, device=a["q_pe"].device),
        },
        TypeError,
        "k_scale must be a one-element float32 tensor",
    ),
    (
        "fp8_k_scale_python_float",
        lambda a: {**_fp8_cache(a), "k_scale": 1.0},
        TypeError,
        "k_scale must be a one-element float32 tensor",
    ),
    (
        "e5m2_string_with_e4m3_tensor",
        lambda a: {
            **_fp8_cache(a),
            "kv_cache_dtype": "fp8_e5m2",
            "kv_cache": a["kv_cache"].view(torch.float8_e4m3fn),
            "k_scale": torch.ones(1, device=a["q_pe"].device),
        },
        TypeError,
        "needs a uint8 cache or one of",
    ),
]

BAD_DECODE_ARGS = [
    (
        "ql_nope_heads",
        lambda a: {**a, "ql_nope": a["ql_nope"][:, :1]},
        AssertionError,
        "ql_nope must be [T, H, L]",
    ),
    (
        "ql_nope_dtype",
        lambda a: {**a, "ql_nope": a["ql_nope"].half()},
        TypeError,
        "q_pe, kv_c, k_pe, ql_nope need one of",
    ),
    (
        "q_out_shape",
        lambda a: {**a, "q_out": torch.empty(3, 2, 47, device=a["q_pe"].device)},
        AssertionError,
        "q_out must be [T, H, L + R]",
    ),
    (
        "q_out_fp8_without_q_scale",
        lambda a: {
            **a,
            "q_out": torch.empty(
                3, 2, 48, device=a["q_pe"].device, dtype=torch.float8_e4m3fn
            ),
        },
        TypeError,
        "q_out must be torch.float32",
    ),
    (
        "q_scale_with_float_q_out",
        lambda a: {
            **a,
            "q_out": torch.empty(3, 2, 48, device=a["q_pe"].device),
            "q_scale": torch.ones(1, device=a["q_pe"].device),
        },
        TypeError,
        "q_out must be fp8",
    ),
]


@pytest.mark.parametrize(
    "name,mutate,exc,match", BAD_ARGS, ids=[b[0] for b in BAD_ARGS]
)
def test_bad_arguments_raise_before_writing(name, mutate, exc, match, device: str):
    for form in ("decode", "prefill"):
        args = mutate(_valid_args(device))
        if form == "prefill":
            del args["ql_nope"]
        written = {k: args[k].clone() for k in ("kv_cache", "q_pe", "k_pe")}
        with pytest.raises(exc, match=re.escape(match)):
            (mla_rope_concat_and_cache if form == "decode" else mla_rope_and_cache)(
                **args
            )
        for k, v in written.items():
            assert_same_bits(args[k], v, f"{form} form wrote {k} before raising")


@pytest.mark.parametrize(
    "name,mutate,exc,match", BAD_DECODE_ARGS, ids=[b[0] for b in BAD_DECODE_ARGS]
)
def test_bad_decode_arguments_raise_before_writing(
    name, mutate, exc, match, device: str
):
    args = mutate(_valid_args(device))
    cache_before = args["kv_cache"].clone()
    with pytest.raises(exc, match=re.escape(match)):
        mla_rope_concat_and_cache(**args)
    assert torch.equal(args["kv_cache"], cache_before)
