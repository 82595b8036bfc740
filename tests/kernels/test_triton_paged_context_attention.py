# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for ``paged_context_attention`` (extend queries x cached context, paged).

Every case writes each request's logical context K/V (made up front) into a
packed ``(num_blocks, Hkv, bs, 2D)`` cache through a randomly permuted block
table (block 0 never used, every unused slot NaN, so any read outside the
context poisons the result) and compares output and LSE with a dense float64
reference computed from the logical K/V, not from the cache.

CPU tier: interpreter, fp32/fp16 queries (fp8 caches too), tiny shapes.
GPU tier (``gpu``): bf16 queries, bf16 and fp8 caches, real sizes, and a cache
whose element offsets pass 2**31.
"""

import math
from dataclasses import dataclass, field

import pytest
import torch

from vllm.v1.attention.ops import triton_paged_context_attention as pca
from vllm.v1.attention.ops.triton_paged_context_attention import (
    paged_context_attention,
    use_paged_context,
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


FP8_E4M3 = torch.float8_e4m3fn
FP8_E5M2 = torch.float8_e5m2
U32 = 2.0**-24


def unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[
        dtype
    ]


@dataclass
class Case:
    name: str
    context_lens: list[int]
    query_lens: list[int]
    num_kv_heads: int = 2
    group: int = 4  # query heads per kv head
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype | None = None  # None: same as dtype
    sliding_window: int | None = None
    num_splits: int | None = None
    num_blocks: int | None = None  # None: just enough (plus block 0 and spares)
    min_block_id: int = 1  # place the context at or above this block id
    query_view: bool = False  # query as a strided view of a wider tensor
    # "ramp": key norms grow along the context (row maxima keep rising a
    # little, tile after tile); "spike": the last quarter of the context has
    # 8x larger keys (maxima jump by far more than the lazy-rescale slack).
    key_profile: str | None = None
    extra: dict = field(default_factory=dict)


def build(case: Case, device: str, seed: int = 0) -> dict:
    """Logical context K/V, the packed paged cache holding them, queries."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hkv, d, bs = case.num_kv_heads, case.head_size, case.block_size
    hq = hkv * case.group
    cache_dtype = case.cache_dtype or case.dtype
    fp8 = cache_dtype in (FP8_E4M3, FP8_E5M2)
    k_scale, v_scale = (0.37, 1.9) if fp8 else (1.0, 1.0)
    lens = list(zip(case.context_lens, case.query_lens, strict=True))
    pages = [math.ceil((c + q) / bs) for c, q in lens]
    need = sum(pages)
    num_blocks = case.num_blocks or (case.min_block_id + need + 3)
    assert num_blocks - case.min_block_id >= need and case.min_block_id >= 1
    ids = (
        torch.randperm(num_blocks - case.min_block_id, generator=gen)[:need]
        + case.min_block_id
    )
    max_pages = max(pages + [1]) + 2  # spare columns stay 0 (unused block 0)
    block_table = torch.zeros(len(pages), max_pages, dtype=torch.int32)
    cache = torch.full(
        (num_blocks, hkv, bs, 2 * d), float("nan"), dtype=torch.float32, device=device
    ).to(cache_dtype)
    k_logical, v_logical = [], []
    used = 0
    for b, (ctx, _n) in enumerate(zip(case.context_lens, case.query_lens, strict=True)):
        block_table[b, : pages[b]] = ids[used : used + pages[b]].to(torch.int32)
        used += pages[b]
        k = torch.randn(ctx, hkv, d, generator=gen)
        v = torch.randn(ctx, hkv, d, generator=gen)
        if case.key_profile == "ramp":
            k *= (1 + 3 * torch.arange(ctx) / max(ctx, 1))[:, None, None]
        elif case.key_profile == "spike":
            k[ctx - ctx // 4 :] *= 8
        k = (k / k_scale).to(device=device, dtype=cache_dtype)
        v = (v / v_scale).to(device=device, dtype=cache_dtype)
        for p0 in range(0, ctx, bs):  # write page by page through the table
            blk = int(block_table[b, p0 // bs])
            m = min(bs, ctx - p0)
            cache[blk, :, :m, :d] = k[p0 : p0 + m].transpose(0, 1)
            cache[blk, :, :m, d:] = v[p0 : p0 + m].transpose(0, 1)
        k_logical.append(k.double() * k_scale)
        v_logical.append(v.double() * v_scale)
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)
    total = sum(case.query_lens)
    q = torch.randn(total, hq, d, generator=gen).to(device=device, dtype=case.dtype)
    if case.query_view:  # a [T, Hq, D] slice of a fused [T, Hq + 2 Hkv, D] qkv
        qkv = torch.randn(total, hq + 2 * hkv, d, generator=gen).to(
            device=device, dtype=case.dtype
        )
        qkv[:, :hq] = q
        q = qkv[:, :hq]
    # The new tokens' own K/V (the step's key/value, query dtype): the cache
    # slots after each context stay NaN, so the kernel must read these.
    k_new = torch.randn(total, hkv, d, generator=gen).to(
        device=device, dtype=case.dtype
    )
    v_new = torch.randn(total, hkv, d, generator=gen).to(
        device=device, dtype=case.dtype
    )
    cu = torch.zeros(len(pages) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(case.query_lens).cumsum(0)
    seq_lens = torch.tensor([c + n for c, n in lens], dtype=torch.int32)
    return dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=seq_lens.to(device),
        k_logical=k_logical,
        v_logical=v_logical,
        k_new=k_new,
        v_new=v_new,
        scale=d**-0.5,
        k_scale=torch.tensor([k_scale], device=device) if fp8 else None,
        v_scale=torch.tensor([v_scale], device=device) if fp8 else None,
    )


def reference(
    case: Case, data: dict, with_new: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (out, lse, sum_j p_j |v_j|) of the new tokens over their context
    (``with_new``: over [context | new tokens], causal in absolute positions)."""
    q = data["q"]
    dev = q.device
    total, hq, d = q.shape
    out = torch.zeros(total, hq, d, dtype=torch.float64, device=dev)
    absavg = torch.zeros_like(out)
    lse = torch.full((hq, total), -math.inf, dtype=torch.float64, device=dev)
    start = 0
    for b, (ctx, n) in enumerate(zip(case.context_lens, case.query_lens, strict=True)):
        if n == 0 or (ctx == 0 and not with_new):
            start += n
            continue
        qb = q[start : start + n].double()
        k, v = data["k_logical"][b], data["v_logical"][b]
        if with_new:
            k = torch.cat([k, data["k_new"][start : start + n].double()])
            v = torch.cat([v, data["v_new"][start : start + n].double()])
        k = k.repeat_interleave(case.group, dim=1)
        v = v.repeat_interleave(case.group, dim=1)
        s = torch.einsum("nhd,lhd->hnl", qb, k) * data["scale"]
        pos_q = ctx + torch.arange(n, device=dev)
        pos_k = torch.arange(k.shape[0], device=dev)
        seen = pos_k[None, :] <= pos_q[:, None]
        if case.sliding_window is not None:
            seen &= pos_k[None, :] > pos_q[:, None] - case.sliding_window
        s = s.masked_fill(~seen[None], -math.inf)
        lse_b = torch.logsumexp(s, dim=-1)  # [hq, n]
        p = torch.exp(s - lse_b[..., None]).nan_to_num(0.0)  # rows seeing nothing: 0
        out[start : start + n] = torch.einsum("hnl,lhd->nhd", p, v)
        absavg[start : start + n] = torch.einsum("hnl,lhd->nhd", p, v.abs())
        lse[:, start : start + n] = lse_b
        start += n
    return out, lse, absavg


def run_kernel(case: Case, data: dict, poison: bool = True, with_new: bool = False):
    q = data["q"]
    out = torch.full_like(q, float("nan")) if poison else None
    lse = (
        torch.full(
            (q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device=q.device
        )
        if poison
        else None
    )
    return paged_context_attention(
        q,
        data["key_cache"],
        data["value_cache"],
        data["block_table"],
        data["cu_seqlens_q"],
        data["seq_lens"],
        data["scale"],
        key=data["k_new"] if with_new else None,
        value=data["v_new"] if with_new else None,
        sliding_window=case.sliding_window,
        k_scale=data["k_scale"],
        v_scale=data["v_scale"],
        out=out,
        lse=lse,
        num_splits=case.num_splits,
        max_context_len=max(case.context_lens + [0]),
    )


def assert_close_to_reference(case: Case, data: dict, out, lse, with_new: bool = False):
    ref_out, ref_lse, absavg = reference(case, data, with_new)
    assert not out.isnan().any(), "unwritten or NaN output rows"
    assert not lse.isnan().any(), "unwritten or NaN lse entries"
    # Output: each p_j is rounded to the dot dtype (u of the query dtype) and
    # the logits carry fp32 rounding, so |err| <= c * u * sum_j p_j |v_j|;
    # then one rounding of the result to the output dtype.
    u = unit_roundoff(case.dtype)
    tol = (4 * u + 256 * U32) * absavg + u * ref_out.abs() + 1e-12
    err = (out.double() - ref_out).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{case.name}: output error {worst:.2f}x the tolerance"
    # LSE is computed in fp32 whatever the query dtype.
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.double()), finite), "lse -inf pattern differs"
    lse_err = (lse.double() - ref_lse)[finite].abs()
    lse_tol = (256 * U32 * (1 + ref_lse.abs()))[finite]
    assert (lse_err <= lse_tol).all(), (
        f"{case.name}: lse error {lse_err.max().item():.3g}"
    )
    assert (lse[~finite] == -math.inf).all()
    assert (out[(~finite).T] == 0).all(), "tokens without context must output 0"


CPU_CASES = [
    Case("one_request_gqa1_d64", [37], [5], num_kv_heads=2, group=1),
    Case("ragged_many_gqa4_d64", [37, 0, 16, 50, 3], [5, 3, 17, 1, 2]),
    Case(
        "gqa8_d128_fp16",
        [21, 40],
        [3, 9],
        num_kv_heads=1,
        group=8,
        head_size=128,
        dtype=torch.float16,
    ),
    Case(
        "gqa5_padded_group_fp16",
        [33, 18],
        [4, 6],
        num_kv_heads=1,
        group=5,
        dtype=torch.float16,
    ),
    Case("head_size_80_padded", [29, 12], [2, 5], head_size=80),
    Case("block_size_32", [70, 31], [4, 9], block_size=32),
    Case("empty_request_in_middle", [20, 40, 9], [3, 0, 4]),
    Case("sliding_window", [50, 33, 10], [7, 4, 3], sliding_window=20),
    Case("window_of_one_sees_no_context", [17, 5], [3, 2], sliding_window=1),
    Case("window_below_query_len", [40], [9], sliding_window=4),
    Case("split_context_3", [70, 45, 0], [3, 6, 2], num_splits=3),
    Case("split_more_than_tiles", [20, 9], [2, 3], num_splits=8, sliding_window=12),
    Case(
        "fp8_e4m3_cache_fp16_query",
        [30, 44],
        [3, 5],
        dtype=torch.float16,
        cache_dtype=FP8_E4M3,
    ),
    Case(
        "fp8_e5m2_cache_fp16_query_gqa8",
        [19],
        [6],
        num_kv_heads=1,
        group=8,
        dtype=torch.float16,
        cache_dtype=FP8_E5M2,
    ),
    Case("query_strided_view", [26, 11], [4, 3], query_view=True),
    Case("keys_ramp", [90, 47], [3, 5], key_profile="ramp"),
    Case("keys_spike_fp16", [90, 61], [4, 2], dtype=torch.float16, key_profile="spike"),
    # With key/value, the splits share the new tokens' tiles as well.
    Case("splits_share_new_tokens", [20, 5], [40, 37], num_splits=4),
    # 24 query heads: the split-combining kernel's two head blocks (16 + 8).
    Case(
        "splits_24_heads",
        [40, 9],
        [3, 2],
        num_kv_heads=3,
        group=8,
        head_size=32,
        num_splits=2,
    ),
]

GPU_CASES = [
    Case(
        "gpu_one_request_gqa8_d128",
        [4100],
        [200],
        num_kv_heads=4,
        group=8,
        head_size=128,
        dtype=torch.bfloat16,
    ),
    Case(
        "gpu_ragged_many_gqa4_d64",
        [0, 1000, 3333, 17, 2049],
        [64, 1, 130, 300, 7],
        num_kv_heads=2,
        group=4,
        head_size=64,
        dtype=torch.bfloat16,
    ),
    Case(
        "gpu_gqa1_d128",
        [2500, 900],
        [50, 129],
        num_kv_heads=8,
        group=1,
        head_size=128,
        dtype=torch.bfloat16,
    ),
    Case(
        "gpu_sliding_window_gqa8",
        [5000, 700, 3],
        [100, 33, 5],
        num_kv_heads=4,
        group=8,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=1024,
    ),
    Case(
        "gpu_fp8_e4m3_cache_gqa8",
        [3000, 1234],
        [128, 40],
        num_kv_heads=4,
        group=8,
        head_size=128,
        dtype=torch.bfloat16,
        cache_dtype=FP8_E4M3,
    ),
    Case(
        "gpu_long_chunk_block32",
        [1500, 2100],
        [2048, 700],
        num_kv_heads=4,
        group=8,
        head_size=128,
        block_size=32,
        dtype=torch.bfloat16,
    ),
    Case(
        "gpu_keys_ramp_gqa8",
        [6000, 2222],
        [300, 45],
        num_kv_heads=4,
        group=8,
        head_size=128,
        dtype=torch.bfloat16,
        key_profile="ramp",
    ),
    Case(
        "gpu_keys_spike_fp16",
        [5000, 999],
        [128, 64],
        num_kv_heads=4,
        group=8,
        head_size=128,
        dtype=torch.float16,
        key_profile="spike",
    ),
    Case(
        "gpu_forced_splits_fp16",
        [3100, 77],
        [40, 3],
        num_kv_heads=2,
        group=4,
        head_size=128,
        dtype=torch.float16,
        num_splits=7,
    ),
    Case(
        "gpu_splits_share_new_tokens",
        [1000, 64],
        [700, 300],
        num_kv_heads=4,
        group=8,
        head_size=128,
        dtype=torch.bfloat16,
        num_splits=3,
    ),
    # Element offsets of the used blocks pass 2**31: Hkv 8, D 128 -> 32768
    # elements per block, context in blocks >= 65,600 of 70,000.
    Case(
        "gpu_cache_offsets_past_2_31_bf16",
        [3000, 515],
        [64, 17],
        num_kv_heads=8,
        group=4,
        head_size=128,
        dtype=torch.bfloat16,
        num_blocks=70_000,
        min_block_id=65_600,
    ),
    Case(
        "gpu_cache_offsets_past_2_31_fp8",
        [2100],
        [33],
        num_kv_heads=8,
        group=4,
        head_size=128,
        dtype=torch.bfloat16,
        cache_dtype=FP8_E4M3,
        num_blocks=70_000,
        min_block_id=65_600,
    ),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_matches_dense_reference(case, device):
    data = build(case, device)
    out, lse = run_kernel(case, data)
    assert_close_to_reference(case, data, out, lse)


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_matches_dense_reference_gpu(case, device):
    data = build(case, device)
    out, lse = run_kernel(case, data)
    assert_close_to_reference(case, data, out, lse)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_with_new_tokens_matches_dense_reference(case, device):
    """key/value given: the whole extend attention ([context | new], causal)."""
    data = build(case, device)
    out, lse = run_kernel(case, data, with_new=True)
    assert_close_to_reference(case, data, out, lse, with_new=True)


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_with_new_tokens_matches_dense_reference_gpu(case, device):
    data = build(case, device)
    out, lse = run_kernel(case, data, with_new=True)
    assert_close_to_reference(case, data, out, lse, with_new=True)


RESCALE_CASES = [c for c in CPU_CASES if c.key_profile or c.sliding_window == 20]


@pytest.mark.parametrize("slack", [0.0, 3.0], ids=["rescale_every_tile", "slack_3"])
@pytest.mark.parametrize("case", RESCALE_CASES, ids=lambda c: c.name)
def test_rescale_slack_variants_match_reference(case, slack, device, monkeypatch):
    """The classic online softmax and another lazy-rescale slack than the
    default are both exact up to rounding (the default runs in every case)."""
    monkeypatch.setattr(pca, "_RESCALE_SLACK", slack)
    data = build(case, device)
    out, lse = run_kernel(case, data)
    assert_close_to_reference(case, data, out, lse)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto_splits", "three_splits"])
def test_padding_tokens_after_last_request_untouched(num_splits, device):
    case = Case("padded_query", [25, 7], [3, 4], num_splits=num_splits)
    data = build(case, device)
    pad = 5  # the backend's query tensor may be longer than cu_seqlens_q[-1]
    q = torch.cat([data["q"], torch.randn(pad, *data["q"].shape[1:], device=device)])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=device)
    paged_context_attention(
        q,
        data["key_cache"],
        data["value_cache"],
        data["block_table"],
        data["cu_seqlens_q"],
        data["seq_lens"],
        data["scale"],
        out=out,
        lse=lse,
        num_splits=num_splits,
    )
    assert out[-pad:].isnan().all() and lse[:, -pad:].isnan().all()
    assert_close_to_reference(case, data, out[:-pad], lse[:, :-pad])


def dense_causal_new_tokens(q, k_new, v_new, scale, group, window, context_len):
    """float64 causal attention of the new tokens to themselves -> (out, lse[Hq, n])."""
    n = q.shape[0]
    k = k_new.double().repeat_interleave(group, dim=1)
    v = v_new.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    i = torch.arange(n, device=q.device)
    keep = i[None, :] <= i[:, None]
    if window is not None:
        keep &= (context_len + i[None, :]) > (context_len + i[:, None]) - window
    s = s.masked_fill(~keep[None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v), lse


def merge_reference(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions ([n, H, D], lse [H, n]) as merge_attn_states."""
    lse_a, lse_b = lse_a.double(), lse_b.double()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    tot = wa + wb
    merged = (
        out_a.double() * (wa / tot).T[..., None]
        + out_b.double() * (wb / tot).T[..., None]
    )
    return merged, torch.log(tot) + m


@pytest.mark.parametrize("window", [None, 9], ids=["full_context", "sliding_window_9"])
def test_merge_with_new_token_attention_equals_full_attention(window, device):
    """(paged context) merged with (causal new tokens) == dense over [ctx | new]."""
    case = Case(
        "merge", [30, 13, 0], [6, 4, 3], num_kv_heads=2, group=4, sliding_window=window
    )
    data = build(case, device, seed=3)
    out_ctx, lse_ctx = run_kernel(case, data)
    gen = torch.Generator(device="cpu").manual_seed(7)
    start = 0
    for b, (ctx, n) in enumerate(zip(case.context_lens, case.query_lens, strict=True)):
        q = data["q"][start : start + n]
        k_new = torch.randn(n, case.num_kv_heads, case.head_size, generator=gen).to(
            device
        )
        v_new = torch.randn(n, case.num_kv_heads, case.head_size, generator=gen).to(
            device
        )
        out_new, lse_new = dense_causal_new_tokens(
            q, k_new, v_new, data["scale"], case.group, window, ctx
        )
        merged, merged_lse = merge_reference(
            out_ctx[start : start + n], lse_ctx[:, start : start + n], out_new, lse_new
        )
        # Dense attention over [context | new], causal in absolute positions.
        k_all = torch.cat([data["k_logical"][b], k_new.double()]).repeat_interleave(
            case.group, 1
        )
        v_all = torch.cat([data["v_logical"][b], v_new.double()]).repeat_interleave(
            case.group, 1
        )
        s = torch.einsum("nhd,lhd->hnl", q.double(), k_all) * data["scale"]
        pos_q = ctx + torch.arange(n, device=device)
        pos_k = torch.arange(ctx + n, device=device)
        keep = pos_k[None, :] <= pos_q[:, None]
        if window is not None:
            keep &= pos_k[None, :] > pos_q[:, None] - window
        s = s.masked_fill(~keep[None], -math.inf)
        full = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v_all)
        full_lse = torch.logsumexp(s, dim=-1)
        torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged_lse, full_lse, atol=1e-5, rtol=1e-5)
        start += n


def test_repeat_calls_bit_identical(device):
    case = Case("repeat", [45, 21], [5, 7], num_splits=2)
    data = build(case, device)
    out1, lse1 = run_kernel(case, data)
    out2, lse2 = run_kernel(case, data)
    assert torch.equal(out1.view(torch.int32), out2.view(torch.int32))
    assert torch.equal(lse1.view(torch.int32), lse2.view(torch.int32))


# The checks name the function that made them (the call's own, or the step's
# workspace built for a call without one); a tensor of the wrong rank fails to
# unpack.
BAD_ARGS_MATCH = "paged_context_(attention|workspace)|values to unpack"


def _bad_args(device):
    case = Case("args", [20], [3])
    d = build(case, device)
    q, kc, vc = d["q"], d["key_cache"], d["value_cache"]
    bt, cu, sl = d["block_table"], d["cu_seqlens_q"], d["seq_lens"]
    fp8_k, fp8_v = kc.to(FP8_E4M3), vc.to(FP8_E4M3)
    base = dict(
        query=q,
        key_cache=kc,
        value_cache=vc,
        block_table=bt,
        cu_seqlens_q=cu,
        seq_lens=sl,
        scale=0.1,
    )
    return [
        ("query_2d", dict(base, query=q[:, 0]), ValueError),
        ("query_int", dict(base, query=q.to(torch.int32)), TypeError),
        (
            "cache_dtype_differs_from_query",
            dict(base, key_cache=kc.half(), value_cache=vc.half()),
            TypeError,
        ),
        ("k_v_dtypes_differ", dict(base, value_cache=vc.double()), TypeError),
        (
            "fp8_without_scales",
            dict(base, query=q.half(), key_cache=fp8_k, value_cache=fp8_v),
            ValueError,
        ),
        (
            "fp8_scale_wrong_dtype",
            dict(
                base,
                query=q.half(),
                key_cache=fp8_k,
                value_cache=fp8_v,
                k_scale=torch.ones(1, dtype=torch.float64, device=device),
                v_scale=1.0,
            ),
            ValueError,
        ),
        (
            "fp8_with_fp32_query",
            dict(base, key_cache=fp8_k, value_cache=fp8_v, k_scale=1.0, v_scale=1.0),
            TypeError,
        ),
        ("head_size_mismatch", dict(base, query=q[..., :32]), AssertionError),
        ("heads_not_multiple", dict(base, query=q[:, :7]), ValueError),
        (
            "cache_last_dim_strided",
            dict(
                base,
                key_cache=kc[..., ::2],
                value_cache=vc[..., ::2],
                query=q[..., :32].contiguous(),
            ),
            AssertionError,
        ),
        ("cu_seqlens_wrong_length", dict(base, cu_seqlens_q=cu[:1]), AssertionError),
        ("block_table_float", dict(base, block_table=bt.float()), TypeError),
        ("block_table_too_few_rows", dict(base, block_table=bt[:0]), AssertionError),
        ("seq_lens_2d", dict(base, seq_lens=sl[None]), ValueError),
        ("sliding_window_zero", dict(base, sliding_window=0), ValueError),
        (
            "out_wrong_dtype",
            dict(base, out=torch.empty_like(q, dtype=torch.float16)),
            ValueError,
        ),
        (
            "lse_wrong_layout",
            dict(base, lse=torch.empty(q.shape[0], q.shape[1], device=device)),
            ValueError,
        ),
        ("num_splits_zero", dict(base, num_splits=0), ValueError),
        ("max_context_len_negative", dict(base, max_context_len=-1), ValueError),
        ("key_without_value", dict(base, key=d["k_new"]), TypeError),
        (
            "new_key_wrong_shape",
            dict(base, key=d["k_new"][:, :1], value=d["v_new"]),
            AssertionError,
        ),
        (
            "new_value_wrong_dtype",
            dict(base, key=d["k_new"], value=d["v_new"].double()),
            TypeError,
        ),
    ]


@pytest.mark.parametrize("idx", range(22))
def test_invalid_arguments_raise_before_launch(idx, device):
    name, kwargs, exc = _bad_args(device)[idx]
    with pytest.raises(exc, match=BAD_ARGS_MATCH):
        paged_context_attention(**kwargs)


def test_invalid_argument_table_is_complete(device):
    assert len(_bad_args(device)) == 22


@pytest.mark.parametrize(
    "query_lens, max_tokens, expected",
    [
        ([128, 3, 100], 256, True),  # prefix hits, 231 new tokens in all: paged route
        ([128, 129], 256, False),  # short each, but 257 in all: gather path
        ([4096], 256, False),  # a long chunk keeps the gather path
        ([1, 2], 0, False),  # 0 disables the paged route
        ([], 256, False),  # no extends
        ([256], 256, True),  # threshold inclusive
    ],
    ids=[
        "short_total_within",
        "total_over",
        "long_chunk",
        "disabled",
        "no_extends",
        "inclusive",
    ],
)
def test_use_paged_context_route(query_lens, max_tokens, expected):
    lens = torch.tensor(query_lens, dtype=torch.int32)
    assert use_paged_context(lens, max_tokens) is expected


def _step_workspace(data, num_splits=None):
    q, kc = data["q"], data["key_cache"]
    return pca.paged_context_workspace(
        data["block_table"],
        data["cu_seqlens_q"],
        data["seq_lens"],
        num_tokens=q.shape[0],
        num_heads=q.shape[1],
        num_kv_heads=kc.shape[2],
        head_size=q.shape[2],
        dtype=q.dtype,
        num_splits=num_splits,
    )


def _layer_call(data, workspace, **changes):
    kwargs = dict(
        query=data["q"],
        key_cache=data["key_cache"],
        value_cache=data["value_cache"],
        block_table=data["block_table"],
        cu_seqlens_q=data["cu_seqlens_q"],
        seq_lens=data["seq_lens"],
        scale=data["scale"],
        key=data["k_new"],
        value=data["v_new"],
        out=torch.empty_like(data["q"]),
        workspace=workspace,
    )
    kwargs.update(changes)
    return paged_context_attention(**kwargs)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "three_splits"])
