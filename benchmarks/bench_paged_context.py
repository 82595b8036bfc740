# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Extend step with cached context: paged context attention vs gather + attention
and vs upstream's ``unified_attention``.

One extend step of a layer (32 query / 4 kv heads, D 128, bf16, block 16,
vLLM 0.34.0's packed cache) for ``R`` requests, each with ``C`` cached tokens
and ``N`` new tokens, computed both ways with the same new-token attention
and the same merge:

  * ``ours``      -- what the AITER FA backend's paged route runs: one
                     ``paged_context_attention`` call with the step's new K/V
                     (``key=``/``value=``), i.e. the context straight from the
                     cache and the new tokens causally, with no separate
                     new-token kernel and no merge;
  * ``ours_split`` -- paged context attention (context only), then the
                     new-token attention and the merge below, as the route ran
                     before the kernel took the new tokens;
  * ``baseline``  -- gather the cached context into a contiguous workspace
                     (``fetch_kv`` when the overlay has it, else a torch index
                     gather), then the *same* Triton kernel over the workspace
                     (viewed as a cache with an identity block table), then
                     merge: what the AITER FA extend path does today, with the
                     attention kernel held equal so the gather is isolated;
  * ``gather_fa2`` -- the same gather, then PyTorch's FlashAttention-2 varlen
                     kernel (non-causal, with LSE) over the workspace, then
                     merge: a vendor dense kernel behind the gather, as on ROCm
                     (AITER's CK kernel); decides where the gather path wins;
  * ``gather_only`` -- the gather alone (its share of the step);
  * ``upstream_unified`` -- vLLM 0.34.0's ``unified_attention`` (loaded at run
                     time from the pinned tree, benchmarks/upstream_kernels.py),
                     called as the ``triton_attn`` backend's forward calls it
                     for this batch: the paged cache (the step's new K/V
                     already in it, written outside the timed region as the
                     backend's cache update does), ``seq_lens`` / ``max_seqlen``
                     of context + new tokens, causal, no window or softcap,
                     unit K/V descales, and the backend's split-K threshold and
                     scratch (extends of more than 8 tokens run its 2D kernel).
                     Recorded as unavailable, with the reason, when the pinned
                     tree is not there.

New-token part (``ours_split``, ``baseline``, ``gather_fa2``): FlashAttention-2
varlen causal with LSE on the step's K/V (a float64-checked torch fallback if
the aten op is unavailable).
Merge: a small Triton kernel with ``merge_attn_states``'s semantics.

``nbytes`` = cached K/V bytes read once + query and output bytes.  Every
case is timed cold: the steps rotate over buffer sets (each its own blocks of
the one cache, queries, new K/V, workspace and outputs) holding 4x the L2
(benchmarks/timing.py), so neither route finds the context in L2;
``results_warm`` is set 0 alone.

Run: ``PYTHONPATH=vllm_overlay:tests/without_vllm:. python3 -m pytest -q benchmarks/bench_paged_context.py``.
``python3 benchmarks/bench_paged_context.py --sweep OUT.json`` times ``ours``
(the fused call) in every tile / programs-per-SM / rescale-slack variant next to
``gather_fa2`` on the routed step sizes (tuning aid; not part of the suite;
results in benchmarks/notes/paged_context.md).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import triton
import triton.language as tl
from vllm.v1.attention.ops import triton_paged_context_attention as pca
from vllm.v1.attention.ops.triton_paged_context_attention import paged_context_attention

from benchmarks.timing import device_cache_bytes, plan_rotation
from benchmarks.upstream_kernels import (
    UpstreamUnavailable,
    load_unified_attention,
    triton_attn_split_k_args,
)

try:
    from vllm.v1.attention.ops.triton_fetch_kv import fetch_kv
except ImportError:  # another topic's kernel; the torch gather stands in
    fetch_kv = None

pytestmark = pytest.mark.gpu

try:
    _UNIFIED = load_unified_attention()
    _UNIFIED_MISSING = ""
except UpstreamUnavailable as exc:
    _UNIFIED = None
    _UNIFIED_MISSING = f"upstream_unified skipped: {exc}"

# What "baseline" is in this suite (recorded with every case by kernel_bench).
BASELINE = (
    'gather with fetch_kv + the same Triton attention kernel over the workspace + merge; gather_fa2 = same gather + PyTorch FlashAttention-2 varlen (the dense-vendor-kernel stand-in); upstream_unified = vLLM 0.34.0 unified_attention on the paged cache as the triton_attn backend calls it'
)

NUM_HEADS = 32
NUM_KV_HEADS = 4
HEAD_SIZE = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
SCALE = HEAD_SIZE**-0.5
CONTEXTS = [8 * 1024, 32 * 1024, 128 * 1024]
NEW_TOKENS = [128, 256, 512, 1024, 2048, 8192]
REQUESTS = [1, 4]
MAX_CONTEXT_TOKENS = max(CONTEXTS) * max(REQUESTS) + max(NEW_TOKENS) * max(REQUESTS)


@triton.jit
def _merge_kernel(out_ptr, a_ptr, a_lse_ptr, b_ptr, b_lse_ptr, num_tokens,
                  HEAD_DIM: tl.constexpr):
    """merge_attn_states: out = softmax-weighted (a, b) by their LSEs ([H, T])."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    nh = tl.num_programs(1)
    la = tl.load(a_lse_ptr + head * num_tokens + tok)
    lb = tl.load(b_lse_ptr + head * num_tokens + tok)
    la = tl.where(la == float("inf"), float("-inf"), la)
    lb = tl.where(lb == float("inf"), float("-inf"), lb)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    tot = wa + wb
    offs = (tok * nh + head) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    a = tl.load(a_ptr + offs).to(tl.float32)
    b = tl.load(b_ptr + offs).to(tl.float32)
    tl.store(out_ptr + offs, ((a * wa + b * wb) / tot).to(out_ptr.dtype.element_ty))


def merge(out, a, a_lse, b, b_lse):
    t, h, d = out.shape
    _merge_kernel[(t, h)](out, a, a_lse, b, b_lse, t, HEAD_DIM=d, num_warps=1)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=SCALE)
    return out, lse


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale=SCALE):
    """Fallback with FA2's contract (out [T, H, D], lse [H, T]); float32 math."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        s = torch.einsum("nhd,mhd->hnm", q[qs:qe].float(),
                         k[ks:ke].float().repeat_interleave(group, 1)) * scale
        if causal:
            n, m = qe - qs, ke - ks
            keep = torch.arange(m, device=q.device)[None] <= (torch.arange(n, device=q.device)
                                                              + m - n)[:, None]
            s = s.masked_fill(~keep, -math.inf)
        lse[:, qs:qe] = torch.logsumexp(s, -1)
        out[qs:qe] = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1),
                                  v[ks:ke].float().repeat_interleave(group, 1)).to(q.dtype)
    return out, lse


