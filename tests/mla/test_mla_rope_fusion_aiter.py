"""The AITER decode path: rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla.

CPU tier: the strict fake of AITER's op (``tests/fakes/aiter_mla.py``),
exported as real AITER exports it -- ``(*args, **kwargs)`` over a
``torch.ops.aiter`` op whose schema names the arguments -- and reading its
inputs by raw pointer as the HIP kernel does (cos / sin with no stride).
Checked: detection on that export, the wrapper against a float64 RoPE
reference at every position (NeoX and GPT-J, padded slots, fp8 caches in both
e4m3 formats), the cos / sin tables and what the wrapper refuses, the four
calls the host benchmark times doing the same work, DCP limits decided before
the AITER path is chosen, a changed schema failing loudly.
ROCm tier: the real op against the Triton kernel.
"""

import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import _mla_rope_harness as h
import fake_aiter
import vllm._aiter_ops as aiter_ops
from aiter_export import AiterExport
from aiter_mla import MLA_OP, AiterCheckError, FakeMlaRopeOp
from vllm._aiter_ops import AiterSchemaError, rocm_aiter_ops
from vllm.model_executor.layers.attention import mla_rope_kv_cache
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVDecision,
    RopeKVFacts,
    RopeKVPath,
    decide_rope_kv_path,
)

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
ARCH_OF = {FN: "gfx950", FNUZ: "gfx942"}


def _clear():
    aiter_ops._aiter_mla_rope_kv_op.cache_clear()


@pytest.fixture
def strict_aiter():
    """Install the strict fake (as importing real AITER would); returns a
    function (arch) -> the fake op, which records its calls."""
    installed = []

    def install(arch=ARCH_OF[h.fp8_dtype()]):
        fake = fake_aiter.install(arch)
        installed.append(fake)
        _clear()
        return fake.mla_op

    yield install
    for fake in reversed(installed):
        fake.uninstall()
    _clear()


# --- detection on the real export shape ----------------------------------------

def test_detected_through_the_guard_export(strict_aiter):
    op = strict_aiter()
    from aiter.ops.cache import fused_qk_rope_concat_and_cache_mla as export

    # What patch 0302's first probe read: nothing but (*args, **kwargs).
    assert list(inspect.signature(export).parameters) == ["args", "kwargs"]
    assert rocm_aiter_ops.mla_rope_kv_op_support() == (None, True)
    assert not op.calls


def _skewed_export(params: str, annotations: dict | None = None) -> AiterExport:
    """An AITER whose stub (hence registered schema) has ``params``."""
    scope = {"Tensor": torch.Tensor}
    exec(f"def {MLA_OP}({params}) -> None: ...", scope)  # noqa: S102
    stub = scope[MLA_OP]
    export = AiterExport()
    export.register_guarded("aiter.ops.cache", stub, lambda *a, **k: None)
    return export.install()


TENSORS = ("q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale, "
           "positions, cos_cache, sin_cache").split(", ")
ALL = ", ".join(f"{n}: Tensor" for n in TENSORS) + ", is_neox: bool, is_nope_first: bool"

SKEW = [
    ("without_compute_all_q_rope", ALL, None, False),
    ("with_compute_all_q_rope", ALL + ", compute_all_q_rope: bool = False", None, True),
    ("renamed", ALL.replace("cos_cache: Tensor, sin_cache: Tensor",
                            "cos_sin_cache: Tensor, unused: Tensor"), "schema", None),
    ("reordered", ALL.replace("q_out: Tensor, slot_mapping: Tensor",
                              "slot_mapping: Tensor, q_out: Tensor"), "schema", None),
    ("retyped", ALL.replace("is_neox: bool", "is_neox: int"), "schema", None),
    ("new_required", ALL + ", rot_dim: int", "schema", None),
    ("new_optional_unknown", ALL + ", scale_fmt: int = 0", "schema", None),
    ("fewer", ALL.replace(", is_nope_first: bool", ""), "schema", None),
]


@pytest.mark.parametrize("params, problem, all_q_rope", [s[1:] for s in SKEW],
                         ids=[s[0] for s in SKEW])
