"""The FA-path AITER fakes (tests/fakes/aiter_fa.py) refuse what AITER refuses
and read what its kernels read.

One small case per constraint of ROCm/aiter e4048607 (docs/aiter-calls-fa.md
lists them per call site): the export shapes (guard wrappers, generated
schemas), the wrappers' and launchers' checks with their exception types, and
the reads the kernels do without a check (strides they are not given,
``min_seqlen_q``'s skip, the grid's ``max_seqlen_q``, descales by their first
element, one entry past vLLM's ``cu_query_lens`` slice, fp8 bytes decoded as
the arch's format).  Tiny fp16 shapes; runs on the ``device`` fixture (CPU
tier, or CUDA on the GPU tier), against a float64 reference written here.
"""

import inspect
import itertools
import math

import pytest
import torch
from aiter_export import AiterExport
from aiter_fa import KernelMisread, install_fa_fakes

F16 = torch.float16
BF16 = torch.bfloat16


@pytest.fixture(params=["gfx950"])
def fakes(request):
    export = AiterExport()
    fake = install_fa_fakes(export, arch=request.param)
    with export:
        yield fake


@pytest.fixture
def fakes_gfx942():
    export = AiterExport()
    fake = install_fa_fakes(export, arch="gfx942")
    with export:
        yield fake


def ref_attention(q, k, v, scale, causal=True, left=-1):
    """One sequence, float64: q [n, Hq, D], k/v [m, Hkv, D]; bottom-right causal."""
    n, m = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None, :]
    if causal:
        s = s.masked_fill(j > i + m - n, float("-inf"))
    if left >= 0:
        s = s.masked_fill(j < i + m - n - left, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(0.0), v)


def close(got, ref, dtype=F16):
    tol = 4 * torch.finfo(dtype).eps / 2 * (1 + ref.abs())
    assert ((got.double() - ref).abs() <= tol).all()


