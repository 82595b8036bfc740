"""Stand-ins for real AITER on the CPU tier: second copies of the fakes.

``identical()``: the fakes themselves (the conformance harness must find no
disagreement); ``disagreeing()``: the same, except that its MLA op accepts
a float64 cache (the fake refuses it, as AITER's dtype check does) and its ``flash_attn_varlen_func``
returns outputs off by 1 % -- two fakes the harness must report by name.
Factories for ``AITER_CONFORMANCE_REFERENCE=standins:<name>``.
"""

from __future__ import annotations

import itertools

import torch
from aiter_export import AiterExport
from aiter_fa import FakeAiterFA
from aiter_mla import MLA_OP, FakeMlaRopeOp, fused_qk_rope_concat_and_cache_mla
from conformance import StandIn
from fake_aiter import FakeAiter

ARCH = "gfx942"


class LaxMlaOp(FakeMlaRopeOp):
    """Takes a float64 cache for an 'auto' one: disagrees with the fake."""

    def _dtype_kind(self, dtype, what):
        if dtype is torch.float64:
            return "auto"
        return super()._dtype_kind(dtype, what)


class OffByOnePercentFA(FakeAiterFA):
    def flash_attn_varlen_func(self, *args, **kwargs):
        out = super().flash_attn_varlen_func(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * 1.01, *out[1:])
        return out * 1.01


def identical(arch: str = ARCH) -> StandIn:
    return StandIn(lambda: FakeAiter(arch), arch=arch)


def identical_gfx950() -> StandIn:
    return identical("gfx950")


def _disagreeing_export() -> AiterExport:
    export = AiterExport()
    fn = export.register_guarded("aiter.ops.cache", fused_qk_rope_concat_and_cache_mla,
                                 LaxMlaOp(ARCH))
    export.export_plain("aiter", MLA_OP, fn)
    OffByOnePercentFA(ARCH).install(export)
    return export


def disagreeing() -> StandIn:
    return StandIn(_disagreeing_export, arch=ARCH)


def mla_inputs(tokens=3, heads=2, lora=16, rope=8, blocks=4, block_size=4, seed=0):
    """Small decode-form inputs of the MLA op (fp32, 'auto' cache), as a dict."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.float32
    half = rope // 2
    pos_max = 32
    ang = torch.rand(pos_max, half, generator=g) * 6.28
    return dict(
        q_nope=torch.randn(tokens, heads, lora, generator=g),
        q_pe=torch.randn(tokens, heads, rope, generator=g),
        kv_c=torch.randn(tokens, lora, generator=g),
        k_pe=torch.randn(tokens, rope, generator=g),
        kv_cache=torch.zeros(blocks, block_size, lora + rope),
        q_out=torch.zeros(tokens, heads, lora + rope),
        slot_mapping=torch.tensor([5, -1, 9][:tokens]),
        k_scale=torch.ones(1, dtype=f32),
        q_scale=torch.ones(1, dtype=f32),
        positions=torch.tensor([3, 7, 30][:tokens]),
        cos_cache=ang.cos(),
        sin_cache=ang.sin(),
        is_neox=False,
        is_nope_first=True,
    )


def varlen_inputs(q_lens=(3, 5), k_lens=(6, 5), hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    f16 = torch.float16

    def cu(lens):
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)

    return dict(
        q=torch.randn(sum(q_lens), hq, d, generator=g).to(f16),
        k=torch.randn(sum(k_lens), hkv, d, generator=g).to(f16),
        v=torch.randn(sum(k_lens), hkv, d, generator=g).to(f16),
        cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
    )