def test_schema_skew(params, problem, all_q_rope):
    export = _skewed_export(params)
    _clear()
    try:
        if problem is None:
            assert rocm_aiter_ops.mla_rope_kv_op_support() == (None, all_q_rope)
        else:
            with pytest.raises(AiterSchemaError) as err:
                rocm_aiter_ops.mla_rope_kv_op_support()
            msg = str(err.value)
            # Loud: the op, what the series expects and what AITER registered.
            assert f"aiter::{MLA_OP}" in msg and "expected:" in msg and "found:" in msg
            assert "Tensor cos_cache" in msg and "VLLM_ROCM_USE_AITER_MLA_ROPE_KV_FUSION=0" in msg
            with pytest.raises(AiterSchemaError):
                rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(*([None] * 12))
    finally:
        export.uninstall()
        _clear()


def test_schema_skew_fails_the_layer_at_startup(monkeypatch):
    """With the AITER fusion asked for, building the layer raises: no model
    runs with an op whose arguments moved."""
    from vllm.platforms import current_platform

    export = _skewed_export(ALL.replace("q_out: Tensor, slot_mapping: Tensor",
                                        "slot_mapping: Tensor, q_out: Tensor"))
    _clear()
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(rocm_aiter_ops, "is_mla_rope_kv_fusion_enabled",
                        classmethod(lambda c: True))
    try:
        with pytest.raises(AiterSchemaError, match=MLA_OP):
            mla_rope_kv_cache.MLARopeKVFusion.for_layer(
                h.make_layer(h.CASES_BY_NAME["decode_only"]), h.make_rope("neox"))
    finally:
        export.uninstall()
        _clear()


def test_exported_but_not_registered_is_a_reason(monkeypatch):
    """An AITER that exports the op without a torch.library registration
    cannot be checked: refused with a reason, not called blind."""
    mod = types.ModuleType("aiter.ops.cache")
    setattr(mod, MLA_OP, lambda *a, **k: None)
    for name in ("aiter", "aiter.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "aiter.ops.cache", mod)
    monkeypatch.setattr(torch.ops, "aiter", types.SimpleNamespace())
    _clear()
    try:
        problem, _ = rocm_aiter_ops.mla_rope_kv_op_support()
    finally:
        _clear()
    assert "not registered" in problem


def test_missing_op_and_broken_import_are_reasons(monkeypatch):
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("HIP runtime mismatch")

    monkeypatch.setitem(sys.modules, "aiter", Broken("aiter"))
    monkeypatch.delitem(sys.modules, "aiter.ops", raising=False)
    monkeypatch.delitem(sys.modules, "aiter.ops.cache", raising=False)
    _clear()
    try:
        problem, _ = rocm_aiter_ops.mla_rope_kv_op_support()
        assert problem.startswith("import failed:")
        with pytest.raises(RuntimeError, match="import failed"):
            rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(*([None] * 12))
    finally:
        _clear()


# --- the wrapper through the strict fake vs a float64 reference ----------------

def _rope64(x, cos, sin, is_neox):
    x = x.double()
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)


def _decode_inputs(t, heads, lora, rot, dtype, max_pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).double() / rot)
    freqs = torch.arange(max_pos).double()[:, None] * inv
    cos_sin64 = torch.cat((freqs.cos(), freqs.sin()), -1)
    return dict(
        # The W_UK bmm output is [H, T, L] transposed: not dense.
        ql_nope=torch.randn(heads, t, lora, generator=g).to(dtype).transpose(0, 1),
        q_pe=torch.randn(t, heads, 3 * rot, generator=g).to(dtype)[..., rot:2 * rot],
        kv_c=torch.randn(t, lora, generator=g).to(dtype),
        k_pe=torch.randn(t, lora + rot, generator=g).to(dtype)[:, lora:].unsqueeze(1),
        cos_sin64=cos_sin64,
    )