def cu(lens, device):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def varlen_inputs(device, q_lens=(3, 5), k_lens=(6, 5), hq=4, hkv=2, d=32, dtype=F16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(sum(k_lens), hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(sum(k_lens), hkv, d, generator=g).to(dtype).to(device)
    return q, k, v, cu(q_lens, device), cu(k_lens, device)


def varlen(q, k, v, cq, ck, **kw):
    import aiter

    lens_q = (cq[1:] - cq[:-1]).tolist()
    lens_k = (ck[1:] - ck[:-1]).tolist()
    kw.setdefault("max_seqlen_q", max(lens_q))
    kw.setdefault("max_seqlen_k", max(lens_k))
    return aiter.flash_attn_varlen_func(q, k, v, cq, ck, **kw)


def op_varlen(q, k, v, cq, ck, max_q, max_k, min_q=0, causal=True, out=None):
    """torch.ops.aiter.mha_varlen_fwd directly (no wrapper padding / contiguity)."""
    return torch.ops.aiter.mha_varlen_fwd(q, k, v, cq, ck, max_q, max_k, min_q, 0.0, 0.125,
                                          0.0, False, causal, -1, -1, 0, True, False, out=out)


# --------------------------------------------------------------------------
# Export shapes.
# --------------------------------------------------------------------------


def test_varlen_func_is_plain_with_aiters_signature(fakes):
    import aiter
    from aiter.ops import mha

    assert aiter.flash_attn_varlen_func == mha.flash_attn_varlen_func
    params = list(inspect.signature(aiter.flash_attn_varlen_func).parameters)
    assert params == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
        "min_seqlen_q", "dropout_p", "softmax_scale", "logits_soft_cap", "causal",
        "window_size", "bias", "alibi_slopes", "deterministic", "return_lse",
        "return_attn_probs", "how_v3_bf16_cvt", "block_table", "out", "cu_seqlens_q_padded",
        "cu_seqlens_k_padded", "sink_ptr"]
    assert inspect.signature(aiter.flash_attn_varlen_func).parameters["min_seqlen_q"].default == 0


@pytest.mark.parametrize("name", ["mha_varlen_fwd", "fmha_v3_varlen_fwd"])
def test_varlen_ops_are_guarded_with_generated_schema(fakes, name):
    """compile_ops -> torch_compile_guard: (*args, **kwargs); MANUAL_SCHEMA_OPS:
    generate_schema marks every tensor mutable, int -> SymInt."""
    from aiter.ops import mha

    export = getattr(mha, name)
    assert str(inspect.signature(export)) == "(*args, **kwargs)"
    schema = str(getattr(torch.ops.aiter, name).default._schema)
    assert "Tensor(a0!) q" in schema and "Tensor(a1!) k" in schema
    assert "SymInt max_seqlen_q" in schema and "Generator? gen=None" in schema
    assert schema.endswith("-> (Tensor, Tensor, Tensor, Tensor)")


def test_paged_attention_v1_is_a_direct_op(fakes):
    """direct_register_custom_op: infer_schema with out/workspace_buffer mutable."""
    import aiter

    schema = str(torch.ops.aiter.paged_attention_v1.default._schema)
    assert schema.split("::")[1].startswith(
        "paged_attention_v1(Tensor(a0!) out, Tensor(a1!) workspace_buffer, Tensor query, "
        "Tensor key_cache")
    assert "str kv_cache_dtype" in schema and "SymInt sliding_window=0" in schema
    assert "q_scale" not in schema  # the core takes q_scale, the registered op does not
    assert "sliding_window" in inspect.signature(aiter.paged_attention_v1).parameters


def test_unified_attention_old_module_path_is_the_same_module(fakes):
    import aiter.ops.triton.attention.unified_attention as new
    import aiter.ops.triton.unified_attention as old

    assert old is new and old.unified_attention == fakes.unified_attention


# --------------------------------------------------------------------------
# flash_attn_varlen_func / mha_varlen_fwd / fmha_v3_varlen_fwd
# --------------------------------------------------------------------------


def test_varlen_matches_reference_causal_bottom_right(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    out, lse = varlen(q, k, v, cq, ck, causal=True, return_lse=True, softmax_scale=0.2)
    assert lse.shape == (4, 8) and lse.dtype == torch.float32
    close(out[:3], ref_attention(q[:3], k[:6], v[:6], 0.2))
    close(out[3:], ref_attention(q[3:], k[6:], v[6:], 0.2))


def test_varlen_refuses_fp32(fakes, device):
    """cmdGenFunc_mha_varlen_fwd: no CK module for fp32."""
    q, k, v, cq, ck = varlen_inputs(device, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="Unsupported dtype for MHA"):
        varlen(q, k, v, cq, ck)


def test_v3_op_refuses_fp32(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="only support fp16, bf16 and fp8_e4m3"):
        torch.ops.aiter.fmha_v3_varlen_fwd(q, k, v, cq, ck, 5, 6, 0, 0.0, 0.1, 0.0, False,
                                           True, -1, -1, False, False, 1)


def test_varlen_refuses_mixed_dtypes(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    with pytest.raises(RuntimeError, match="query and key must have the same dtype"):
        varlen(q, k.to(BF16), v, cq, ck)


def test_varlen_refuses_int64_cu_seqlens(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        varlen(q, k, v, cq.long(), ck)


def test_varlen_refuses_non_contiguous_cu_seqlens(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    spread = torch.zeros(2 * ck.numel(), dtype=torch.int32, device=device)
    spread[::2] = ck
    with pytest.raises(RuntimeError, match="cu_seqlens_k must be contiguous"):
        varlen(q, k, v, cq, spread[::2])


def test_varlen_op_refuses_strided_last_dim(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    wide = torch.zeros(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype, device=device)
    wide[..., ::2] = k
    with pytest.raises(RuntimeError, match="Input tensor must have contiguous last dimension"):
        op_varlen(q, wide[..., ::2], v, cq, ck, 5, 6)


def test_varlen_func_makes_strided_last_dim_contiguous(fakes, device):
    """maybe_contiguous: the wrapper copies a tensor whose last stride is not 1."""
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(3,), k_lens=(6,))
    wide = torch.zeros(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype, device=device)
    wide[..., ::2] = k
    close(varlen(q, wide[..., ::2], v, cq, ck, causal=True, softmax_scale=0.2),
          ref_attention(q, k, v, 0.2))


def test_varlen_honours_row_and_head_strides(fakes, device):
    """CK gets stride(0) and stride(1): a q/k/v split of one qkv tensor is read right."""
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(4,), k_lens=(4,))
    qkv = torch.cat([q, k, v], dim=1)  # [T, 4 + 2 + 2, D]
    qs, ks, vs = qkv.split([4, 2, 2], dim=1)
    assert qs.stride(0) == 8 * 32 and not qs.is_contiguous()
    close(varlen(qs, ks, vs, cq, ck, causal=True, softmax_scale=0.2),
          ref_attention(q, k, v, 0.2))


def test_varlen_op_refuses_head_size_not_multiple_of_8(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, d=20)
    with pytest.raises(RuntimeError, match="head_size that is a multiple of 8"):
        op_varlen(q, k, v, cq, ck, 5, 6)


def test_varlen_func_pads_head_size_to_multiple_of_8(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(3,), k_lens=(6,), d=20)
    out = varlen(q, k, v, cq, ck, causal=True, softmax_scale=0.2)
    assert out.shape == q.shape
    close(out, ref_attention(q, k, v, 0.2))


def test_varlen_refuses_head_size_over_256(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, d=264, q_lens=(1,), k_lens=(1,))
    with pytest.raises(RuntimeError, match="at most 256"):
        varlen(q, k, v, cq, ck)


def test_varlen_refuses_heads_not_dividing(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, hq=6, hkv=4)
    with pytest.raises(RuntimeError, match="must divide number of heads"):
        varlen(q, k, v, cq, ck)


def test_varlen_refuses_a_paged_cache_as_k(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, k_lens=(8, 8))
    with pytest.raises(RuntimeError, match="k must have shape"):
        varlen(q, k.view(2, 8, 2, 32), v.view(2, 8, 2, 32), cq, ck)


def test_varlen_refuses_empty_batch(fakes, device):
    q, k, v, _, _ = varlen_inputs(device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="batch size must be postive"):
        op_varlen(q, k, v, zero, zero, 1, 1)


@pytest.mark.parametrize("bad, match", [
    ("dtype", "output must have the same dtype"),
    ("shape", "out must have shape"),
    ("stride", "Output tensor must have contiguous last dimension"),
])
def test_varlen_refuses_bad_out(fakes, device, bad, match):
    q, k, v, cq, ck = varlen_inputs(device)
    if bad == "dtype":
        out = torch.empty_like(q, dtype=BF16)
    elif bad == "shape":
        out = torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype, device=device)
    else:
        out = torch.empty(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype, device=device)[..., ::2]
    with pytest.raises(RuntimeError, match=match):
        varlen(q, k, v, cq, ck, out=out)


@pytest.mark.parametrize("min_q", [1, 0])
def test_varlen_min_seqlen_q_skips_short_sequences(fakes, device, min_q):
    """kSkipMinSeqlenQ: with min_seqlen_q = 1 a one-query sequence is not written."""
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(1, 4), k_lens=(5, 4))
    out = torch.full_like(q, float("nan"))
    varlen(q, k, v, cq, ck, min_seqlen_q=min_q, causal=True, softmax_scale=0.2, out=out)
    close(out[1:], ref_attention(q[1:], k[5:], v[5:], 0.2))
    if min_q == 1:
        assert torch.isnan(out[0]).all()
    else:
        close(out[:1], ref_attention(q[:1], k[:5], v[:5], 0.2))


def test_v3_route_ignores_min_seqlen_q(fakes, device):
    """fmha_fwd_v3 never reads min_seqlen_q (AITER csrc/cpp_itfs/mha_fwd.cu l.208-286;
    only CK's fmha_fwd_ck skips, l.288): the one-query sequence is computed."""
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(1, 4), k_lens=(5, 4), d=128, dtype=BF16)
    out = torch.full_like(q, float("nan"))
    varlen(q, k, v, cq, ck, min_seqlen_q=1, causal=True, softmax_scale=0.2, out=out)
    assert fakes.varlen_calls[-1]["route"] == "fmha_v3_varlen_fwd"
    close(out[:1], ref_attention(q[:1], k[:5], v[:5], 0.2), BF16)
    close(out[1:], ref_attention(q[1:], k[5:], v[5:], 0.2), BF16)


def test_v3_op_has_no_ck_fallback(fakes, device):
    """The v3 module is built ENABLE_CK=0: fp16 (no v3 kernel) raises AITER's
    TORCH_CHECK (csrc/py_itfs_cu/asm_mha_varlen_fwd.cu l.493-494)."""
    q, k, v, cq, ck = varlen_inputs(device, d=128, dtype=F16)
    with pytest.raises(RuntimeError, match="invalid argument for fmha_v3_varlen_fwd"):
        torch.ops.aiter.fmha_v3_varlen_fwd(q, k, v, cq, ck, 5, 6, 0, 0.0, 0.1, 0.0, False,
                                           True, -1, -1, False, False, 1)

def test_varlen_grid_ends_at_max_seqlen_q(fakes, device):
    """The launch covers max_seqlen_q query rows per sequence; rows past it stay unwritten."""
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(5,), k_lens=(5,))
    out = torch.full_like(q, float("nan"))
    varlen(q, k, v, cq, ck, max_seqlen_q=3, causal=True, softmax_scale=0.2, out=out)
    close(out[:3], ref_attention(q, k, v, 0.2)[:3])
    assert torch.isnan(out[3:]).all()