def _pick_varlen():
    """FA2 (aten) if it runs GQA varlen with an [H, T] LSE matching float64, else torch."""
    if not torch.cuda.is_available():
        return _torch_varlen, "torch"
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(40, 8, HEAD_SIZE, device="cuda", dtype=DTYPE, generator=g)
        k = torch.randn(70, 2, HEAD_SIZE, device="cuda", dtype=DTYPE, generator=g)
        v = torch.randn(70, 2, HEAD_SIZE, device="cuda", dtype=DTYPE, generator=g)
        cu_q = torch.tensor([0, 15, 40], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 30, 70], dtype=torch.int32, device="cuda")
        for causal in (False, True):
            o, lse = _flash_varlen(q, k, v, cu_q, cu_k, 25, 40, causal)
            ro, rl = _torch_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, 25, 40,
                                   causal)
            if lse.shape != rl.shape or (o.double() - ro).abs().max() > 0.05 \
                    or (lse.double() - rl).abs().max() > 1e-3:
                return _torch_varlen, "torch"
        return _flash_varlen, "fa2"
    except Exception:  # noqa: BLE001 - any failure: use the fallback
        return _torch_varlen, "torch"


def make_env(max_tokens: int = MAX_CONTEXT_TOKENS, min_blocks: int = 0,
             device: str = "cuda") -> dict:
    """Cache (random, packed layout), the new-token attention kernel, and
    ``unified_attention``'s split-K arguments (the ``triton_attn`` backend's).

    ``min_blocks``: at least this many blocks (the buffer sets of the largest
    rotation, ``rotation_blocks``)."""
    varlen, varlen_name = _pick_varlen()
    num_blocks = max(max_tokens // BLOCK_SIZE + 64, min_blocks)
    cache = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, device=device,
                        dtype=DTYPE)
    key_cache, value_cache = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    split_k = (triton_attn_split_k_args(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, device)
               if _UNIFIED is not None else None)
    return dict(varlen=varlen, varlen_name=varlen_name, cache=cache, key_cache=key_cache,
                value_cache=value_cache, num_blocks=num_blocks, split_k=split_k,
                gather_name="fetch_kv" if fetch_kv is not None else "torch_index")


