# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every compile variant the AITER FA backend's fetch-kv kernels can launch.

A serving step launches ``fetch_kv`` / ``fetch_kv_plan`` (context gathers) and
``paged_context_attention`` (short extends) with per-step integers (request
and token counts, split counts, the LSE strides of the step's token count):
the kernels take them with ``do_not_specialize``, and request metadata
(slices at a per-step offset) with ``do_not_specialize_on_alignment``, so
they select no variant.  What remains is fixed by the engine's geometry
(``FetchKVGeometry``) except three choices that follow the batch:
``REQ_STEP`` (four values, ``_req_step``), whether a plan is read, and for
the paged route whether the context is split (a second kernel).

``warmup_cases(geometry)`` lists them; ``compile_case(geometry, case)``
compiles one: each case calls the public API (``fetch_kv_plan`` /
``fetch_kv``, ``paged_context_workspace`` / ``paged_context_attention``) on
tiny tensors of the engine's strides (requests with no tokens: the launches
write nothing), then compiles the cache readers again without a launch, the KV
cache standing in with its storage size (the AMD backend specialises pointers
into storage of at most 2 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.ops import triton_fetch_kv as fk
from vllm.v1.attention.ops import triton_paged_context_attention as pc

__all__ = ["FetchKVGeometry", "compile_case", "warmup_cases"]

_MAX_BUFFER_BYTES = 2**31 - 1
_KV_POOL_BYTES = 1 << 40  # "more than 2 GiB": a KV cache pool


@dataclass(frozen=True)
class FetchKVGeometry:
    """What one attention group's launches are fixed by.

    ``cache_strides``: strides of the ``[blocks, block_size, Hkv, D]`` K view
    the backend passes (V has the same); ``cache_bytes``: the byte size of the
    storage behind it (the KV cache pool), None when not known yet (both
    pointer variants of the AMD backend are then compiled).  ``out_dtype``:
    the extend workspace's dtype.  ``paged_context``: whether short extends
    take the paged route.  (The block table's row stride is a runtime integer
    of every kernel: it selects nothing.)
    """

    block_size: int
    num_kv_heads: int
    num_heads: int
    head_size: int
    model_dtype: torch.dtype
    cache_dtype: torch.dtype
    out_dtype: torch.dtype
    cache_strides: tuple[int, int, int, int]
    max_num_reqs: int
    kv_cache_layout: str = "NHD"
    paged_context: bool = False
    cache_bytes: int | None = None
    index_dtype: torch.dtype = torch.int32


def warmup_cases(g: FetchKVGeometry) -> list[tuple]:
    """``("fetch_kv", plan, num_reqs)`` and ``("fetch_kv_plan", num_reqs)`` for
    one request count of each ``REQ_STEP`` up to ``g.max_num_reqs``, and
    ``("paged", split)`` when short extends take the paged route."""
    cases: list[tuple] = []
    steps: set[int] = set()
    num_reqs = 1
    while num_reqs <= max(1, g.max_num_reqs):
        step = fk._req_step(num_reqs)
        if step not in steps:
            steps.add(step)
            cases += [
                ("fetch_kv", False, num_reqs),
                ("fetch_kv", True, num_reqs),
                ("fetch_kv_plan", num_reqs),
            ]
        num_reqs = step  # the first count of the next step
    if g.paged_context:
        cases += [("paged", False), ("paged", True)]
    return cases


def compile_case(g: FetchKVGeometry, case: tuple, device) -> None:
    """Compile one case of ``warmup_cases(g)`` for ``device``.

    ``fetch_kv_plan`` has no cache pointer: it runs once on tiny tensors
    (compiling exactly its runtime variant); the cache readers are compiled
    without a launch."""
    kind = case[0]
    num_reqs = case[-1] if kind != "paged" else 1
    num_tokens = 16
    shape = (1, g.block_size, g.num_kv_heads, g.head_size)
    key_cache, value_cache = (
        torch.empty_strided(shape, g.cache_strides, dtype=g.cache_dtype, device=device)
        for _ in range(2)
    )
    idx = dict(dtype=g.index_dtype, device=device)
    block_table = torch.zeros((num_reqs, 4), **idx)
    cu = torch.zeros(num_reqs + 1, **idx)
    starts = torch.zeros(num_reqs, **idx)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    if kind != "paged":
        plan = fk.fetch_kv_plan(
            block_table,
            cu,
            starts,
            num_tokens=num_tokens,
            block_size=g.block_size,
            head_size=g.head_size,
            cache_dtype=g.cache_dtype,
            out_dtype=g.out_dtype,
            kv_cache_layout=g.kv_cache_layout,
            build_table=kind == "fetch_kv_plan" or case[1],
        )
        if kind == "fetch_kv_plan":
            return
        out = torch.empty((num_tokens, *shape[2:]), dtype=g.out_dtype, device=device)
        fk.fetch_kv(
            key_cache,
            value_cache,
            out,
            out,
            block_table,
            cu,
            starts,
            k_scale=scale,
            v_scale=scale,
            kv_cache_layout=g.kv_cache_layout,
            plan=plan,
        )
        # The call above compiled for a cache within 2 GiB; the pool is larger.
        if g.cache_bytes is None or g.cache_bytes > _MAX_BUFFER_BYTES:
            pool = g.cache_bytes or _KV_POOL_BYTES
            (copy,) = plan.copies.values()
            dequant = g.cache_dtype != g.out_dtype
            copy.warmup(
                {"key_cache_ptr": pool, "value_cache_ptr": pool},
                key_cache_ptr=key_cache,
                value_cache_ptr=value_cache,
                key_out_ptr=out,
                value_out_ptr=out,
                k_scale_ptr=scale if dequant else None,
                v_scale_ptr=scale if dequant else None,
            )
        return
    # The backend's call: the new tokens' K/V given, the output given, the
    # step's workspace (split or not); one request with no new tokens: the
    # launches write nothing.
    query_shape = (num_tokens, g.num_heads, g.head_size)
    query = torch.empty(query_shape, dtype=g.model_dtype, device=device)
    new = torch.empty((num_tokens, *shape[2:]), dtype=g.model_dtype, device=device)
    seq_lens = torch.zeros(num_reqs, **idx)
    workspace = pc.paged_context_workspace(
        block_table,
        cu,
        seq_lens,
        num_tokens=num_tokens,
        num_heads=g.num_heads,
        num_kv_heads=g.num_kv_heads,
        head_size=g.head_size,
        dtype=g.model_dtype,
        num_splits=2 if case[1] else 1,
    )
    pc.paged_context_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        cu,
        seq_lens,
        1.0,
        key=new,
        value=new,
        k_scale=scale,
        v_scale=scale,
        out=query,
        workspace=workspace,
    )
    # The call above compiled for a cache within 2 GiB; the pool is larger.
    if g.cache_bytes is None or g.cache_bytes > _MAX_BUFFER_BYTES:
        pool = g.cache_bytes or _KV_POOL_BYTES
        (calls,) = workspace.calls.values()
        assert calls.attend is not None  # a call with requests and tokens attends
        # (With splits, out and lse are the workspace's partials: fixed.)
        outputs = {} if calls.combine else {"out_ptr": query, "lse_ptr": workspace.lse}
        calls.attend.warmup(
            {"k_cache_ptr": pool, "v_cache_ptr": pool},
            q_ptr=query,
            k_cache_ptr=key_cache,
            v_cache_ptr=value_cache,
            k_new_ptr=new,
            v_new_ptr=new,
            k_scale_ptr=scale if calls.fp8 else None,
            v_scale_ptr=scale if calls.fp8 else None,
            **outputs,
        )