def test_varlen_max_seqlen_k_zero_zeroes_out_and_lse_inf(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    out, lse = varlen(q, k, v, cq, ck, max_seqlen_k=0, return_lse=True)
    assert (out == 0).all() and (lse == float("inf")).all()


def test_varlen_empty_key_rows_give_zero_and_minus_inf(fakes, device):
    q, k, v, cq, _ = varlen_inputs(device, k_lens=(6, 5))
    ck = torch.tensor([0, 0, 11], dtype=torch.int32, device=device)
    out, lse = varlen(q, k, v, cq, ck, max_seqlen_k=11, return_lse=True)
    assert (out[:3] == 0).all() and (lse[:, :3] == float("-inf")).all()


def test_varlen_window_at_least_max_seqlen_k_is_dropped(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device, q_lens=(3,), k_lens=(6,))
    got = varlen(q, k, v, cq, ck, causal=True, window_size=(6, 0), softmax_scale=0.2)
    close(got, ref_attention(q, k, v, 0.2))
    got = varlen(q, k, v, cq, ck, causal=True, window_size=(2, 0), softmax_scale=0.2)
    close(got, ref_attention(q, k, v, 0.2, left=2))
    assert fakes.varlen_calls[-1]["route"] == "mha_varlen_fwd"


@pytest.mark.parametrize("dtype, d, route", [
    (BF16, 128, "fmha_v3_varlen_fwd"), (F16, 128, "mha_varlen_fwd"),
    (BF16, 64, "mha_varlen_fwd"),
])
def test_varlen_route(fakes, device, dtype, d, route):
    """can_impl_fmha_v3_fwd: bf16, head size 128, no SWA -> ASM v3; else CK."""
    q, k, v, cq, ck = varlen_inputs(device, d=d, dtype=dtype)
    varlen(q, k, v, cq, ck, causal=True)
    assert fakes.varlen_calls[-1]["route"] == route


def test_varlen_refuses_sink_ptr_of_wrong_shape(fakes, device):
    q, k, v, cq, ck = varlen_inputs(device)
    with pytest.raises(AssertionError, match="sink_ptr has incorrect shape"):
        varlen(q, k, v, cq, ck, sink_ptr=torch.zeros(3, device=device))


# --------------------------------------------------------------------------
# unified_attention
# --------------------------------------------------------------------------


def packed_cache(device, num_blocks=6, hkv=2, bs=16, d=32, dtype=F16, seed=1):
    """vLLM 0.34.0's packed (blocks, Hkv, bs, 2D) cache and its K/V views
    [blocks, bs, Hkv, D] (strides H*bs*2D, 2D, bs*2D, 1)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, hkv, bs, 2 * d, generator=g).to(dtype).to(device)
    key, value = cache.transpose(1, 2).split(d, dim=-1)
    return cache, key, value


def unified_inputs(device, seq_lens=(20, 35), q_lens=(1, 1), hq=4, d=32, dtype=F16,
                   kv_dtype=None, num_blocks=6):
    _, key, value = packed_cache(device, num_blocks=num_blocks, d=d)
    if kv_dtype is not None:
        key, value = key.to(kv_dtype), value.to(kv_dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype).to(device)
    blocks = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.stack([blocks[:3], blocks.flip(0)[:3]]).int().to(device)
    return q, key, value, table, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def dense_kv(key, value, table_row, seq_len):
    pos = torch.arange(seq_len, device=key.device)
    blk = table_row.long()[pos // key.shape[1]]
    return key[blk, pos % key.shape[1]], value[blk, pos % key.shape[1]]


def unified(q, key, value, table, seq_lens, max_q=1, cu_q=None, window=(-1, -1),
            k_descale=None, v_descale=None, max_k=None, out=None, causal=True):
    import aiter.ops.triton.unified_attention as ua

    if cu_q is None:
        cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=q.device)
    out = torch.full_like(q, float("nan")) if out is None else out
    ua.unified_attention(
        q=q, k=key, v=value, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
        seqused_k=seq_lens, max_seqlen_k=max_k or int(seq_lens.max()), softmax_scale=0.2,
        causal=causal, alibi_slopes=None, window_size=window, block_table=table, softcap=0,
        q_descale=None, k_descale=k_descale, v_descale=v_descale)
    return out


def test_unified_decode_reads_packed_layout(fakes, device):
    """All four cache strides are honoured: vLLM's packed K/V views read right."""
    q, key, value, table, lens = unified_inputs(device)
    out = unified(q, key, value, table, lens)
    for b in range(2):
        kb, vb = dense_kv(key, value, table[b], int(lens[b]))
        close(out[b:b + 1], ref_attention(q[b:b + 1], kb, vb, 0.2))
    assert fakes.unified_calls[-1]["path"] == "2d"


def test_unified_refuses_non_causal(fakes, device):
    q, key, value, table, lens = unified_inputs(device)
    with pytest.raises(AssertionError, match="Only causal attention is supported"):
        unified(q, key, value, table, lens, causal=False)


def test_unified_all_decode_ignores_cu_seqlens_q(fakes, device):
    """max_seqlen_q == 1: sequence b is query row b, cu_seqlens_q is not read."""
    q, key, value, table, lens = unified_inputs(device)
    good = unified(q, key, value, table, lens)
    junk = torch.tensor([7, 0, 9], dtype=torch.int32, device=device)
    torch.testing.assert_close(unified(q, key, value, table, lens, cu_q=junk), good)


def test_unified_multi_token_rows_follow_cu_seqlens_q(fakes, device):
    q, key, value, table, lens = unified_inputs(device, q_lens=(3, 2))
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    out = unified(q, key, value, table, lens, max_q=3, cu_q=cu_q)
    for b, (s, e) in enumerate([(0, 3), (3, 5)]):
        kb, vb = dense_kv(key, value, table[b], int(lens[b]))
        close(out[s:e], ref_attention(q[s:e], kb, vb, 0.2))


def test_unified_window_keeps_window_left_plus_one_keys(fakes, device):
    q, key, value, table, lens = unified_inputs(device)
    out = unified(q, key, value, table, lens, window=(7, 0))
    kb, vb = dense_kv(key, value, table[1], 35)
    close(out[1:2], ref_attention(q[1:2], kb, vb, 0.2, left=7))


def test_unified_descales_by_first_element_and_only_in_pairs(fakes, device):
    """tl.load(k_descale_ptr): a [num_seqs, Hkv] descale is read at [0, 0]; k alone
    (without v) does not dequantize."""
    q, key, value, table, lens = unified_inputs(device, kv_dtype=torch.float8_e4m3fn)
    ks = torch.tensor([[0.5, 9.0], [9.0, 9.0]], device=device)
    vs = torch.tensor([[2.0, 9.0], [9.0, 9.0]], device=device)
    out = unified(q, key, value, table, lens, k_descale=ks, v_descale=vs)
    kb, vb = dense_kv(key, value, table[0], 20)
    close(out[:1], ref_attention(q[:1], kb.to(F16) * 0.5, vb.to(F16) * 2.0, 0.2))
    plain = unified(q, key, value, table, lens, k_descale=ks)
    close(plain[:1], ref_attention(q[:1], kb.to(F16), vb.to(F16), 0.2))


def three_d_case(device, kv_dtype):
    """max_seqlen_k > 512 and a small grid: the 3D (split-K) kernel."""
    return unified_inputs(device, seq_lens=(600, 20), kv_dtype=kv_dtype, num_blocks=40)


def test_unified_3d_refuses_fp32_cache(fakes, device):
    q, key, value, _, lens = three_d_case(device, torch.float32)
    table = torch.arange(1, 39, dtype=torch.int32, device=device).repeat(2, 1)
    with pytest.raises(AssertionError, match="kv_cache_dtype only supports"):
        unified(q, key, value, table, lens)


def test_unified_2d_reads_fp32_cache(fakes, device):
    """The 2D kernel loads any float cache and casts it to q's dtype."""
    q, key, value, table, lens = unified_inputs(device, kv_dtype=torch.float32)
    out = unified(q, key, value, table, lens)
    kb, vb = dense_kv(key, value, table[0], 20)
    close(out[:1], ref_attention(q[:1], kb.to(F16), vb.to(F16), 0.2))


def test_unified_3d_on_gfx942_refuses_e4m3fn(fakes_gfx942, device):
    q, key, value, _, lens = three_d_case(device, torch.float8_e4m3fn)
    table = torch.arange(1, 39, dtype=torch.int32, device=device).repeat(2, 1)
    with pytest.raises(AssertionError, match="float8_e4m3fnuz"):
        unified(q, key, value, table, lens)
    assert fakes_gfx942.unified_calls == []


def test_unified_refuses_uint8_cache(fakes, device):
    q, key, value, table, lens = unified_inputs(device, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(KernelMisread, match="uint8"):
        unified(q, key.view(torch.uint8), value.view(torch.uint8), table, lens)


def test_unified_refuses_sinks_of_wrong_shape(fakes, device):
    import aiter.ops.triton.unified_attention as ua

    q, key, value, table, lens = unified_inputs(device)
    cu_q = torch.arange(3, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="Sinks must be num_query_heads size"):
        ua.unified_attention(q, key, value, torch.empty_like(q), cu_q, 1, lens, 35, 0.2, True,
                             (-1, -1), table, 0, None, None, None,
                             sinks=torch.zeros(3, device=device))


# --------------------------------------------------------------------------
# paged_attention_v1
# --------------------------------------------------------------------------

D64 = 64


def pa_inputs(device, seq_lens=(20, 35), hq=4, hkv=2, d=D64, bs=16, dtype=F16, fp8=None):
    num_blocks = 6
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(num_blocks, hkv, bs, 2 * d, generator=g)
    if fp8 is None:
        cache = cache.to(dtype).to(device)
    else:  # no +-0: 0x80 (fn's -0) is NaN in fnuz
        cache = torch.where(cache.abs() < 0.05, 0.5, cache)
        cache = cache.to(fp8).view(torch.uint8).to(device)
    key, value = cache.transpose(1, 2).split(d, dim=-1)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype).to(device)
    blocks = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.stack([blocks[:3], blocks.flip(0)[:3]]).int().to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    # vLLM passes query_start_loc[:num_decodes]: the kernel reads one entry more.
    qsl = torch.arange(len(seq_lens) + 2, dtype=torch.int32, device=device)
    return q, key, value, table, lens, qsl[:len(seq_lens)]


def pa(q, key, value, table, lens, cu, kv_cache_dtype="auto", out=None, max_ctx=None,
       workspace=None, ks=1.0, vs=1.0, window=0, partition_size=256):
    out = torch.full_like(q, float("nan")) if out is None else out
    max_ctx = int(lens.max()) if max_ctx is None else max_ctx
    parts = math.ceil(max_ctx / 256)
    if workspace is None:
        nbytes = q.shape[0] * q.shape[1] * parts * (q.shape[2] * q.element_size() + 8)
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    scale = (torch.tensor(ks, device=q.device), torch.tensor(vs, device=q.device))
    torch.ops.aiter.paged_attention_v1(
        out, workspace, q, key, value, 0.2, table, cu, lens, max_ctx, None, kv_cache_dtype,
        "NHD", 0.0, *scale, None, partition_size, 1, window)
    return out


def test_pa_matches_reference_on_packed_layout(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device)
    out = pa(q, key, value, table, lens, cu_q)
    for b in range(2):
        kb, vb = dense_kv(key, value, table[b], int(lens[b]))
        close(out[b:b + 1], ref_attention(q[b:b + 1], kb, vb, 0.2))
    assert fakes.decode_calls[-1] == {"seq_lens": [20, 35], "kv_cache_dtype": "auto"}


def test_pa_refuses_fp32_query(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device, dtype=torch.float32)
    with pytest.raises(ValueError, match="Unsupported data type: torch.float32"):
        pa(q, key, value, table, lens, cu_q)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "bfloat16", "float16"])
