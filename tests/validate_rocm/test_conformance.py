"""The AITER fakes (tests/fakes/) against what can be observed of AITER itself.

Each row of ROWS is one constraint of AITER at the ref the fakes were read at
(``aiter_fa.AITER_COMMIT``): the file and line that state it, a call that breaks it,
and what AITER does with that call -- raises (its exception class and the words of
its source) or, where nothing checks, reads the wrong memory (the fake raises
``KernelMisread`` instead).  Checked:

* here: the fake refuses the call as the cited line says, and the citation lies in a
  range the fake's own docstring cites for that file;
* with ``AITER_SRC=<ROCm/aiter checked out at AITER_COMMIT>``: the cited line says those
  words (skipped without it);
* on ROCm (``rocm`` mark, skipped elsewhere): real AITER refuses each call the same way,
  and computes what the fake computes on an accepted call of each op.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

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
             v=_randn(g, 11, 2, d, dtype=dtype), cu_seqlens_q=torch.tensor([0, 3, 8]),
             cu_seqlens_k=torch.tensor([0, 6, 11]))
    a = {k: v.to(device) for k, v in a.items()}
    a["cu_seqlens_q"], a["cu_seqlens_k"] = a["cu_seqlens_q"].int(), a["cu_seqlens_k"].int()
    if breaks is None:
        return (aiter.flash_attn_varlen_func(**a, max_seqlen_q=5, max_seqlen_k=6, causal=True),)
    breaks(a, arch)
    return aiter.ops.mha.mha_varlen_fwd(*a.values(), 5, 6, 0, 0.0, d ** -0.5, 0.0, False, True,
                                        -1, -1, 0, False, False)


def _paged(device, g, d=64, bs=16, dtype=BF16):
    """A [blocks, block_size, kv heads, D] K and V, a block table and the lengths (20, 35)."""
    key, value = _randn(g, 6, bs, 2, d, dtype=dtype), _randn(g, 6, bs, 2, d, dtype=dtype)
    table = torch.tensor([[3, 1, 5], [2, 4, 1]], dtype=torch.int32)
    lens = torch.tensor([20, 35], dtype=torch.int32)
    return [x.to(device) for x in (key, value, table, lens)]


def unified(device, arch, breaks=None):
    """aiter.ops.triton.attention.unified_attention.unified_attention, decode rows; (out,)."""
    ua = importlib.import_module("aiter.ops.triton.attention.unified_attention")
    g = torch.Generator().manual_seed(2)
    key, value, table, lens = _paged(device, g)
    q = _randn(g, 2, 4, 64).to(device)
    a = dict(q=q, k=key, v=value, out=torch.zeros_like(q),
             cu_seqlens_q=torch.arange(3, dtype=torch.int32, device=device), max_seqlen_q=1,
             seqused_k=lens, max_seqlen_k=35, softmax_scale=0.125, causal=True,
             window_size=(-1, -1), block_table=table, softcap=0, q_descale=None,
             k_descale=None, v_descale=None)
    if breaks:
        breaks(a, arch)
    ua.unified_attention(**a)
    return (a["out"],)


def paged_v1(device, arch, breaks=None):
    """aiter.paged_attention_v1, NHD cache, one query row per sequence; (out,)."""
    import aiter

    g = torch.Generator().manual_seed(3)
    key, value, table, lens = _paged(device, g)
    q = _randn(g, 2, 4, 64).to(device)
    ones = torch.ones(1, device=device)
    a = dict(out=torch.zeros_like(q), workspace_buffer=torch.empty(1 << 16, dtype=torch.uint8,
             device=device), query=q, key_cache=key, value_cache=value, scale=0.125,
             block_tables=table, cu_query_lens=torch.arange(4, dtype=torch.int32,
             device=device)[:2], context_lens=lens, max_context_len=35, alibi_slopes=None,
             kv_cache_dtype="auto", kv_cache_layout="NHD", logits_soft_cap=0.0, k_scale=ones,
             v_scale=ones)
    if breaks:
        breaks(a, arch)
    aiter.paged_attention_v1(**a)
    return (a["out"],)


class Row(NamedTuple):
    id: str
    call: object  # (device, arch, breaks) -> outputs
    breaks: object  # (args, arch) -> None: makes the call break the constraint
    raises: type | None  # AITER's exception class; None: AITER misreads (fake: KernelMisread)
    words: str  # in AITER's message and at the cited line
    file: str
    line: int


def _put(**kw):
    return lambda a, arch: a.update({k: f(a, arch) for k, f in kw.items()})


MLA_CU, DTYPES = "csrc/kernels/cache_kernels.cu", "aiter/utility/dtypes.py"
CK = "csrc/py_itfs_ck/mha_varlen_fwd_kernels.cu"
PA_PY, PA_CUH = "csrc/cpp_itfs/pa/pa_v1.py", "csrc/cpp_itfs/pa/pa_v1.cuh"
ROWS = [
    Row("mla-lora-rank", mla, _put(kv_c=lambda a, _: a["kv_c"][:, :256]), RuntimeError,
        "kv_lora_rank and qk_lora_rank must be the same", MLA_CU, 4247),
    Row("mla-int8-cache", mla, _put(kv_cache=lambda a, _: a["kv_cache"].to(torch.int8)),
        RuntimeError, "kv cache data type is not supported", MLA_CU, 4273),
    Row("mla-strided-kv_c", mla, _put(kv_c=lambda a, _: a["kv_c"].repeat(1, 2)[:, ::2]),
        RuntimeError, "kv_c stride(-1) must be equal to 1", MLA_CU, 4291),
    Row("mla-foreign-fp8", mla, _put(kv_cache=lambda a, arch: a["kv_cache"].to(
        FOREIGN_FP8[arch])), AssertionError, "Unsupported dtype", DTYPES, 57),
    Row("mla-float64", mla, _put(q_nope=lambda a, _: a["q_nope"].double()), AssertionError,
        "Unsupported dtype", DTYPES, 57),
    Row("mla-int32-positions", mla, _put(positions=lambda a, _: a["positions"].int()), None,
        "const int64_t* __restrict__ positions", MLA_CU, 2215),
    Row("varlen-fp32", varlen, _put(q=lambda a, _: a["q"].float()), NotImplementedError,
        "Unsupported dtype for MHA", "aiter/ops/mha.py", 774),
    Row("varlen-k-dtype", varlen, _put(k=lambda a, _: a["k"].bfloat16()), RuntimeError,
        "query and key must have the same dtype", CK, 395),
    Row("varlen-int64-cu", varlen, _put(cu_seqlens_q=lambda a, _: a["cu_seqlens_q"].long()),
        RuntimeError, "cu_seqlens_q must have dtype int32", CK, 417),
    Row("varlen-strided-q", varlen, _put(q=lambda a, _: a["q"].repeat(1, 1, 2)[..., ::2]),
        RuntimeError, "Input tensor must have contiguous last dimension", CK, 440),
    Row("varlen-strided-cu", varlen, _put(cu_seqlens_q=lambda a, _: a["cu_seqlens_q"].repeat(
        2)[::2]), RuntimeError, "must be contiguous", "csrc/include/mha_common.h", 17),
    Row("varlen-heads", varlen, _put(k=lambda a, _: a["k"][:, :1].repeat(1, 3, 1),
                                     v=lambda a, _: a["v"][:, :1].repeat(1, 3, 1)),
        RuntimeError, "Number of heads in key/value must divide number of heads in query",
        CK, 478),
    Row("unified-not-causal", unified, _put(causal=lambda a, _: False), AssertionError,
        "Only causal attention is supported", "aiter/ops/triton/attention/unified_attention.py",
        333),
    Row("pa-fp32-query", paged_v1, _put(query=lambda a, _: a["query"].float()), ValueError,
        "Unsupported data type", PA_PY, 147),
    Row("pa-e5m2-cache", paged_v1, _put(kv_cache_dtype=lambda a, _: "fp8_e5m2"), ValueError,
        "Unsupported kv_cache_dtype", PA_PY, 158),
    Row("pa-short-table", paged_v1, _put(block_tables=lambda a, _: a["block_tables"][:, :2]
                                         .contiguous()), ValueError, "is too small", PA_PY, 82),
    Row("pa-int64-table", paged_v1, _put(block_tables=lambda a, _: a["block_tables"].long()),
        None, "const int* __restrict__ block_tables", PA_CUH, 46),
]
RAISING = [r for r in ROWS if r.raises is not None]
FAKE_FILES = {mla: "aiter_mla.py", varlen: "aiter_fa.py", unified: "aiter_fa.py",
              paged_v1: "aiter_fa.py"}


@pytest.mark.parametrize("arch", sorted(aiter_fa.ARCHS))
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_the_fake_refuses_as_the_cited_source_says(row, arch):
    fake = fake_aiter.install(arch)
    try:
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
    """Every ``l.N`` / ``l.N-M`` after a mention of ``file`` (or its module name), up to
    the next file named."""
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
    fake = (ROOT / "tests/fakes" / FAKE_FILES[row.call]).read_text()
    ranges = _cited_ranges(fake, row.file)
    assert ranges, f"{FAKE_FILES[row.call]} cites no line of {row.file}"
    assert any(a <= row.line <= b for a, b in ranges), (row.line, ranges)


@pytest.mark.parametrize("path", ["tests/fakes/aiter_fa.py", "tests/fakes/aiter_mla.py",
                                  "tests/fakes/aiter_export.py", "docs/aiter-calls.md",
                                  "docs/aiter-calls-fa.md", "docs/rocm.md",
                                  "benchmarks/notes/paged_context.md"])
def test_citations_name_the_ref_read_and_the_pinned_ref(path):
    text = (ROOT / path).read_text()
    pin = re.search(r"^AITER_REF=(\S+)", (ROOT / "pins.env").read_text(), re.M).group(1)
    assert aiter_fa.AITER_COMMIT in text, f"{path} does not say which AITER ref it was read at"
    assert pin in text, f"{path} does not name the pinned AITER {pin} (re-check its citations)"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_the_cited_line_says_it(row):
    src = os.environ.get("AITER_SRC")
    if not src:
        pytest.skip("AITER_SRC= (a checkout of ROCm/aiter at the fakes' ref) is not given")
    if (Path(src) / ".git").exists():
        head = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout
        assert head.startswith(aiter_fa.AITER_COMMIT), f"AITER_SRC is at {head}"
    lines = (Path(src) / row.file).read_text().splitlines()
    assert row.words in lines[row.line - 1], lines[row.line - 1]


@pytest.fixture
def device_arch():
    pytest.importorskip("aiter")
    return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]


@pytest.mark.rocm
@pytest.mark.parametrize("row", RAISING, ids=lambda r: r.id)
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