def _reference(inp, positions, slots, is_neox, rot):
    half = rot // 2
    cos = inp["cos_sin64"][positions, :half]
    sin = inp["cos_sin64"][positions, half:]
    q = torch.cat((inp["ql_nope"].double(),
                   _rope64(inp["q_pe"], cos[:, None], sin[:, None], is_neox)), -1)
    rows = torch.cat((inp["kv_c"].double(), _rope64(inp["k_pe"].squeeze(1), cos, sin,
                                                    is_neox)), -1)
    return q, rows


@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("heads, lora, rot, block_size, target", [
    (4, 512, 64, 16, "opt"),        # DeepSeek dims, vLLM's block size 16
    (2, 512, 64, 1, "per_head"),    # AITER MLA's block size 1
    (2, 32, 16, 16, "general"),     # small dims: the general decode kernel
])
def test_wrapper_matches_float64_rope(strict_aiter, is_neox, heads, lora, rot, block_size,
                                      target):
    op = strict_aiter()
    t, max_pos, dtype = 5, 40, torch.float16
    inp = _decode_inputs(t, heads, lora, rot, dtype, max_pos)
    # AITER's tables from the fp32 rotary cache, in the kv_c dtype.
    cos_sin = rocm_aiter_ops.mla_rope_cos_sin(inp["cos_sin64"].float(), dtype)
    positions = torch.tensor([1, 7, max_pos - 1, 0, 23])
    slots = torch.tensor([[1], [-1], [block_size * 2 + 2], [0], [block_size * 8 - 1]])
    cache = torch.zeros(8, block_size, lora + rot, dtype=dtype)
    q_out = torch.full((t, heads, lora + rot), float("nan"), dtype=dtype)
    one = torch.ones(1)
    rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
        inp["ql_nope"], inp["q_pe"], inp["kv_c"], inp["k_pe"], cache, q_out, slots,
        positions, cos_sin, is_neox, one, one)
    assert [c["target"] for c in op.calls] == [target]

    q_ref, rows_ref = _reference(inp, positions, slots, is_neox, rot)
    keep = slots.flatten() >= 0
    torch.testing.assert_close(q_out[keep].double(), q_ref[keep], rtol=2e-3, atol=2e-3)
    assert q_out[~keep].isnan().all()  # slot -1: q_out rows untouched
    flat = cache.view(-1, lora + rot)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for i, s in enumerate(slots.flatten().tolist()):
        if s >= 0:
            torch.testing.assert_close(flat[s].double(), rows_ref[i], rtol=2e-3, atol=2e-3)
            written[s] = True
    assert not flat[~written].any()  # nothing else written


@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["e4m3fn-gfx950", "e4m3fnuz-gfx942"])
@pytest.mark.parametrize("quant_query", [False, True], ids=["model-q", "fp8-q"])
def test_wrapper_fp8_cache(strict_aiter, monkeypatch, fp8, quant_query):
    """vLLM allocates fp8 caches as uint8: the op gets the platform fp8 type,
    and values / k_scale (q_out / q_scale) in it."""
    monkeypatch.setattr(aiter_ops, "FP8_DTYPE", fp8)
    op = strict_aiter(ARCH_OF[fp8])
    t, heads, lora, rot, bs, max_pos, dtype = 3, 4, 512, 64, 16, 32, torch.bfloat16
    inp = _decode_inputs(t, heads, lora, rot, dtype, max_pos, seed=1)
    positions, slots = torch.tensor([5, 31, 2]), torch.tensor([7, -1, 40])
    cache = torch.zeros(4, bs, lora + rot, dtype=torch.uint8)
    q_out = torch.zeros(t, heads, lora + rot, dtype=fp8 if quant_query else dtype)
    k_scale, q_scale = torch.tensor([0.5]), torch.tensor([0.25])
    rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
        inp["ql_nope"], inp["q_pe"], inp["kv_c"], inp["k_pe"], cache, q_out, slots,
        positions, rocm_aiter_ops.mla_rope_cos_sin(inp["cos_sin64"], dtype), False, k_scale,
        q_scale if quant_query else torch.ones(1))
    (call,) = op.calls
    assert call["kv_cache"].dtype is fp8 and call["kv_cache"].data_ptr() == cache.data_ptr()
    q_ref, rows_ref = _reference(inp, positions, slots, False, rot)
    fp8_rel = 2.0 ** -3  # e4m3: 3 mantissa bits
    got = cache.view(fp8).view(-1, lora + rot).double() * 0.5
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(got[s], rows_ref[i], rtol=fp8_rel, atol=2e-2)
    qo = q_out.double() * (0.25 if quant_query else 1.0)
    tol = fp8_rel if quant_query else 1e-2
    for i in (0, 2):
        torch.testing.assert_close(qo[i], q_ref[i], rtol=tol, atol=2e-2)


