# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every compile variant the MLA RoPE + KV-cache kernel can launch in serving.

The kernel takes its per-step integers (token and slot counts) with
``do_not_specialize`` and the step's slot mapping / positions (slices at the
decode count) with ``do_not_specialize_on_alignment``; the rest is fixed by
the layer's geometry (``MLAGeometry``) except the form (decode / prefill) and
the prefill ``BLOCK_T``, a power of two that follows the step's token count
(``_tile_config``: a few values up to its cap).  ``warmup_cases`` lists them;
``compile_case`` compiles one by calling the public function on scratch
tensors of the layer's strides whose slots are all -1 (no cache row is
written; only the scratch q tensors are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.ops import triton_mla_rope_cache as mla

__all__ = ["MLAGeometry", "compile_case", "warmup_cases"]

_KV_POOL_BYTES = 1 << 40  # "more than 2 GiB": a KV cache pool


@dataclass(frozen=True)
class MLAGeometry:
    """What one MLA layer's launches are fixed by: head count, latent and
    rope widths, dtypes, the strides of the tensors the layer passes (q_pe's
    token / head strides, the kv_c | k_pe rows' token stride, ql_nope's, the
    cache's block / slot strides, the cos/sin cache's), whether decode
    quantises q to fp8 (``q_fp8``) and the step's token bound."""

    num_heads: int
    lora_rank: int
    rope_dim: int
    model_dtype: torch.dtype
    cache_dtype: torch.dtype
    kv_cache_dtype: str
    block_size: int
    cache_strides: tuple[int, int]
    q_strides: tuple[int, int]
    kv_stride: int
    ql_nope_strides: tuple[int, int]
    cos_sin_stride: int
    cos_sin_dtype: torch.dtype
    is_neox: bool
    max_num_tokens: int
    q_fp8: bool = False


def _block_t(g: MLAGeometry, num_tokens: int) -> int:
    tile = mla._tile_config(num_tokens, g.num_heads, g.lora_rank, g.rope_dim, False)
    return tile.block_t


def warmup_cases(g: MLAGeometry) -> list[tuple]:
    """``("decode",)`` and ``("prefill", num_tokens)`` for one token count of
    each prefill ``BLOCK_T`` up to ``g.max_num_tokens``."""
    cases: list[tuple] = [("decode",)]
    seen = set()
    t = 1
    while t <= g.max_num_tokens:
        block_t = _block_t(g, t)
        if block_t not in seen:
            seen.add(block_t)
            cases.append(("prefill", t))
        t *= 2
    return cases


def compile_case(g: MLAGeometry, case: tuple, device) -> None:
    """Compile one case of ``warmup_cases(g)`` for ``device`` by running it on
    scratch tensors (slots -1: the cache is not written)."""
    num_tokens = case[1] if case[0] == "prefill" else 1
    h, L, R = g.num_heads, g.lora_rank, g.rope_dim

    def strided(shape, strides, dtype):
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)

    q_pe = strided((num_tokens, h, R), (*g.q_strides, 1), g.model_dtype).zero_()
    kv_c = strided((num_tokens, L), (g.kv_stride, 1), g.model_dtype).zero_()
    k_pe = strided((num_tokens, R), (g.kv_stride, 1), g.model_dtype).zero_()
    kv_cache = strided((1, g.block_size, L + R), (*g.cache_strides, 1), g.cache_dtype)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    cos_sin_cache = strided((1, R), (g.cos_sin_stride, 1), g.cos_sin_dtype).zero_()
    # The layer passes k_scale for an fp8 cache, q_scale for an fp8 q_out.
    one = torch.ones(1, dtype=torch.float32, device=device)
    quantized_cache = g.kv_cache_dtype not in mla._UNQUANTIZED_CACHE_DTYPES
    k_scale = one if quantized_cache else None
    launches: dict = {}
    ql_nope = q_out = None
    if case[0] == "decode":
        ql_nope = strided((num_tokens, h, L), (*g.ql_nope_strides, 1), g.model_dtype)
        q_scale = one if g.q_fp8 else None
        # The output given, as the layers pass it: the launch is kept.
        q_out = torch.empty(
            (num_tokens, h, L + R),
            dtype=mla.decode_q_out_dtype(ql_nope, q_scale),
            device=device,
        )
        mla.mla_rope_concat_and_cache(
            ql_nope.zero_(),
            q_pe,
            kv_c,
            k_pe,
            kv_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            g.is_neox,
            kv_cache_dtype=g.kv_cache_dtype,
            k_scale=k_scale,
            q_out=q_out,
            q_scale=q_scale,
            launches=launches,
        )
    else:
        mla.mla_rope_and_cache(
            q_pe,
            kv_c,
            k_pe,
            kv_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            g.is_neox,
            kv_cache_dtype=g.kv_cache_dtype,
            k_scale=k_scale,
            launches=launches,
        )
    # The calls above compiled for a one-block cache, within 2 GiB; a KV cache
    # pool is larger (what AMD's buffer ops specialise on).
    (launch,) = launches.values()
    launch.call.warmup(
        {"kv_cache_ptr": _KV_POOL_BYTES},
        ql_nope_ptr=ql_nope,
        q_pe_ptr=q_pe,
        q_out_ptr=q_out,
        kv_c_ptr=kv_c,
        k_pe_ptr=k_pe,
        kv_cache_ptr=kv_cache.view(launch.cache_dtype),
        slot_mapping_ptr=slot_mapping,
        positions_ptr=positions,
        cos_sin_ptr=cos_sin_cache,
        k_scale_ptr=k_scale if launch.reads_k_scale else None,
        q_scale_ptr=one if launch.reads_q_scale else None,
    )