def test_pa_refuses_kv_cache_dtype(fakes, device, kv_cache_dtype):
    """Only "auto", "fp8" and "fp8_e4m3": vLLM's other CacheDType strings fail."""
    q, key, value, table, lens, cu_q = pa_inputs(device)
    with pytest.raises(ValueError, match=f"Unsupported kv_cache_dtype: {kv_cache_dtype}"):
        pa(q, key, value, table, lens, cu_q, kv_cache_dtype=kv_cache_dtype)


def test_pa_refuses_short_block_table(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device)
    with pytest.raises(ValueError, match="block_tables.size.1.=2 is too small"):
        pa(q, key, value, table[:, :2].contiguous(), lens, cu_q)


def test_pa_refuses_context_lens_of_other_length(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device)
    with pytest.raises(ValueError, match="must match block_tables.size"):
        pa(q, key, value, table, lens[:1], cu_q)


def test_pa_refuses_small_workspace(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device)
    ws = torch.empty(16, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="workspace_buffer is too small"):
        pa(q, key, value, table, lens, cu_q, workspace=ws)


def test_pa_refuses_head_size_32(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device, d=32)
    with pytest.raises(RuntimeError, match="steps of 64"):
        pa(q, key, value, table, lens, cu_q)


def test_pa_refuses_block_size_64_for_16_bit_cache(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device, bs=64)
    with pytest.raises(RuntimeError, match="static_assert"):
        pa(q, key, value, table, lens, cu_q)


