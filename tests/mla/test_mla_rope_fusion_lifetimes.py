# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the fused MLA path keeps across steps, beside CUDA graphs.

* ``MLARopeKVFusion.cos_sin_cache`` and ``aiter_cos_sin``: the moved rotary
  cache and AITER's cos/sin tables (0302's ``mla_rope_cos_sin``) are kept on
  the rotary embedding they derive from, shared by every layer sharing it,
  built once, never during a capture, and go with it.
* ``MLARopeKVFusion.q_out``: the decode query buffer, reserved by the profiling
  run from vLLM's workspace manager (persistent, at its bound), views per step.
* GPU: a captured graph that reads the derived cos/sin and the q_out buffer
  replays correctly after new entries (a new dtype, a second rotary cache) and
  a collection.
"""

import gc
import weakref

import _mla_rope_harness as h
import pytest
import torch
from vllm._aiter_ops import rocm_aiter_ops
from vllm.model_executor.layers.attention import mla_rope_kv_cache
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVDecision,
    RopeKVPath,
)


def _fusion(rope=None, case="decode_only", path=RopeKVPath.TRITON):
    rope = rope if rope is not None else h.make_rope("neox")
    layer = h.make_layer(h.CASES_BY_NAME[case])
    decision = RopeKVDecision(path, "test", requested=True)
    return mla_rope_kv_cache.MLARopeKVFusion(decision, rope, layer), rope


def _capturing(monkeypatch, module):
    monkeypatch.setattr(module.current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_aiter_cos_sin_live_on_the_rotary_embedding():
    """AITER's tables: built by the first layer that needs them, read by every
    layer sharing the rotary embedding (one tensor), rebuilt for another
    dtype, and freed with the rotary embedding (no registry elsewhere)."""
    first, rope = _fusion(path=RopeKVPath.AITER)
    second = _fusion(rope, path=RopeKVPath.AITER)[0]
    cache = first.cos_sin_cache(rope.cos_sin_cache.device)
    tables = first.aiter_cos_sin(cache, torch.bfloat16)
    assert torch.equal(tables, rocm_aiter_ops.mla_rope_cos_sin(cache, torch.bfloat16))
    assert second.aiter_cos_sin(cache, torch.bfloat16) is tables  # built once
    half = second.aiter_cos_sin(cache, torch.float16)
    assert half.dtype == torch.float16 and first.aiter_cos_sin(cache, torch.float16) is half
    other, other_rope = _fusion(path=RopeKVPath.AITER)  # another rotary embedding
    assert other.aiter_cos_sin(other_rope.cos_sin_cache, torch.float16) is not half
    freed = weakref.ref(half)
    del first, second, rope, half
    gc.collect()
    assert freed() is None


def test_aiter_cos_sin_are_never_built_during_capture(monkeypatch):
    fusion, rope = _fusion(path=RopeKVPath.AITER)
    cache = fusion.cos_sin_cache(rope.cos_sin_cache.device)
    built = fusion.aiter_cos_sin(cache, torch.bfloat16)
    _capturing(monkeypatch, mla_rope_kv_cache)
    assert fusion.aiter_cos_sin(cache, torch.bfloat16) is built  # built before: fine
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        fusion.aiter_cos_sin(cache, torch.float16)


def test_cos_sin_moves_with_the_rotary_embedding(monkeypatch):
    """On another device the rotary embedding's own cache is moved (as
    upstream's _match_cos_sin_cache_dtype does), once for every layer sharing
    it; no copy is kept anywhere else."""
    fusion, rope = _fusion()
    here = rope.cos_sin_cache.device
    assert fusion.cos_sin_cache(here) is rope.cos_sin_cache  # same device: no copy
    meta = torch.device("meta")  # another device
    moved = fusion.cos_sin_cache(meta)
    assert moved.device == meta and rope.cos_sin_cache is moved
    assert fusion.cos_sin_cache(meta) is moved
    other, _ = _fusion(rope)  # another layer of the same rotary embedding shares it
    assert other.cos_sin_cache(meta) is moved
    assert not hasattr(mla_rope_kv_cache, "_MOVED_COS_SIN")
    rope.cos_sin_cache = torch.zeros(moved.shape)
    _capturing(monkeypatch, mla_rope_kv_cache)
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        fusion.cos_sin_cache(meta)


def test_q_out_buffer_is_reserved_by_the_profiling_run():
    from vllm.v1.worker import workspace

    fusion, _ = _fusion()
    fusion.max_decode_tokens = 8  # what an engine's config sets
    device = torch.device("cpu")
    workspace.init_workspace_manager(device)
    try:
        fusion.reserve_workspace(torch.float32, device)  # the profiling run
        workspace.lock_workspace()
        (buffer,) = workspace.current_workspace_manager()._persistent_resources[0].values()
        assert buffer.shape == (8, h.N, h.L + h.R)
        for n in (1, 5, 8):
            q_out = fusion.q_out(n, torch.float32, device)
            assert q_out.shape == (n, h.N, h.L + h.R)
            assert q_out.data_ptr() == buffer.data_ptr()
        with pytest.raises(AssertionError):
            fusion.q_out(9, torch.float32, device)
    finally:
        workspace.reset_workspace_manager()


def test_q_out_buffer_grows_outside_an_engine(monkeypatch):
    fusion, _ = _fusion()
    device = torch.device("cpu")
    small = fusion.q_out(3, torch.float32, device)
    big = fusion.q_out(6, torch.float32, device)
    assert big.shape[0] == 6 and fusion.q_out(2, torch.float32, device).data_ptr() == (
        big.data_ptr())
    assert small.shape[0] == 3
    _capturing(monkeypatch, mla_rope_kv_cache)
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        fusion.q_out(7, torch.float32, device)


@pytest.mark.gpu
def test_graph_replays_after_new_cache_entries():
    """Capture the fused decode (Triton kernel) reading the moved cos/sin copy
    and the q_out buffer; add entries (a second rotary cache's copy, AITER
    cos/sin of a new dtype), collect, and replay on new inputs: the same
    q_out and cache rows as an eager call."""
    from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_concat_and_cache

    cuda = torch.device("cuda")
    rope = h.make_rope("neox").to("cpu")  # the copy path: rotary cache on the CPU
    fusion, _ = _fusion(rope)
    n, slots_total = 4, 64
    g = torch.Generator(device="cpu").manual_seed(0)

    def inputs():
        return dict(
            ql_nope=torch.randn(n, h.N, h.L, generator=g).to(cuda),
            q_pe=torch.randn(n, h.N, h.R, generator=g).to(cuda),
            kv_c=torch.randn(n, h.L, generator=g).to(cuda),
            k_pe=torch.randn(n, h.R, generator=g).to(cuda),
            slots=torch.randperm(slots_total, generator=g)[:n].to(cuda),
            positions=torch.randint(0, h.MAX_POS, (n,), generator=g).to(cuda),
        )

    def decode(x, cache, q_out, cos_sin):
        mla_rope_concat_and_cache(
            x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"], cache, x["slots"],
            x["positions"], cos_sin, True, q_out=q_out,
        )  # fmt: skip

    static = inputs()
    cache = torch.zeros(slots_total // 16, 16, h.L + h.R, device=cuda)
    cos_sin = fusion.cos_sin_cache(cuda)  # built eagerly, before the capture
    q_out = fusion.q_out(n, torch.float32, cuda)
    decode(static, cache, q_out, cos_sin)  # eager warmup (compiles)
    torch.accelerator.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(static, cache, q_out, fusion.cos_sin_cache(cuda))
    # New entries after the capture: none may free or move what it reads.
    second = h.make_rope("neox").to("cpu")
    second.cos_sin_cache = second.cos_sin_cache * 2
    _fusion(second)[0].cos_sin_cache(cuda)
    aiter_fusion, _ = _fusion(rope, path=RopeKVPath.AITER)
    aiter_fusion.aiter_cos_sin(cos_sin, torch.bfloat16)
    aiter_fusion.aiter_cos_sin(cos_sin, torch.float16)
    del second
    gc.collect()
    torch.cuda.empty_cache()
    fresh = inputs()
    for name, t in static.items():
        t.copy_(fresh[name])
    graph.replay()
    ref_cache = torch.zeros_like(cache)
    ref_q = torch.empty_like(q_out)
    decode(fresh, ref_cache, ref_q, rope.cos_sin_cache.to(cuda))
    torch.accelerator.synchronize()
    assert torch.equal(q_out, ref_q)
    assert torch.equal(cache.view(-1, h.L + h.R)[fresh["slots"]],
                       ref_cache.view(-1, h.L + h.R)[fresh["slots"]])