def test_second_layer_of_a_step_recomputes_nothing(num_splits, device, monkeypatch):
    """The builder's workspace checks the metadata and fixes the split once
    per step; the step's first layer builds its launches; the next layers of
    the same geometry only check their tensors and launch (and are right)."""
    case = Case("layers", [37, 16], [5, 3], num_splits=num_splits)
    data = build(case, device)
    built, checked = [], []

    class Counting(pca.KernelCall):
        def __init__(self, kernel, grid, **fixed):
            built.append(kernel)
            super().__init__(kernel, grid, **fixed)

    def count(fn, log):
        def wrapped(*args, **kwargs):
            log.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(pca, "KernelCall", Counting)
    monkeypatch.setattr(pca, "_layer_calls", count(pca._layer_calls, checked))
    workspace = _step_workspace(data, num_splits)
    monkeypatch.setattr(
        pca, "paged_context_workspace", count(pca.paged_context_workspace, checked)
    )
    for _ in range(3):
        out, lse = _layer_call(data, workspace)
        assert_close_to_reference(case, data, out, lse, with_new=True)
    kernels = [pca._paged_context_attention_kernel]
    if num_splits > 1:
        kernels.append(pca._combine_splits_kernel)
    assert built == kernels
    assert checked == ["_layer_calls"]


def test_a_layer_of_another_geometry_is_checked_in_the_same_step(device):
    """A layer whose tensors differ from the step's first layer's (here an
    fp16 cache for fp32 queries) is refused before any launch, however many
    good layers came first."""
    data = build(Case("geometry", [20, 9], [3, 2]), device)
    workspace = _step_workspace(data)
    _layer_call(data, workspace)
    kc, vc = data["key_cache"].half(), data["value_cache"].half()
    out = torch.full_like(data["q"], float("nan"))
    with pytest.raises(TypeError, match="paged_context_attention: the cache"):
        _layer_call(data, workspace, key_cache=kc, value_cache=vc, out=out)
    assert out.isnan().all()
    with pytest.raises(ValueError, match="workspace was made for other shapes"):
        _layer_call(data, workspace, query=data["q"][:, :4], out=out[:, :4])
    with pytest.raises(ValueError, match="num_splits differs"):
        _layer_call(data, workspace, num_splits=workspace.num_splits + 1)
    with pytest.raises(TypeError, match="workspace must be"):
        _layer_call(data, workspace=object())
