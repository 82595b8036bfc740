"""MultiHeadLatentAttentionWrapper (mla.py): RoPE moves into a fusing layer.

The wrapper is built by its own ``__init__`` with small projections and the
harness's ``MLAAttention`` in place of a real one; its ``forward`` must skip
RoPE and the separate cache update when the attention layer fuses them, and
give the same result as upstream's order otherwise.
"""

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import _mla_rope_harness as h
from vllm.model_executor.layers import mla
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVDecision,
    RopeKVPath,
)
from vllm.model_executor.layers.attention.mla_rope_kv_cache import (
    MLARopeKVFusion,
)

HIDDEN = 8


class Proj(torch.nn.Module):
    def __init__(self, n_in, n_out, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = (torch.randn(n_in, n_out, generator=g) / 3).to(h.DEVICE)

    def forward(self, x):
        return (x @ self.w,)


class Norm(torch.nn.Module):
    def forward(self, x):
        return x * 1.5


class SpyRope(torch.nn.Module):
    """The model's rotary embedding, counting the wrapper's calls."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope
        self.calls = 0
        self.is_neox_style = rope.is_neox_style
        self.cos_sin_cache = rope.cos_sin_cache

    def forward(self, positions, q_pe, k_pe):
        self.calls += 1
        return self.rope.forward_native(positions, q_pe, k_pe)


def _modules(rope):
    return mla.MLAModules(
        kv_a_layernorm=Norm(), kv_b_proj=torch.nn.Identity(), rotary_emb=SpyRope(rope),
        o_proj=Proj(h.N * h.V, HIDDEN, 1), fused_qkv_a_proj=None,
        kv_a_proj_with_mqa=Proj(HIDDEN, h.L + h.R, 2), q_a_layernorm=None, q_b_proj=None,
        q_proj=Proj(HIDDEN, h.N * (h.P + h.R), 3), indexer=None, is_sparse=False,
        topk_indices_buffer=None,
    )


def _wrapper(monkeypatch, case, rope, fuse: bool, cls=None):
    """Build the wrapper; MLAAttention(...) gives the harness layer."""
    created = []

    def fake_mla_attention(**kwargs):
        layer = h.make_layer(case)
        if fuse and kwargs["rotary_emb"] is not None:
            decision = RopeKVDecision(RopeKVPath.TRITON, "test", requested=True)
            layer.rope_kv_fusion = MLARopeKVFusion(decision, kwargs["rotary_emb"], layer)
        created.append(kwargs)
        return layer

    monkeypatch.setattr(mla, "MLAAttention", fake_mla_attention)
    wrapper = (cls or mla.MultiHeadLatentAttentionWrapper)(
        hidden_size=HIDDEN, num_heads=h.N, scale=1.0, qk_nope_head_dim=h.P,
        qk_rope_head_dim=h.R, v_head_dim=h.V, q_lora_rank=None, kv_lora_rank=h.L,
        mla_modules=_modules(rope),
    )
    return wrapper, created[0]


def _forward(wrapper, inputs, hidden, llama_4_scaling=None):
    layer = wrapper.mla_attn
    layer.kv_cache = inputs["kv_cache"].clone()
    h.CACHE_WRITES[0] = 0
    with h.forward_context(layer, inputs):
        out = wrapper(inputs["positions"], hidden, llama_4_scaling)
    return out[: inputs["metadata"].num_actual_tokens], layer.kv_cache, h.CACHE_WRITES[0]


@pytest.mark.parametrize("case_name, scaled, via", [
    ("mixed_decode_first", False, "forward"),
    ("mixed_padded", False, "forward"),
    ("mixed_decode_first", True, "forward"),  # llama_4_scaling: before the fused RoPE
    ("mixed_decode_first", False, "op"),  # positions= through the attention custom op
])
def test_wrapper_hands_rope_to_a_fusing_layer(monkeypatch, case_name, scaled, via):
    case = h.CASES_BY_NAME[case_name]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    total = inputs["q"].shape[0]
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(total, HIDDEN, generator=g).to(h.DEVICE)
    scaling = (1 + torch.rand(total, 1, 1, generator=g) / 2).to(h.DEVICE) if scaled else None

    upstream, kwargs = _wrapper(monkeypatch, case, rope, fuse=False)
    assert kwargs["rotary_emb"] is upstream.rotary_emb  # handed over, unused
    want, want_cache, want_writes = _forward(upstream, inputs, hidden, scaling)
    fused, _ = _wrapper(monkeypatch, case, rope, fuse=True)
    fused.mla_attn.use_direct_call = via == "forward"
    got, got_cache, got_writes = _forward(fused, inputs, hidden, scaling)

    assert upstream.rotary_emb.calls == 1 and want_writes == 1
    # Fused: no RoPE and no cache-update op in the wrapper's graph, so upstream's
    # fuse_rope_kvcache_cat_mla pattern (RoPE -> unified_mla_kv_cache_update)
    # has nothing to match.
    assert fused.rotary_emb.calls == 0 and got_writes == 0
    if not scaled:
        h.assert_same_cache(got_cache, want_cache, inputs["slot_mapping"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        # rope(s * x) vs s * rope(x): equal up to the rounding of the product.
        written = inputs["slot_mapping"][inputs["slot_mapping"] >= 0]
        g_rows = got_cache.view(-1, h.L + h.R)[written]
        w_rows = want_cache.view(-1, h.L + h.R)[written]
        assert torch.equal(g_rows[:, : h.L], w_rows[:, : h.L])
        torch.testing.assert_close(g_rows, w_rows, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class OwnForward(mla.MultiHeadLatentAttentionWrapper):
    """A subclass with its own forward() (as Kimi-K3's AMD wrapper): it rotates
    q_pe / k_pe itself and calls the attention without positions."""

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)
        k_pe = k_pe.unsqueeze(1)
        q = self.q_proj(hidden_states)[0].view(-1, self.num_heads, self.qk_head_dim)
        nope = self.qk_nope_head_dim
        q[..., nope:], k_pe = self.rotary_emb(positions, q[..., nope:], k_pe)
        attn_out = self.mla_attn(
            q, kv_c_normed, k_pe,
            output_shape=(hidden_states.shape[0], self.num_heads * self.v_head_dim),
        )
        return self.o_proj(attn_out)[0]


@pytest.mark.parametrize("via", ["forward", "op"])
def test_subclass_calling_without_positions_gets_upstreams_path(monkeypatch, via):
    """The wrapper hands rotary_emb to every MLAAttention, so a subclass's layer
    may fuse; called without positions (direct or through the attention custom
    op) it must not rotate again and must write its cache unfused: the same
    output and cache rows as upstream's wrapper, one RoPE, one cache write."""
    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(inputs["q"].shape[0], HIDDEN, generator=g).to(h.DEVICE)

    upstream, _ = _wrapper(monkeypatch, case, rope, fuse=False)
    want, want_cache, want_writes = _forward(upstream, inputs, hidden)
    own, kwargs = _wrapper(monkeypatch, case, rope, fuse=True, cls=OwnForward)
    assert kwargs["rotary_emb"] is own.rotary_emb
    assert own.mla_attn.rope_kv_fusion is not None  # the layer fuses when asked to
    own.mla_attn.use_direct_call = via == "forward"
    got, got_cache, got_writes = _forward(own, inputs, hidden)

    assert own.rotary_emb.calls == upstream.rotary_emb.calls == 1
    assert got_writes == want_writes == 1
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got, want)