@pytest.mark.parametrize("name", ["block_tables", "context_lens", "k_scale"])
def test_pa_refuses_what_its_c_types_misread(fakes, device, name):
    """int* block_tables / context_lens, float* k_scale: other dtypes are misread."""
    q, key, value, table, lens, cu_q = pa_inputs(device)
    args = {"block_tables": table, "context_lens": lens,
            "k_scale": torch.tensor(1.0, device=device)}
    args[name] = args[name].to(torch.float64 if name == "k_scale" else torch.int64)
    ws = torch.empty(1 << 16, dtype=torch.uint8, device=device)
    with pytest.raises(KernelMisread, match=name):
        torch.ops.aiter.paged_attention_v1(
            torch.empty_like(q), ws, q, key, value, 0.2, args["block_tables"], cu_q,
            args["context_lens"], 35, None, "auto", "NHD", 0.0, args["k_scale"],
            torch.tensor(1.0, device=device), None, 256, 1, 0)


def test_pa_reads_query_heads_dense(fakes, device):
    """Only query.stride(0) reaches the kernel: heads are read at h * D."""
    _, key, value, table, lens, cu_q = pa_inputs(device)
    wide = torch.randn(2, 4, 2 * D64, device=device).to(F16)
    view = wide[..., :D64]  # head stride 2 * D64
    out = pa(view, key, value, table, lens, cu_q)
    dense = torch.as_strided(wide, (2, 4, D64), (wide.stride(0), D64, 1))
    kb, vb = dense_kv(key, value, table[0], 20)
    close(out[:1], ref_attention(dense[:1], kb, vb, 0.2))


