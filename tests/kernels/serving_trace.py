# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A randomized serving trace of the series' kernels, called as the backends do.

``Engine`` holds one engine's fixed geometry (KV cache, block table, step
buffers) for a cache dtype; ``Engine.step(rng)`` draws one step (decode-only,
mixed, short extends on the paged route, long extends on the gather route,
MLA decode + prefill) and calls the wrappers with the slices and per-step
sizes the AITER FA / MLA backends pass: request metadata sliced at the step's
decode count, workspaces and LSE of the step's token count, a split count of
1-16.  Used by test_serving_compiles.py on both tiers.
"""

from __future__ import annotations

import random

import torch
from vllm.v1.attention.ops import triton_fetch_kv as fk
from vllm.v1.attention.ops import triton_mla_rope_cache as mla
from vllm.v1.attention.ops import triton_paged_context_attention as pc
from vllm.v1.attention.ops.triton_fetch_kv_warmup import FetchKVGeometry
from vllm.v1.attention.ops.triton_mla_rope_cache_warmup import MLAGeometry

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
NUM_HEADS = 4
HEAD_SIZE = 64
MAX_REQS = 300  # reaches every REQ_STEP bucket up to 1024
MAX_BLOCKS = 64  # per request (context <= 1024 tokens)
NUM_BLOCKS = 96
PAGED_MAX_TOKENS = 512  # the backend's default route threshold
MLA_HEADS, MLA_L, MLA_R, MLA_P = 4, 32, 16, 16
MLA_LAYERS = 2  # a step's second layer of a geometry reuses the first's launch
MAX_TOKENS = 2048


class Engine:
    def __init__(self, device, cache_dtype=None, model_dtype=torch.bfloat16):
        # (No kernel runs on the CPU tier: the recorder stands in for them, so
        # bf16 is fine there too.)
        self.device = device
        self.model_dtype = model_dtype
        self.cache_dtype = cache_dtype = cache_dtype or model_dtype
        fp8 = cache_dtype.itemsize == 1
        d = HEAD_SIZE
        # vLLM 0.34.0's packed (blocks, Hkv, bs, 2D) cache viewed as K / V.
        packed = torch.zeros((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * d),
                             dtype=cache_dtype, device=device)  # fmt: skip
        self.key_cache = packed[..., :d].permute(0, 2, 1, 3)
        self.value_cache = packed[..., d:].permute(0, 2, 1, 3)
        self.caches = [packed]
        self.block_table = torch.randint(
            1, NUM_BLOCKS, (MAX_REQS, MAX_BLOCKS), dtype=torch.int32, device=device
        )
        self.k_scale = torch.ones(1, dtype=torch.float32, device=device)
        out_dtype = model_dtype
        self.workspace = torch.empty((MAX_TOKENS, 2, NUM_KV_HEADS, d), dtype=out_dtype,
                                     device=device)  # fmt: skip
        self.fetch_geometry = FetchKVGeometry(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, num_heads=NUM_HEADS,
            head_size=d, model_dtype=model_dtype, cache_dtype=cache_dtype,
            out_dtype=out_dtype, cache_strides=tuple(self.key_cache.stride()),
            max_num_reqs=MAX_REQS, paged_context=True,
        )  # fmt: skip
        # MLA: a [blocks, bs, L + R] cache, q [T, H, P + R], kv_c | k_pe rows of
        # a [T, L + R] projection output, cos/sin [max_pos, R].
        self.mla_cache = torch.zeros((NUM_BLOCKS, BLOCK_SIZE, MLA_L + MLA_R),
                                     dtype=cache_dtype, device=device)  # fmt: skip
        self.caches.append(self.mla_cache)
        self.cos_sin = torch.rand((4096, MLA_R), dtype=model_dtype, device=device)
        self.q = torch.rand((MAX_TOKENS, MLA_HEADS, MLA_P + MLA_R), dtype=model_dtype,
                            device=device)  # fmt: skip
        self.kv = torch.rand((MAX_TOKENS, MLA_L + MLA_R), dtype=model_dtype,
                             device=device)  # fmt: skip
        self.ql_nope = torch.rand((MAX_TOKENS, MLA_HEADS, MLA_L), dtype=model_dtype,
                                  device=device)  # fmt: skip
        # The decode query's buffer (the layer's q_out workspace, model dtype).
        self.q_out = torch.empty((MAX_TOKENS, MLA_HEADS, MLA_L + MLA_R), dtype=model_dtype,
                                 device=device)  # fmt: skip
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        self.slots = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        self.kv_cache_dtype = "fp8" if fp8 else "auto"
        self.mla_geometry = MLAGeometry(
            num_heads=MLA_HEADS, lora_rank=MLA_L, rope_dim=MLA_R,
            model_dtype=model_dtype, cache_dtype=cache_dtype,
            kv_cache_dtype=self.kv_cache_dtype, block_size=BLOCK_SIZE,
            cache_strides=tuple(self.mla_cache.stride()[:2]),
            q_strides=tuple(self.q.stride()[:2]), kv_stride=self.kv.stride(0),
            ql_nope_strides=tuple(self.ql_nope.stride()[:2]),
            cos_sin_stride=self.cos_sin.stride(0), cos_sin_dtype=model_dtype,
            is_neox=True, max_num_tokens=MAX_TOKENS,
        )  # fmt: skip

    def _index(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def step(self, rng: random.Random) -> str:
        kind = rng.choice(["decode", "mixed", "short_extend", "long_extend"])
        num_decodes = rng.randint(0, 250) if kind != "decode" else rng.randint(1, 290)
        num_extends = 0 if kind == "decode" else rng.randint(1, 40)
        short = kind != "long_extend" and rng.random() < 0.8
        cap = PAGED_MAX_TOKENS if short else MAX_TOKENS - 1
        most = MAX_BLOCKS * BLOCK_SIZE // 2  # new tokens of one extend
        qlens = [rng.randint(1, min(most, max(1, cap // max(1, num_extends))))
                 for _ in range(num_extends)]  # fmt: skip
        if not short and num_extends and sum(qlens) <= PAGED_MAX_TOKENS:
            qlens[-1] = PAGED_MAX_TOKENS + 1 - sum(qlens[:-1])  # the gather route
        ctx = [rng.randint(1, MAX_BLOCKS * BLOCK_SIZE - q) for q in qlens]
        if num_extends:
            if sum(qlens) <= PAGED_MAX_TOKENS:
                self._paged(num_decodes, qlens, ctx, rng)
            else:
                self._gather(num_decodes, qlens, ctx, rng)
        self._mla(num_decodes, qlens, rng)
        return kind

    def _paged(self, num_decodes, qlens, ctx, rng):
        """The paged route (patch 0250): one workspace a step, every layer."""
        n, t = len(qlens), sum(qlens)
        cu = self._index([0] + [sum(qlens[: i + 1]) for i in range(n)])
        seq_lens = self._index([c + q for c, q in zip(ctx, qlens)])
        # The backend's slices: extends follow the decodes.
        block_table = self.block_table[num_decodes : num_decodes + n]
        ws = pc.paged_context_workspace(
            block_table, cu, seq_lens, num_tokens=t, num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=self.model_dtype,
            max_context_len=max(ctx), num_splits=rng.randint(1, 16),
        )  # fmt: skip
        q = torch.zeros((t, NUM_HEADS, HEAD_SIZE), dtype=self.model_dtype, device=self.device)
        k = torch.zeros((t, NUM_KV_HEADS, HEAD_SIZE), dtype=self.model_dtype,
                        device=self.device)  # fmt: skip
        out = torch.empty_like(q)
        pc.paged_context_attention(
            q, self.key_cache, self.value_cache, block_table, cu, seq_lens, 0.125,
            key=k, value=k, k_scale=self.k_scale, v_scale=self.k_scale, out=out,
            max_context_len=max(ctx), workspace=ws,
        )  # fmt: skip

    def _gather(self, num_decodes, qlens, ctx, rng):
        """The gather route (patch 0200): per chunk, a plan and fetch_kv."""
        n = len(qlens)
        # The backend's chunk: a fixed token budget shared by the extends.
        chunk = rng.choice([MAX_TOKENS, MAX_TOKENS // 2]) // n
        num_chunks = -(-max(ctx) // chunk)
        block_table = self.block_table[num_decodes : num_decodes + n]
        use_plan = rng.random() < 0.8
        for i in range(num_chunks):
            lens = [max(0, min(chunk, c - i * chunk)) for c in ctx]
            total = sum(lens)
            cu = self._index([0] + [sum(lens[: j + 1]) for j in range(n)])
            starts = self._index([i * chunk] * n)
            out = self.workspace[:total]
            kw = dict(k_scale=self.k_scale, v_scale=self.k_scale, max_num_tokens=total)
            if use_plan:
                kw["plan"] = fk.fetch_kv_plan(
                    block_table, cu, starts, num_tokens=total, block_size=BLOCK_SIZE,
                    head_size=HEAD_SIZE, cache_dtype=self.cache_dtype,
                    out_dtype=out.dtype,
                )  # fmt: skip
            fk.fetch_kv(self.key_cache, self.value_cache, out[:, 0], out[:, 1],
                        block_table, cu, starts, **kw)  # fmt: skip

    def _mla(self, num_decodes, qlens, rng):
        """MLA (patches 0302/0303): the step's rows built once, as the metadata
        builder's ``build_mla_rope_step_rows`` builds them (decode rows
        ``[0, nd)``, prefill rows ``[nd, t)``, an empty ``launches`` per form;
        mirrored here: it lives in the layer module, which needs vLLM, and the
        GPU tier runs without it), then each layer's decode and prefill form
        with the step's launches, as the fused layers' custom ops call them."""
        t = num_decodes + sum(qlens)
        t = min(t, MAX_TOKENS)
        nd = min(num_decodes, t)
        decode = (self.slots[:nd], self.positions[:nd], {})
        prefill = (self.slots[nd:t], self.positions[nd:t], {})
        common = dict(kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scale)
        for _ in range(MLA_LAYERS):
            if nd:
                slots, positions, launches = decode
                mla.mla_rope_concat_and_cache(
                    self.ql_nope[:nd], self.q[:nd, :, MLA_P:], self.kv[:nd, :MLA_L],
                    self.kv[:nd, MLA_L:], self.mla_cache, slots, positions, self.cos_sin,
                    True, q_out=self.q_out[:nd], launches=launches, **common,
                )  # fmt: skip
            if t > nd:
                slots, positions, launches = prefill
                mla.mla_rope_and_cache(
                    self.q[nd:t, :, MLA_P:], self.kv[nd:t, :MLA_L], self.kv[nd:t, MLA_L:],
                    self.mla_cache, slots, positions, self.cos_sin, True,
                    launches=launches, **common,
                )  # fmt: skip