def step_bytes(reqs: int, context: int, new: int) -> int:
    """``nbytes`` of a step: cached K/V read once + query and output."""
    kv_bytes = reqs * context * NUM_KV_HEADS * 2 * HEAD_SIZE * DTYPE.itemsize
    qo_bytes = 2 * reqs * new * NUM_HEADS * HEAD_SIZE * DTYPE.itemsize
    return kv_bytes + qo_bytes


def rotation_blocks(cases, cache_bytes: int) -> int:
    """Cache blocks the cold rotations of ``cases`` need (every set its own blocks)."""
    return 1 + max(plan_rotation(step_bytes(r, c, n), cache_bytes).sets * r * ((c + n) // BLOCK_SIZE)
                   for r, c, n in cases)


@pytest.fixture(scope="module")
def env():
    if not torch.cuda.is_available():
        pytest.skip("kernel benchmarks need a GPU")
    cache_bytes, _ = device_cache_bytes(torch.cuda.get_device_properties(0))
    return make_env(min_blocks=rotation_blocks(CASES, cache_bytes))


def context_flops(reqs: int, context: int, new: int) -> int:
    """FLOPs of the context part of a step (QK^T and PV over every cached token)."""
    return 4 * reqs * new * NUM_HEADS * context * HEAD_SIZE


def step_inputs(num_blocks: int, reqs: int, context: int, new: int, dev,
                set_index: int = 0) -> dict:
    """One step's metadata and queries: ``reqs`` requests of ``context`` cached
    and ``new`` new tokens on randomly permuted blocks 1.. of a
    ``num_blocks`` cache (seeded by the shape), and the (block, slot) of every
    context token in order (``blk``, ``slot``) for a torch gather.  Buffer set
    ``set_index`` takes the next slice of the same permutation: sets of one
    shape never share a block."""
    gen = torch.Generator(device="cpu").manual_seed(reqs * 1000003 + context + new)
    pages = (context + new) // BLOCK_SIZE
    first, last = set_index * reqs * pages, (set_index + 1) * reqs * pages
    if last > num_blocks - 1:
        raise ValueError(f"buffer set {set_index} of r{reqs}/ctx{context}/new{new} needs "
                         f"{last + 1} cache blocks, the cache has {num_blocks}")
    ids = torch.randperm(num_blocks - 1, generator=gen)[first:last] + 1
    block_table = ids.view(reqs, pages).to(torch.int32).to(dev)
    pos = torch.arange(context, device=dev)
    return {
        "block_table": block_table,
        "q": torch.randn(reqs * new, NUM_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE),
        "cu_q": torch.arange(reqs + 1, dtype=torch.int32, device=dev) * new,
        "cu_ctx": torch.arange(reqs + 1, dtype=torch.int32, device=dev) * context,
        "seq_lens": torch.full((reqs,), context + new, dtype=torch.int32, device=dev),
        "blk": block_table[:, pos // BLOCK_SIZE].reshape(-1).long(),
        "slot": (pos % BLOCK_SIZE).repeat(reqs),
    }


def make_step(env, reqs, context, new, set_index: int = 0, check: bool = True):
    """(impls, nbytes) of one step on buffer set ``set_index`` (its own blocks,
    queries, new K/V, workspace and outputs); ``check``: first make sure the
    routes agree."""
    dev = env["cache"].device
    inputs = step_inputs(env["num_blocks"], reqs, context, new, dev, set_index)
    block_table, q, cu_q, cu_ctx, seq_lens, blk, slot = (
        inputs[k] for k in ("block_table", "q", "cu_q", "cu_ctx", "seq_lens", "blk", "slot"))
    total_new, total_ctx = reqs * new, reqs * context
    k_new = torch.randn(total_new, NUM_KV_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE)
    v_new = torch.randn_like(k_new)
    seq_starts = torch.zeros(reqs, dtype=torch.int32, device=dev)
    # The new tokens' K/V in their cache slots (as the backend's cache update
    # leaves them before attention), for upstream_unified, which reads every
    # token from the cache; the other routes take them from k_new / v_new.
    new_pos = torch.arange(context, context + new, device=dev)
    new_blk = block_table[:, new_pos // BLOCK_SIZE].reshape(-1).long()
    new_slot = (new_pos % BLOCK_SIZE).repeat(reqs)
    env["key_cache"][new_blk, new_slot] = k_new
    env["value_cache"][new_blk, new_slot] = v_new
    # Workspace for the gather path, and its view as a cache with an identity table.
    k_ws = torch.empty(total_ctx, NUM_KV_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE)
    v_ws = torch.empty_like(k_ws)
    ws_key = k_ws.view(total_ctx // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    ws_value = v_ws.view_as(ws_key)
    ws_table = torch.arange(total_ctx // BLOCK_SIZE, dtype=torch.int32,
                            device=dev).view(reqs, -1)
    cache_bnhc = env["cache"].permute(0, 2, 1, 3)  # [blocks, bs, H, 2D] view

    out = torch.empty_like(q)
    ctx_out = torch.empty_like(q)
    ctx_lse = torch.empty(NUM_HEADS, total_new, dtype=torch.float32, device=dev)
    varlen = env["varlen"]

    if fetch_kv is not None:
        def gather():
            fetch_kv(env["key_cache"], env["value_cache"], k_ws, v_ws, block_table, cu_ctx,
                     seq_starts, max_num_tokens=total_ctx)
    else:
        def gather():
            kv = cache_bnhc[blk, slot]  # [tokens, H, 2D]
            k_ws.copy_(kv[..., :HEAD_SIZE])
            v_ws.copy_(kv[..., HEAD_SIZE:])

    def new_part():
        return varlen(q, k_new, v_new, cu_q, cu_q, new, new, True)

    def ours():
        paged_context_attention(q, env["key_cache"], env["value_cache"], block_table, cu_q,
                                seq_lens, SCALE, key=k_new, value=v_new, out=out,
                                lse=ctx_lse, max_context_len=context)

    def ours_split():
        o_new, l_new = new_part()
        paged_context_attention(q, env["key_cache"], env["value_cache"], block_table, cu_q,
                                seq_lens, SCALE, out=ctx_out, lse=ctx_lse,
                                max_context_len=context)
        merge(out, ctx_out, ctx_lse, o_new, l_new)

    def baseline():
        gather()
        o_new, l_new = new_part()
        paged_context_attention(q, ws_key, ws_value, ws_table, cu_q, seq_lens, SCALE,
                                out=ctx_out, lse=ctx_lse, max_context_len=context)
        merge(out, ctx_out, ctx_lse, o_new, l_new)

    def gather_fa2():
        gather()
        o_new, l_new = new_part()
        o_ctx, l_ctx = varlen(q, k_ws, v_ws, cu_q, cu_ctx, new, context, False)
        merge(out, o_ctx, l_ctx, o_new, l_new)

    # TritonAttentionImpl.forward's call for this batch (bf16 cache: no q
    # descale, K/V descales of 1.0 expanded to [requests, kv heads]; no window,
    # softcap, ALiBi, sinks or output scale: their defaults).
    descale = torch.ones(1, dtype=torch.float32, device=dev).expand(reqs, NUM_KV_HEADS)

    def upstream_unified():
        _UNIFIED(q=q, k=env["key_cache"], v=env["value_cache"], out=out, cu_seqlens_q=cu_q,
                 max_seqlen_q=new, seqused_k=seq_lens, max_seqlen_k=context + new,
                 softmax_scale=SCALE, causal=True, window_size=(-1, -1),
                 block_table=block_table, softcap=0, q_descale=None, k_descale=descale,
                 v_descale=descale, **env["split_k"])

    impls = {"ours": ours, "ours_split": ours_split, "baseline": baseline,
             "gather_only": gather,
             "upstream_unified": upstream_unified if _UNIFIED is not None else None}
    if env["varlen_name"] == "fa2":
        impls["gather_fa2"] = gather_fa2
    if not check:
        return impls, step_bytes(reqs, context, new)
    # Check once that the routes agree before timing them: the same kernel over
    # the same values in another layout is bit-identical; the fused call, FA2
    # and unified_attention (other summation orders) agree to bf16 rounding
    # (relative RMS error).
    ours_split()
    ref = out.clone()
    baseline()
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), "gather route differs"
    others = {"ours": ours, "gather_fa2": impls.get("gather_fa2"),
              "upstream_unified": impls["upstream_unified"]}
    for name, fn in others.items():
        if fn is None:
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 - a baseline that cannot run here: the
            if name == "ours":  # harness records its error as unavailable
                raise
            continue
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, f"{name} vs the split paged route: relative RMS error {rel:.2e}"
    return impls, step_bytes(reqs, context, new)


CASES = [(r, c, n) for c in CONTEXTS for n in NEW_TOKENS for r in REQUESTS]
# Steps with at most this many context-attention FLOPs take well under a
# millisecond on the GPU, less than the host needs to launch them eagerly
# (several Python wrappers and Triton launches): they are timed as CUDA-graph
# replays so the numbers are device time, like the larger steps (where eager
# timing already is, the host running ahead).
GRAPH_MAX_FLOPS = 1.5e11

# Tile override for tuning runs: PAGED_CONTEXT_TILE="block_m,block_n,warps,stages"
# (applies to every use of the kernel here, ours and the baselines alike).
_TILE = os.environ.get("PAGED_CONTEXT_TILE", "").strip()
if _TILE:
    pca._BLOCK_M, pca._BLOCK_N, pca._NUM_WARPS, pca._NUM_STAGES = map(int, _TILE.split(","))
TILE = f"{pca._BLOCK_M},{pca._BLOCK_N},{pca._NUM_WARPS},{pca._NUM_STAGES}"


@pytest.mark.parametrize("reqs,context,new", CASES,
                         ids=[f"r{r}_ctx{c // 1024}k_new{n}" for r, c, n in CASES])
def test_extend_step(kernel_bench, env, reqs, context, new):
    flops = context_flops(reqs, context, new)
    kernel_bench(
        kernel="paged_context",
        case=f"r{reqs}_ctx{context // 1024}k_new{new}_h32kv4_d128_bf16_b16",
        shapes=dict(requests=reqs, context=context, new_tokens=new, num_heads=NUM_HEADS,
                    num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                    dtype="bfloat16", gather=env["gather_name"],
                    new_token_attention=env["varlen_name"], tile=TILE,
                    context_flops=flops),
        nbytes=step_bytes(reqs, context, new),
        buffer_sets=lambda sets: [make_step(env, reqs, context, new, set_index=i, check=i == 0)[0]
                                  for i in range(sets)],
        graph=flops <= GRAPH_MAX_FLOPS,
        notes=_UNIFIED_MISSING,
    )
    torch.cuda.empty_cache()


def sweep(path: str) -> None:
    """``ours`` (the fused call) in every kernel variant (tile, programs per
    SM for the split count, rescale slack) against ``gather_fa2`` on the step
    sizes the backend routes to it; JSON with µs and ratios to ``path``."""
    import json

    from benchmarks.conftest import time_us

    shapes = [(1, 8192, 128), (1, 8192, 256), (4, 8192, 128), (1, 8192, 512),
              (4, 32768, 128), (1, 32768, 512), (1, 131072, 512)]
    # (block_m, block_n, warps, stages, programs per SM, rescale slack).  The
    # runs in benchmarks/notes/paged_context.md also had (128,64,4,3),
    # (128,128,8,3), (64,64,4,2), other slacks, and [D, N] K loads (a knob
    # since removed); none had a better worst case than the default.
    # PAGED_CONTEXT_SWEEP="bm,bn,w,s,pps,slack;..." replaces the list.
    variants = [(128, 64, 4, 2, 2, 8.0), (128, 128, 8, 2, 1, 8.0), (256, 64, 8, 2, 1, 8.0)]
    if os.environ.get("PAGED_CONTEXT_SWEEP"):
        variants = [(*map(int, v.split(",")[:5]), float(v.split(",")[5]))
                    for v in os.environ["PAGED_CONTEXT_SWEEP"].split(";")]
    if os.environ.get("PAGED_CONTEXT_SWEEP_SHAPES"):  # "reqs,context,new;..."
        shapes = [tuple(map(int, s.split(",")))
                  for s in os.environ["PAGED_CONTEXT_SWEEP_SHAPES"].split(";")]
    env = make_env(max(r * (c + n) for r, c, n in shapes))
    if env["varlen_name"] != "fa2":
        raise SystemExit("--sweep compares against gather + FlashAttention-2, which this "
                         "torch build does not run (aten _flash_attention_forward)")
    knobs = ("_BLOCK_M", "_BLOCK_N", "_NUM_WARPS", "_NUM_STAGES", "_PROGRAMS_PER_SM",
             "_RESCALE_SLACK")
    saved = {k: getattr(pca, k) for k in knobs}
    rows = []
    for reqs, context, new in shapes:
        impls, _ = make_step(env, reqs, context, new)
        shape = f"r{reqs}_ctx{context // 1024}k_new{new}"
        graph = context_flops(reqs, context, new) <= GRAPH_MAX_FLOPS
        ref_us = time_us(impls["gather_fa2"], graph)
        split_us = time_us(impls["ours_split"], graph)
        rows.append(dict(shape=shape, variant="gather_fa2", us=ref_us))
        rows.append(dict(shape=shape, variant="ours_split_default", us=round(split_us, 2)))
        print(f"{shape}: gather_fa2 {ref_us:.1f} us, ours_split {split_us:.1f} us", flush=True)
        for variant in variants:
            *tile, pps, slack = variant
            name = f"tile{'x'.join(map(str, tile))}_pps{pps}_slack{slack:g}"
            for knob, val in zip(knobs, variant, strict=True):
                setattr(pca, knob, val)
            try:
                us = time_us(impls["ours"], graph)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                rows.append(dict(shape=shape, variant=name, error=str(exc)[:200]))
                print(shape, name, "failed:", str(exc)[:200], flush=True)
                continue
            finally:
                for knob, val in saved.items():
                    setattr(pca, knob, val)
            ratio = ref_us / us
            rows.append(dict(shape=shape, variant=name, us=round(us, 2),
                             gather_fa2_over_ours=round(ratio, 3)))
            print(f"{shape} {name}: {us:.1f} us  gather_fa2/ours {ratio:.3f}", flush=True)
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sweep":
        sweep(sys.argv[2])
    else:
        print(__doc__)