def test_pa_writes_out_dense(fakes, device):
    """out's strides do not reach the kernel: row b is written at b * H * D."""
    q, key, value, table, lens, cu_q = pa_inputs(device)
    wide = torch.full((2, 4, 2 * D64), float("nan"), dtype=F16, device=device)
    pa(q, key, value, table, lens, cu_q, out=wide[..., :D64])
    dense = torch.as_strided(wide, (2, 4, D64), (4 * D64, D64, 1))
    kb, vb = dense_kv(key, value, table[1], 35)
    close(dense[1:2], ref_attention(q[1:2], kb, vb, 0.2))


def test_pa_reads_value_with_key_strides(fakes, device):
    """The kernel gets key_cache's strides only: a value_cache of another layout is misread."""
    q, key, value, table, lens, cu_q = pa_inputs(device)
    big = torch.randn(2 * value.numel(), device=device).to(F16)
    other = big[:value.numel()].view(value.shape)  # dense [blocks, bs, Hkv, D]
    assert other.stride() != key.stride()
    out = pa(q, key, other, table, lens, cu_q)
    misread = torch.as_strided(big, value.shape, key.stride())
    kb, vb = dense_kv(key, misread, table[0], 20)
    close(out[:1], ref_attention(q[:1], kb, vb, 0.2))


