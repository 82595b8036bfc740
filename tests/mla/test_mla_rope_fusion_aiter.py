"""The AITER decode path: rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla.

CPU tier: a fake ``aiter`` package in ``sys.modules`` whose op records its
arguments (the mapping from vLLM's layouts: cos/sin halves as views of vLLM's
cache, the fp8 cache as fp8 not uint8, dense ``q_nope``, 2-D ``k_pe``) and
computes AITER's documented semantics in torch, so the whole layer can run
the AITER path; version skew (a changed signature, a missing op) must make
the decision fall back, never crash.  ROCm tier: the real op against the
Triton kernel.
"""

import inspect
import sys
import types

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import _mla_rope_harness as h
import vllm._aiter_ops as aiter_ops
from vllm._aiter_ops import rocm_aiter_ops
from vllm.model_executor.layers.attention import mla_rope_kv_cache
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVDecision,
    RopeKVPath,
)


def _rotate(x, cos, sin, is_neox):
    """AITER's RoPE on [..., R] with cos / sin [..., R/2], in fp32."""
    x = x.float()
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)


def _quant(x, scale, dtype):
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        finfo = torch.finfo(dtype)
        return (x / scale.float()).clamp(finfo.min, finfo.max).to(dtype)
    return x.to(dtype)


class FakeAiterOp:
    """Stands in for aiter.ops.cache.fused_qk_rope_concat_and_cache_mla."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale,
                 positions, cos_cache, sin_cache, is_neox, is_nope_first,
                 compute_all_q_rope=False):
        self.calls.append(dict(inspect.currentframe().f_locals))
        cos, sin = cos_cache[positions].float(), sin_cache[positions].float()
        q = torch.cat((q_nope.float(), _rotate(q_pe, cos[:, None], sin[:, None], is_neox)), -1)
        rows = torch.cat((kv_c.float(), _rotate(k_pe, cos, sin, is_neox)), -1)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0 or compute_all_q_rope:
                q_out[t] = _quant(q[t], q_scale, q_out.dtype)
            if slot >= 0:
                flat[slot] = _quant(rows[t], k_scale, flat.dtype)


@pytest.fixture
def fake_aiter(monkeypatch):
    """Install a fake aiter package; returns a setter for its op."""
    cache_mod = types.ModuleType("aiter.ops.cache")
    ops_mod = types.ModuleType("aiter.ops")
    aiter_mod = types.ModuleType("aiter")
    ops_mod.cache, aiter_mod.ops = cache_mod, ops_mod
    for name, mod in (("aiter", aiter_mod), ("aiter.ops", ops_mod), ("aiter.ops.cache", cache_mod)):
        monkeypatch.setitem(sys.modules, name, mod)

    def set_op(op):
        if op is None:
            monkeypatch.delattr(cache_mod, "fused_qk_rope_concat_and_cache_mla", raising=False)
        else:
            monkeypatch.setattr(cache_mod, "fused_qk_rope_concat_and_cache_mla", op, raising=False)
        aiter_ops._aiter_mla_rope_kv_op.cache_clear()
        return op

    yield set_op
    aiter_ops._aiter_mla_rope_kv_op.cache_clear()


def test_argument_mapping(fake_aiter):
    op = fake_aiter(FakeAiterOp())
    g = torch.Generator().manual_seed(0)
    t, max_pos = 3, h.MAX_POS
    ql_nope = torch.randn(h.N, t, h.L, generator=g).transpose(0, 1)  # bmm output view
    q = torch.randn(t, h.N, h.P + h.R, generator=g)
    kv_lora = torch.randn(t, h.L + h.R, generator=g)
    kv_c = torch.randn(t, h.L, generator=g)
    cache_u8 = torch.zeros(h.NUM_BLOCKS, h.BLOCK_SIZE, h.L + h.R, dtype=torch.uint8)
    q_out = torch.empty(t, h.N, h.L + h.R, dtype=h.fp8_dtype())
    cos_sin = h.make_rope("deepseek_yarn").cos_sin_cache
    slots = torch.tensor([[9], [4], [-1]])
    positions = torch.tensor([1, max_pos - 1, 0])
    k_scale, q_scale = torch.tensor(h.K_SCALE), torch.tensor(h.Q_SCALE)
    rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
        ql_nope, q[..., h.P:], kv_c, kv_lora[:, h.L:].unsqueeze(1), cache_u8, q_out, slots,
        positions, cos_sin, False, k_scale, q_scale)

    (a,) = op.calls
    assert a["q_nope"].is_contiguous() and torch.equal(a["q_nope"], ql_nope)
    assert a["q_pe"].data_ptr() == q[..., h.P:].data_ptr()  # unit last stride: passed as is
    assert a["k_pe"].shape == (t, h.R) and a["k_pe"].data_ptr() == kv_lora[:, h.L:].data_ptr()
    assert a["kv_cache"].dtype == h.fp8_dtype() and a["kv_cache"].data_ptr() == cache_u8.data_ptr()
    assert a["kv_cache"].shape == cache_u8.shape
    half = h.R // 2
    for name, offset in (("cos_cache", 0), ("sin_cache", half)):
        c = a[name]
        assert c.shape == (cos_sin.shape[0], half) and c.stride(-1) == 1
        assert c.data_ptr() == cos_sin.data_ptr() + offset * cos_sin.element_size()  # a view
        assert torch.equal(c, cos_sin[:, offset:offset + half])
    assert a["slot_mapping"].shape == (t,) and torch.equal(a["slot_mapping"], slots.flatten())
    assert a["positions"] is positions and a["k_scale"] is k_scale and a["q_scale"] is q_scale
    assert a["q_out"] is q_out and a["is_neox"] is False and a["is_nope_first"] is True
    assert a["compute_all_q_rope"] is False  # not passed unless asked for


def test_non_unit_last_stride_is_made_contiguous(fake_aiter):
    op = fake_aiter(FakeAiterOp())
    t = 2
    q_pe = torch.randn(t, h.N, 2 * h.R)[..., ::2]  # last stride 2
    rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
        torch.randn(t, h.N, h.L), q_pe, torch.randn(t, h.L), torch.randn(t, h.R),
        torch.zeros(h.NUM_BLOCKS, h.BLOCK_SIZE, h.L + h.R), torch.empty(t, h.N, h.L + h.R),
        torch.tensor([0, 1]), torch.tensor([0, 1]), h.make_rope("neox").cos_sin_cache, True,
        torch.tensor(1.0), torch.tensor(1.0))
    assert op.calls[0]["q_pe"].stride(-1) == 1 and torch.equal(op.calls[0]["q_pe"], q_pe)


def _op_with(params: str):
    scope: dict = {}
    exec(f"def fused_qk_rope_concat_and_cache_mla({params}):\n    pass\n", scope)  # noqa: S102
    return scope["fused_qk_rope_concat_and_cache_mla"]


ALL = ("q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale, positions, "
       "cos_cache, sin_cache, is_neox, is_nope_first")

SKEW = [
    ("v0_1_26", ALL, None, False),
    ("with_compute_all_q_rope", ALL + ", compute_all_q_rope=False", None, True),
    ("renamed_argument", ALL.replace("cos_cache, sin_cache", "cos_sin_cache, unused"),
     "unexpected signature", False),
    ("reordered", ALL.replace("q_out, slot_mapping", "slot_mapping, q_out"),
     "unexpected signature", False),
    ("new_required_argument", ALL + ", new_arg", "unexpected signature", False),
    ("fewer_arguments", ALL.replace(", is_nope_first", ""), "unexpected signature", False),
]


@pytest.mark.parametrize("params, problem, all_q_rope", [s[1:] for s in SKEW],
                         ids=[s[0] for s in SKEW])
def test_version_skew_is_detected(fake_aiter, params, problem, all_q_rope):
    fake_aiter(_op_with(params))
    got_problem, got_all_q_rope = rocm_aiter_ops.mla_rope_kv_op_support()
    assert got_all_q_rope is all_q_rope
    assert got_problem is None if problem is None else problem in got_problem


def test_missing_op_is_detected(fake_aiter):
    fake_aiter(None)
    problem, _ = rocm_aiter_ops.mla_rope_kv_op_support()
    assert problem.startswith("import failed: ImportError")
    with pytest.raises(RuntimeError, match="import failed"):
        rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(*([None] * 12))


def test_broken_aiter_import_is_detected(monkeypatch):
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("HIP runtime mismatch")

    monkeypatch.setitem(sys.modules, "aiter", Broken("aiter"))
    monkeypatch.delitem(sys.modules, "aiter.ops", raising=False)
    monkeypatch.delitem(sys.modules, "aiter.ops.cache", raising=False)
    aiter_ops._aiter_mla_rope_kv_op.cache_clear()
    try:
        problem, _ = rocm_aiter_ops.mla_rope_kv_op_support()
    finally:
        aiter_ops._aiter_mla_rope_kv_op.cache_clear()
    assert problem.startswith("import failed:")


@pytest.mark.parametrize("params, path, words", [
    (ALL, RopeKVPath.AITER, "decode through AITER"),
    (ALL.replace("q_out, slot_mapping", "slot_mapping, q_out"), RopeKVPath.TRITON,
     "unexpected signature"),
], ids=["usable", "skewed"])
def test_layer_decision_with_aiter_requested(fake_aiter, monkeypatch, params, path, words):
    """AITER on, the op usable or skewed: AITER decode, or Triton -- never a crash."""
    from vllm.platforms import current_platform

    fake_aiter(_op_with(params))
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(rocm_aiter_ops, "is_mla_rope_kv_fusion_enabled", classmethod(lambda c: True))
    monkeypatch.setattr(torch, "get_default_dtype", lambda: torch.bfloat16)
    layer = h.make_layer(h.CASES_BY_NAME["decode_only"])
    fusion = mla_rope_kv_cache.MLARopeKVFusion.for_layer(layer, h.make_rope("neox"))
    assert fusion is not None and fusion.decision.path is path and words in fusion.decision.reason
    assert fusion.use_aiter is (path is RopeKVPath.AITER)


@pytest.mark.parametrize("case", [h.CASES_BY_NAME[n] for n in (
    "decode_only", "mixed_decode_first", "fp8_cache_fp8_query", "fp8_cache_model_query")],
    ids=lambda c: c.name)
def test_layer_through_the_aiter_path(fake_aiter, case):
    """Decode rows through the (fake) AITER op, prefill rows through Triton."""
    op = fake_aiter(FakeAiterOp())
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    unfused = h.run(h.make_layer(case), rope, inputs, via="impl", fused=False)
    layer = h.make_layer(case)
    decision = RopeKVDecision(RopeKVPath.AITER, "test", requested=True)
    layer.rope_kv_fusion = mla_rope_kv_cache.MLARopeKVFusion(decision, rope, layer)
    fused = h.run(layer, rope, inputs, via="impl", fused=True)
    assert len(op.calls) == 1 and op.calls[0]["q_out"].shape[0] == case.num_decode
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

    problem, _ = rocm_aiter_ops.mla_rope_kv_op_support()
    if problem is not None:
        pytest.skip(f"installed AITER: {problem}")
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
    results = []
    for use_aiter in (True, False):
        cache = torch.zeros(blocks + 1, bs, lora + rot, dtype=cache_dtype, device=dev)
        q_out = torch.empty(t, heads, lora + rot, dtype=out_dtype, device=dev)
        if use_aiter:
            rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
                ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, positions, cos_sin, neox,
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


def test_aiter_gets_the_cos_sin_cache_in_the_model_dtype_once():
    """AITER's op wants cos/sin in the query dtype; the Triton kernel reads any."""
    rope = h.make_rope("neox")  # fp32 cache
    layer = h.make_layer(h.CASES_BY_NAME["decode_only"])
    aiter = mla_rope_kv_cache.MLARopeKVFusion(
        RopeKVDecision(RopeKVPath.AITER, "test", requested=True), rope, layer)
    triton = mla_rope_kv_cache.MLARopeKVFusion(
        RopeKVDecision(RopeKVPath.TRITON, "test", requested=True), rope, layer)
    dev = rope.cos_sin_cache.device
    assert triton.cos_sin_cache(dev, torch.bfloat16) is rope.cos_sin_cache
    assert aiter.cos_sin_cache(dev, torch.float32) is rope.cos_sin_cache
    first = aiter.cos_sin_cache(dev, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first, rope.cos_sin_cache.bfloat16())
    assert aiter.cos_sin_cache(dev, torch.bfloat16) is first  # converted once
