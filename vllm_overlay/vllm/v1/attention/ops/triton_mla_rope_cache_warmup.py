# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every compile variant the MLA RoPE + KV-cache kernel can launch in serving.

The kernel takes its per-step integers (token and slot counts) with
``do_not_specialize`` and the step's slot mapping / positions (slices at the
decode count) with ``do_not_specialize_on_alignment``; the rest is fixed by
the layer's geometry (``MLAGeometry``) except the form (decode / prefill) and
the prefill ``BLOCK_T``, a power of two that follows the step's token count
(``_tile_config``: a few values up to its cap).  ``warmup_cases`` lists them;
``compile_case`` compiles one without launching it (as
``triton_fetch_kv_warmup`` does: the wrappers' cached checks build the launch on
tiny tensors of the layer's strides; the KV cache pointer carries its storage
size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.ops import triton_mla_rope_cache as mla

__all__ = ["MLAGeometry", "compile_case", "warmup_cases"]


@dataclass(frozen=True)
class MLAGeometry:
    """What one MLA layer's launches are fixed by: head count, latent and
    rope widths, dtypes, the strides of the tensors the layer passes (q_pe's
    token / head strides, the kv_c | k_pe rows' token stride, ql_nope's, the
    cache's block / slot strides, the cos/sin cache's), whether decode
    quantises q to fp8 (``q_fp8``), the step's token bound and the KV cache
    pool's byte size (None: not known yet; both pointer variants of the AMD
    backend are compiled)."""

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
    cache_bytes: int | None = None


def _block_t(g: MLAGeometry, num_tokens: int) -> int:
    return mla._tile_config(num_tokens, g.num_heads, g.lora_rank, g.rope_dim, False)[2]


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
    """Compile one case of ``warmup_cases(g)`` for ``device`` (no launch)."""
    t = case[1] if case[0] == "prefill" else 1
    h, L, R = g.num_heads, g.lora_rank, g.rope_dim

    def strided(shape, strides, dtype):
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)

    q_pe = strided((t, h, R), (*g.q_strides, 1), g.model_dtype)
    kv_c = strided((t, L), (g.kv_stride, 1), g.model_dtype)
    k_pe = strided((t, R), (g.kv_stride, 1), g.model_dtype)
    cache = strided((1, g.block_size, L + R), (*g.cache_strides, 1), g.cache_dtype)
    index = dict(dtype=torch.int64, device=device)
    slots, positions = torch.zeros(t, **index), torch.zeros(t, **index)
    cos_sin = strided((1, R), (g.cos_sin_stride, 1), g.cos_sin_dtype)
    # As the wrappers pass them: k_scale for an fp8 cache only, q_scale for an
    # fp8 q_out only; positions stands in for a scale the kernel does not read.
    one = torch.ones(1, dtype=torch.float32, device=device)
    k_scale = None if g.kv_cache_dtype in mla._UNQUANTIZED_CACHE_DTYPES else one
    q_scale = one if g.q_fp8 and case[0] == "decode" else None
    rows = mla._check_rows((slots, positions, cos_sin), g.is_neox, g.kv_cache_dtype)
    inputs = (q_pe, kv_c, k_pe, cache)
    if case[0] == "decode":
        ql_nope = strided((t, h, L), (*g.ql_nope_strides, 1), g.model_dtype)
        decode = (ql_nope, None, k_scale, q_scale)
        launch, cache_dtype, q_out_dtype = mla._mla_rope_concat_and_cache_launch(
            inputs, rows, decode
        )
        q_out = ql_nope.new_empty(
            mla.decode_q_out_shape(ql_nope, q_pe), dtype=q_out_dtype
        )
        q_tensors = (ql_nope, q_pe, q_out)
    else:
        launch, cache_dtype, _ = mla._mla_rope_and_cache_launch(inputs, rows, k_scale)
        q_tensors = (q_pe, q_pe, q_pe)
    cache = cache.view(cache_dtype)
    scales = [positions if s is None else s for s in (k_scale, q_scale)]
    tensors = (*q_tensors, kv_c, k_pe, cache, slots, positions, cos_sin, *scales)
    launch.compile_only(tensors, (5,), g.cache_bytes)
