"""The AITER fakes (tests/fakes/) against what can be observed of AITER itself: each of ROWS is
a constraint of AITER at AITER_COMMIT, which the fake must refuse as the cited line says; with
AITER_SRC= the line is read; on ROCm real AITER must refuse and compute as the fake does."""

from __future__ import annotations

import importlib
import os
import re
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import aiter_fa
import fake_aiter

ROOT = Path(__file__).resolve().parents[2]
BF16, F16 = torch.bfloat16, torch.float16
FOREIGN_FP8 = {"gfx942": torch.float8_e4m3fn, "gfx950": torch.float8_e4m3fnuz}


def _randn(g, *shape, dtype=BF16):
    return torch.randn(*shape, generator=g).to(dtype)


def mla(device, arch, breaks=None):
    """aiter.fused_qk_rope_concat_and_cache_mla on DeepSeek's sizes, bf16; (kv_cache, q_out)."""
    import aiter

    g = torch.Generator().manual_seed(0)
    t, h, lora, pe = 4, 4, 512, 64
    angle = torch.rand(64, pe // 2, generator=g) * 6.28
    a = dict(q_nope=_randn(g, t, h, lora), q_pe=_randn(g, t, h, pe), kv_c=_randn(g, t, lora),
             k_pe=_randn(g, t, pe), kv_cache=torch.zeros(8, 16, lora + pe, dtype=BF16),
             q_out=torch.zeros(t, h, lora + pe, dtype=BF16),
             slot_mapping=torch.tensor([5, -1, 9, 17]), k_scale=torch.ones(1),
             q_scale=torch.ones(1), positions=torch.tensor([3, 7, 30, 63]),
             cos_cache=angle.cos().to(BF16), sin_cache=angle.sin().to(BF16))
    a = {k: v.to(device) for k, v in a.items()}
    if breaks:
        breaks(a, arch)
    aiter.fused_qk_rope_concat_and_cache_mla(**a, is_neox=False, is_nope_first=True)
    return a["kv_cache"], a["q_out"]


def varlen(device, arch, breaks=None, dtype=F16, d=64):
    """aiter.ops.mha.mha_varlen_fwd (CK) with breaks, else flash_attn_varlen_func; (out,)."""
    import aiter

    g = torch.Generator().manual_seed(1)
    a = dict(q=_randn(g, 8, 4, d, dtype=dtype), k=_randn(g, 11, 2, d, dtype=dtype),
             v=_randn(g, 11, 2, d, dtype=dtype), cu_seqlens_q=torch.tensor([0, 3, 8]).int(),
             cu_seqlens_k=torch.tensor([0, 6, 11]).int())
    a = {k: v.to(device) for k, v in a.items()}
    if breaks is None:
        return (aiter.flash_attn_varlen_func(**a, max_seqlen_q=5, max_seqlen_k=6, causal=True),)
    breaks(a, arch)
    return aiter.ops.mha.mha_varlen_fwd(*a.values(), 5, 6, 0, 0.0, d ** -0.5, 0.0, False, True,
                                        -1, -1, 0, False, False)


def _paged(device, g, d=64, bs=16):
    """[blocks, block_size, kv heads, D] K and V, a block table, lengths (20, 35), 2 queries."""
    key, value = _randn(g, 6, bs, 2, d), _randn(g, 6, bs, 2, d)
    table = torch.tensor([[3, 1, 5], [2, 4, 1]], dtype=torch.int32)
    lens = torch.tensor([20, 35], dtype=torch.int32)
    return [x.to(device) for x in (key, value, table, lens, _randn(g, 2, 4, d))]


def unified(device, arch, breaks=None):
    """aiter.ops.triton.attention.unified_attention.unified_attention, decode rows; (out,)."""
    ua = importlib.import_module("aiter.ops.triton.attention.unified_attention")
    key, value, table, lens, q = _paged(device, torch.Generator().manual_seed(2))
    a = dict(q=q, k=key, v=value, out=torch.zeros_like(q), cu_seqlens_q=torch.arange(3).int()
             .to(device), max_seqlen_q=1, seqused_k=lens, max_seqlen_k=35, softmax_scale=0.125,
             causal=True, window_size=(-1, -1), block_table=table, softcap=0, q_descale=None,
             k_descale=None, v_descale=None)
    if breaks:
        breaks(a, arch)
    ua.unified_attention(**a)
    return (a["out"],)


def paged_v1(device, arch, breaks=None):
    """aiter.paged_attention_v1, NHD cache, one query row per sequence; (out,)."""
    import aiter

    key, value, table, lens, q = _paged(device, torch.Generator().manual_seed(3))
    one, cu = torch.ones(1, device=device), torch.arange(4).int().to(device)
    a = dict(out=torch.zeros_like(q), workspace_buffer=torch.empty(1 << 16, dtype=torch.uint8)
             .to(device), query=q, key_cache=key, value_cache=value, scale=0.125,
             block_tables=table, cu_query_lens=cu[:2], context_lens=lens, max_context_len=35,
             alibi_slopes=None, kv_cache_dtype="auto", kv_cache_layout="NHD",
             logits_soft_cap=0.0, k_scale=one, v_scale=one)
    if breaks:
        breaks(a, arch)
    aiter.paged_attention_v1(**a)
    return (a["out"],)


# call: mla / varlen / unified / paged_v1; breaks(args, arch): the call then breaks the
# constraint; raises: AITER's exception class, None where AITER misreads (fake: KernelMisread);
# words: in AITER's message and at line ``line`` of ``file``.
Row = namedtuple("Row", "id call breaks raises words file line")


MLA_CU, DTYPES = "csrc/kernels/cache_kernels.cu", "aiter/utility/dtypes.py"
CK = "csrc/py_itfs_ck/mha_varlen_fwd_kernels.cu"
PA_PY, PA_CUH = "csrc/cpp_itfs/pa/pa_v1.py", "csrc/cpp_itfs/pa/pa_v1.cuh"
ROWS = [
    Row("mla-lora-rank", mla, lambda a, _: a.update(kv_c=a["kv_c"][:, :256]), RuntimeError,
        "kv_lora_rank and qk_lora_rank must be the same", MLA_CU, 4247),
    Row("mla-strided-kv_c", mla, lambda a, _: a.update(kv_c=a["kv_c"].repeat(1, 2)[:, ::2]),
        RuntimeError, "kv_c stride(-1) must be equal to 1", MLA_CU, 4291),
    Row("mla-foreign-fp8", mla, lambda a, arch: a.update(kv_cache=a["kv_cache"].to(
        FOREIGN_FP8[arch])), AssertionError, "Unsupported dtype", DTYPES, 57),
    Row("mla-float64", mla, lambda a, _: a.update(q_nope=a["q_nope"].double()), AssertionError,
        "Unsupported dtype", DTYPES, 57),
    Row("mla-int32-positions", mla, lambda a, _: a.update(positions=a["positions"].int()), None,
        "const int64_t* __restrict__ positions", MLA_CU, 2215),
    Row("varlen-fp32", varlen, lambda a, _: a.update(q=a["q"].float()), NotImplementedError,
        "Unsupported dtype for MHA", "aiter/ops/mha.py", 774),
    Row("varlen-k-dtype", varlen, lambda a, _: a.update(k=a["k"].bfloat16()), RuntimeError,
        "query and key must have the same dtype", CK, 395),
    Row("varlen-strided-q", varlen, lambda a, _: a.update(q=a["q"].repeat(1, 1, 2)[..., ::2]),
        RuntimeError, "Input tensor must have contiguous last dimension", CK, 440),
    Row("varlen-strided-cu", varlen, lambda a, _: a.update(cu_seqlens_q=a["cu_seqlens_q"]
        .repeat(2)[::2]), RuntimeError, "must be contiguous", "csrc/include/mha_common.h", 17),
    Row("unified-not-causal", unified, lambda a, _: a.update(causal=False), AssertionError,
        "Only causal attention is supported", "aiter/ops/triton/attention/unified_attention.py",
        333),
    Row("pa-fp32-query", paged_v1, lambda a, _: a.update(query=a["query"].float()), ValueError,
        "Unsupported data type", PA_PY, 147),
    Row("pa-short-table", paged_v1, lambda a, _: a.update(block_tables=a["block_tables"][:, :2]
        .contiguous()), ValueError, "is too small", PA_PY, 82),
    Row("pa-int64-table", paged_v1, lambda a, _: a.update(block_tables=a["block_tables"].long()),
        None, "const int* __restrict__ block_tables", PA_CUH, 46),
]
@pytest.mark.parametrize("arch", sorted(aiter_fa.ARCHS))
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_the_fake_refuses_as_the_cited_source_says(row, arch):
    fake = fake_aiter.install(arch)
    try:
        row.call("cpu", arch, lambda a, arch: None)  # the call as it is: accepted
        with pytest.raises(row.raises or RuntimeError) as caught:
            row.call("cpu", arch, row.breaks)
    finally:
        fake.uninstall()
    if row.raises is None:  # aiter_mla's or aiter_fa's
        assert type(caught.value).__name__ == "KernelMisread", caught.value
    else:
        assert row.words in str(caught.value)


PATH = re.compile(r"[\w/]+\.(?:py|cuh|cu|hpp|h)\b")


def _cited_ranges(text: str, file: str) -> list[tuple[int, int]]:
    """Each ``l.N[-M]`` after a mention of ``file`` (or its module), up to the next file named."""
    text = " ".join(text.split())
    ranges = []
    for name in (file, file.removesuffix(".py").replace("/", ".")):
        for mention in re.finditer(re.escape(name) + r"\b", text):
            rest = text[mention.end():]
            stop = PATH.search(rest)
            for a, b in re.findall(r"l\.(\d+)(?:-(\d+))?", rest[:stop.start() if stop else None]):
                ranges.append((int(a), int(b or a)))
    return ranges


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_each_constraint_is_within_what_its_fake_cites(row):
    fake = "aiter_mla.py" if row.call is mla else "aiter_fa.py"
    ranges = _cited_ranges((ROOT / "tests/fakes" / fake).read_text(), row.file)
    assert ranges, f"{fake} cites no line of {row.file}"
    assert any(a <= row.line <= b for a, b in ranges), (row.line, ranges)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_the_cited_line_says_it(row):
    src = os.environ.get("AITER_SRC")
    if not src:
        pytest.skip(f"AITER_SRC= (ROCm/aiter checked out at {aiter_fa.AITER_COMMIT}) not given")
    lines = (Path(src) / row.file).read_text().splitlines()
    assert row.words in lines[row.line - 1], lines[row.line - 1]


@pytest.fixture
def device_arch():
    pytest.importorskip("aiter")
    return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]


@pytest.mark.rocm
@pytest.mark.parametrize("row", [r for r in ROWS if r.raises], ids=lambda r: r.id)
def test_real_aiter_refuses_as_the_fake(row, device_arch):
    with pytest.raises(row.raises, match=re.escape(row.words)):
        row.call("cuda", device_arch, row.breaks)


@pytest.mark.rocm
@pytest.mark.parametrize("call, kw", [(mla, {}), (varlen, {}), (varlen, {"dtype": BF16, "d": 128}),
                                      (unified, {}), (paged_v1, {})],
                         ids=["mla", "varlen-ck", "varlen-v3", "unified", "paged_v1"])
def test_real_aiter_computes_what_the_fake_computes(call, kw, device_arch):
    fake = fake_aiter.install(device_arch)
    try:
        want = call("cuda", device_arch, **kw)
    finally:
        fake.uninstall()
    got = call("cuda", device_arch, **kw)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