def test_cos_sin_tables_are_what_the_kernel_reads(strict_aiter):
    """mla_rope_cos_sin: one contiguous [max_pos, R/2] cos and sin in the kv_c
    dtype (not views of cat(cos, sin)); the op gets exactly them."""
    op = strict_aiter()
    t, heads, lora, rot, dtype = 2, 2, 32, 16, torch.float16
    inp = _decode_inputs(t, heads, lora, rot, dtype, 16)
    cos_sin = inp["cos_sin64"].float()  # fp32 cache, fp16 model
    tables = rocm_aiter_ops.mla_rope_cos_sin(cos_sin, dtype)
    rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
        inp["ql_nope"], inp["q_pe"], inp["kv_c"], inp["k_pe"],
        torch.zeros(2, 16, lora + rot, dtype=dtype),
        torch.empty(t, heads, lora + rot, dtype=dtype), torch.tensor([1, 2]),
        torch.tensor([3, 4]), tables, True, torch.ones(1), torch.ones(1))
    (call,) = op.calls
    cos, sin = call["cos_cache"], call["sin_cache"]
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (16, rot // 2)
    assert cos.dtype is dtype and torch.equal(cos, cos_sin[:, : rot // 2].to(dtype))
    assert torch.equal(sin, cos_sin[:, rot // 2:].to(dtype))
    assert cos.data_ptr() == tables.data_ptr()  # no copy per call


@pytest.mark.parametrize("bad", ["vllm-layout", "dtype", "strided"])
def test_wrapper_refuses_other_cos_sin_before_the_op(strict_aiter, bad):
    """vLLM's own [max_pos, R] cache, tables in another dtype or not dense:
    a clear error, and the op is not called."""
    op = strict_aiter()
    t, heads, lora, rot, dtype = 2, 2, 32, 16, torch.float16
    inp = _decode_inputs(t, heads, lora, rot, dtype, 16)
    cos_sin = {
        "vllm-layout": inp["cos_sin64"].to(dtype),
        "dtype": rocm_aiter_ops.mla_rope_cos_sin(inp["cos_sin64"], torch.bfloat16),
        "strided": rocm_aiter_ops.mla_rope_cos_sin(inp["cos_sin64"], dtype)[:, ::2],
    }[bad]
    with pytest.raises(ValueError, match="cos_sin must be mla_rope_cos_sin"):
        rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
            inp["ql_nope"], inp["q_pe"], inp["kv_c"], inp["k_pe"],
            torch.zeros(2, 16, lora + rot, dtype=dtype),
            torch.empty(t, heads, lora + rot, dtype=dtype), torch.tensor([1, 2]),
            torch.tensor([3, 4]), cos_sin, True, torch.ones(1), torch.ones(1))
    assert not op.calls


def test_the_fake_misreads_a_strided_cos_view_like_the_kernel():
    """The defect the old wrapper had: cat(cos, sin)[:, :R/2] views.  The HIP
    kernel reads pos * R/2 with no stride; so does the fake."""
    fake = fake_aiter.install("gfx950")
    try:
        t, heads, lora, rot, dtype = 2, 2, 32, 16, torch.float16
        inp = _decode_inputs(t, heads, lora, rot, dtype, 16)
        cos_sin = inp["cos_sin64"].to(dtype)
        q_out = torch.empty(t, heads, lora + rot, dtype=dtype)
        from aiter.ops.cache import fused_qk_rope_concat_and_cache_mla as real_export

        real_export(inp["ql_nope"].contiguous(), inp["q_pe"], inp["kv_c"],
                    inp["k_pe"].squeeze(1), torch.zeros(2, 16, lora + rot, dtype=dtype), q_out,
                    torch.tensor([0, 1]), torch.ones(1), torch.ones(1), torch.tensor([0, 3]),
                    cos_sin[:, : rot // 2], cos_sin[:, rot // 2:], True, True)
        q_ref, _ = _reference(inp, torch.tensor([0, 3]), None, True, rot)
        torch.testing.assert_close(q_out[0].double(), q_ref[0], rtol=2e-3, atol=2e-3)  # pos 0
        assert not torch.allclose(q_out[1].double(), q_ref[1], rtol=2e-3, atol=2e-3)
    finally:
        fake.uninstall()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_host_bench_times_the_same_work(strict_aiter, kv_cache_dtype):
    """benchmarks/bench_aiter_mla_host.py times a plain call of AITER's op,
    the call as Kimi-K3 makes it, 0302's wrapper and the fused layer's op:
    through the strict fake, each writes the same q_out and cache rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import bench_aiter_mla_host as bench

    op = strict_aiter()
    written = []
    for name in ("plain", "kimi_k3", "wrapper", "op"):
        case = bench.make_case(4, kv_cache_dtype, torch.device("cpu"))
        q_out = case["calls"][name]()
        written.append([t.view(torch.uint8).clone()
                        for t in (q_out, case["inputs"]["kv_cache"])])
    assert len(op.calls) == 4 and written[0][1].any()
    for q_out, cache in written[1:]:
        assert torch.equal(q_out, written[0][0]) and torch.equal(cache, written[0][1])


# --- the fake refuses what the real launcher / kernel refuses -----------------

def _direct_args(**over):
    t, heads, lora, rot = 2, 2, 32, 16
    a = dict(q_nope=torch.randn(t, heads, lora), q_pe=torch.randn(t, heads, rot),
             kv_c=torch.randn(t, lora), k_pe=torch.randn(t, rot),
             kv_cache=torch.zeros(2, 16, lora + rot), q_out=torch.empty(t, heads, lora + rot),
             slot_mapping=torch.tensor([0, 1]), k_scale=torch.ones(1), q_scale=torch.ones(1),
             positions=torch.tensor([0, 1]), cos_cache=torch.randn(8, rot // 2),
             sin_cache=torch.randn(8, rot // 2), is_neox=True, is_nope_first=True)
    a.update(over)
    return a


@pytest.mark.parametrize("over, match", [
    (dict(kv_cache=torch.zeros(2, 16, 48, dtype=torch.uint8)), "not supported"),
    (dict(q_out=torch.empty(2, 2, 40)), "AITER_CHECK"),
    (dict(kv_c=torch.randn(2, 24)), "kv_lora_rank and qk_lora_rank"),
    (dict(kv_c=torch.randn(2, 1, 1, 32)), "Unsupported tensor dimensions"),
    (dict(q_out=torch.empty(2, 2, 48, dtype=FNUZ)), "auto and q_out data type is fp8"),
])
def test_fake_rejects_what_aiter_rejects(over, match):
    with pytest.raises(AiterCheckError, match=match):
        FakeMlaRopeOp("gfx942")(**_direct_args(**over))


def test_fake_refuses_a_non_native_fp8_tensor():
    """AITER converts only the target's fp8 (aiter/utility/dtypes.py l.51-57)."""
    with pytest.raises(AssertionError, match="Unsupported dtype"):
        FakeMlaRopeOp("gfx942")(**_direct_args(kv_cache=torch.zeros(2, 16, 48, dtype=FN)))

def test_fake_compute_all_q_rope_only_where_aiter_honours_it():
    op = FakeMlaRopeOp("gfx942")
    with pytest.raises(AiterCheckError, match="compute_all_q_rope is only supported"):
        op(**_direct_args(compute_all_q_rope=True))  # general kernel: AITER_CHECK
    big = _direct_args(q_nope=torch.randn(2, 4, 512), q_pe=torch.randn(2, 4, 64),
                       kv_c=torch.randn(2, 512), k_pe=torch.randn(2, 64),
                       kv_cache=torch.zeros(2, 16, 576), q_out=torch.empty(2, 4, 576),
                       slot_mapping=torch.tensor([-1, 3]), cos_cache=torch.randn(8, 32),
                       sin_cache=torch.randn(8, 32), compute_all_q_rope=True)
    op(**big)
    assert op.calls[-1]["target"] == "opt"
    assert not big["q_out"][0].isnan().any()  # slot -1 still gets its q_out row


# --- the layer: DCP limits decided up front, the whole layer through AITER -----

def _facts(**over):
    base = dict(triton_requested=False, aiter_requested=True, aiter_op_problem=None,
                aiter_op_all_q_rope=True, gpu=True, rope_problem=None,
                model_dtype="bfloat16", kv_cache_dtype="auto")
    base.update(over)
    return RopeKVFacts(**base)


@pytest.mark.parametrize("over, path, words", [
    (dict(dcp_world_size=2), RopeKVPath.AITER, "decode through AITER"),
    (dict(dcp_world_size=2, kv_lora_rank=256), RopeKVPath.TRITON, "kv_lora_rank 512"),
    (dict(dcp_world_size=2, qk_rope_head_dim=32), RopeKVPath.TRITON, "qk_rope_head_dim 64"),
    (dict(dcp_world_size=2, num_heads=2), RopeKVPath.TRITON, "2 heads"),
    (dict(dcp_world_size=2, aiter_op_all_q_rope=False), RopeKVPath.TRITON,
     "no compute_all_q_rope"),
    (dict(dcp_world_size=1, num_heads=2, kv_lora_rank=256), RopeKVPath.AITER, "AITER"),
])
def test_dcp_limits_are_decided_before_the_aiter_path(over, path, words):
    decision = decide_rope_kv_path(_facts(**over))
    assert decision.path is path and words in decision.reason
    assert decision.aiter_all_q_rope is (path is RopeKVPath.AITER and over["dcp_world_size"] > 1)


def test_layer_decision_with_the_strict_fake(strict_aiter, monkeypatch, caplog):
    from vllm.platforms import current_platform

    strict_aiter()
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(rocm_aiter_ops, "is_mla_rope_kv_fusion_enabled",
                        classmethod(lambda c: True))
    monkeypatch.setattr(torch, "get_default_dtype", lambda: torch.bfloat16)
    fusion = mla_rope_kv_cache.MLARopeKVFusion.for_layer(
        h.make_layer(h.CASES_BY_NAME["decode_only"]), h.make_rope("neox"))
    assert fusion.decision.path is RopeKVPath.AITER and fusion.use_aiter


@pytest.mark.parametrize("case", [h.CASES_BY_NAME[n] for n in (
    "decode_only", "mixed_decode_first", "mixed_padded", "fp8_cache_fp8_query",
    "fp8_cache_model_query")], ids=lambda c: c.name)
def test_layer_through_the_aiter_path(strict_aiter, case):
    """Decode rows through the strict fake, prefill rows through Triton: the
    same cache, output and MQA query as upstream's unfused path."""
    op = strict_aiter()
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    unfused = h.run(h.make_layer(case), rope, inputs, via="impl", fused=False)
    layer = h.make_layer(case)
    decision = RopeKVDecision(RopeKVPath.AITER, "test", requested=True)
    layer.rope_kv_fusion = mla_rope_kv_cache.MLARopeKVFusion(decision, rope, layer)
    fused = h.run(layer, rope, inputs, via="impl", fused=True)
    assert len(op.calls) == 1 and op.calls[0]["q_out"].shape[0] == case.num_decode
    # forward_impl hands the op the step's kv_c / k_pe; AITER gets the decode rows.
    assert op.calls[0]["kv_c"].shape[0] == op.calls[0]["k_pe"].shape[0] == case.num_decode
    # Without an fp8 query the op still gets a q_scale tensor: ones, not k_scale.
    assert float(op.calls[0]["q_scale"]) == (h.Q_SCALE if case.quant_query else 1.0)
    h.assert_same_cache(fused["cache"], unfused["cache"], inputs["slot_mapping"])
    torch.testing.assert_close(fused["output"], unfused["output"], rtol=1e-5, atol=1e-6)
    for qf, qu in zip(fused["mqa_q"], unfused["mqa_q"], strict=True):
        assert qf.dtype == qu.dtype
        h.assert_within_one_ulp(qf.contiguous(), qu.contiguous(), "MQA query")


# --- ROCm tier: the real op ----------------------------------------------------

@pytest.mark.rocm
@pytest.mark.parametrize("kv_cache_dtype, neox", [("auto", False), ("fp8", False), ("auto", True)])
def test_real_aiter_op_matches_the_triton_kernel(kv_cache_dtype, neox):
    from vllm.platforms import current_platform
    from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_concat_and_cache

    pytest.importorskip("aiter", reason="needs AITER")
    _clear()
    problem, _ = rocm_aiter_ops.mla_rope_kv_op_support()
    assert problem is None, f"AITER is installed but its op is unusable: {problem}"
    dev, bf16 = "cuda", torch.bfloat16
    t, heads, lora, rot, bs, blocks = 64, 16, 512, 64, 16, 32768
    g = torch.Generator(device=dev).manual_seed(0)
    ql_nope = torch.randn(t, heads, lora, device=dev, generator=g).to(bf16)
    q_pe = torch.randn(t, heads, 192, device=dev, generator=g).to(bf16)[..., 128:]
    kv_c = torch.randn(t, lora, device=dev, generator=g).to(bf16)
    k_pe = torch.randn(t, lora + rot, device=dev, generator=g).to(bf16)[:, lora:].unsqueeze(1)
    positions = torch.randint(0, 4096, (t,), device=dev, generator=g)
    slots = torch.randperm(blocks * bs, device=dev, generator=g)[:t] + bs
    slots[::7] = -1
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2, device=dev).float() / rot)
    freqs = torch.arange(4096, device=dev).float()[:, None] * inv
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(bf16)
    fp8 = kv_cache_dtype == "fp8"
    cache_dtype = torch.uint8 if fp8 else bf16
    k_scale = torch.tensor([0.5], device=dev)
    q_scale = torch.tensor([0.25], device=dev)
    out_dtype = current_platform.fp8_dtype() if fp8 else bf16
    tables = rocm_aiter_ops.mla_rope_cos_sin(cos_sin, bf16)
    results = []
    for use_aiter in (True, False):
        cache = torch.zeros(blocks + 1, bs, lora + rot, dtype=cache_dtype, device=dev)
        q_out = torch.empty(t, heads, lora + rot, dtype=out_dtype, device=dev)
        if use_aiter:
            rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
                ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, positions, tables, neox,
                k_scale, q_scale if fp8 else torch.ones_like(q_scale))
        else:
            mla_rope_concat_and_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, positions,
                                      cos_sin, neox, kv_cache_dtype=kv_cache_dtype,
                                      k_scale=k_scale, q_out=q_out,
                                      q_scale=q_scale if fp8 else None)
        torch.cuda.synchronize()
        results.append((cache, q_out))
    (cache_a, q_a), (cache_t, q_t) = results
    keep = slots >= 0  # AITER leaves the q_out rows of slot -1 tokens unwritten
    assert torch.equal(q_a[keep, :, :lora].view(torch.uint8), q_t[keep, :, :lora].view(torch.uint8))
    ca, ct = (c.view(-1, lora + rot) for c in (cache_a, cache_t))
    assert torch.equal(ca[:, :lora].view(torch.uint8), ct[:, :lora].view(torch.uint8))
    h.assert_within_one_ulp(ca[:, lora:].contiguous(), ct[:, lora:].contiguous(), "cache k_pe")
    h.assert_within_one_ulp(q_a[keep, :, lora:].contiguous(), q_t[keep, :, lora:].contiguous(),
                            "q_out q_pe")