def test_pa_reads_one_past_the_cu_query_lens_slice(fakes, device):
    """cu_query_lens[b + 1] is read for every sequence: vLLM's query_start_loc
    slice works through the storage behind it; a tensor without it does not."""
    q, key, value, table, lens, cu_q = pa_inputs(device)
    pa(q, key, value, table, lens, cu_q)  # the slice: fine
    with pytest.raises(RuntimeError, match="out of bounds"):
        pa(q, key, value, table, lens, cu_q.clone())


def test_pa_skips_multi_token_rows(fakes, device):
    """A sequence whose cu_query_lens span is more than one token is not written;
    the next one reads (and writes) query row cu_query_lens[b]."""
    _, key, value, table, lens, _ = pa_inputs(device)
    q = torch.randn(3, 4, D64, device=device).to(F16)
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)[:2]
    out = pa(q, key, value, table, lens, cu_q)
    assert torch.isnan(out[:2]).all()
    kb, vb = dense_kv(key, value, table[1], 35)
    close(out[2:], ref_attention(q[2:], kb, vb, 0.2))


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_pa_decodes_fp8_bytes_as_the_arch_format(device, arch):
    """kv_cache_dtype "fp8": cache_t is uint8, decoded by the hardware's fp8
    conversion (fnuz on gfx942, fn on gfx950), whatever the tensor's dtype."""
    export = AiterExport()
    install_fa_fakes(export, arch=arch)
    with export:
        q, key, value, table, lens, cu_q = pa_inputs(device, fp8=torch.float8_e4m3fn)
        out = pa(q, key.view(torch.float8_e4m3fn), value.view(torch.float8_e4m3fn), table,
                 lens, cu_q, kv_cache_dtype="fp8", ks=0.5, vs=2.0)
    fmt = torch.float8_e4m3fn if arch == "gfx950" else torch.float8_e4m3fnuz
    kb, vb = dense_kv(key.view(fmt), value.view(fmt), table[0], 20)
    close(out[:1], ref_attention(q[:1], kb.double() * 0.5, vb.double() * 2.0, 0.2))


def test_pa_window_keeps_the_last_tokens(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device)
    out = pa(q, key, value, table, lens, cu_q, window=8)
    kb, vb = dense_kv(key, value, table[1], 35)
    close(out[1:2], ref_attention(q[1:2], kb, vb, 0.2, left=7))


def test_pa_refuses_context_past_max_context_len(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device, seq_lens=(20, 300))
    table = torch.arange(1, 21, dtype=torch.int32, device=device).repeat(2, 1) % 6
    with pytest.raises(KernelMisread, match="exceeds"):
        pa(q, key, value, table, lens, cu_q, max_ctx=200)


def test_pa_refuses_partition_size_other_than_256(fakes, device):
    q, key, value, table, lens, cu_q = pa_inputs(device)
    with pytest.raises(KernelMisread, match="T_PAR_SIZE"):
        pa(q, key, value, table, lens, cu_q, partition_size=512)
