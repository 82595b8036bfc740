"""One step's attention calls as the patched backends and upstream 0.34.0 issue them.

Shared by ``bench_eager_step.py`` (whole steps over every layer, eager wall
clock vs GPU-only time) and ``bench_host_cost.py`` (host time per call).  No
vLLM is imported: the GPU machine has none.  The call sequences are written
from the pinned tree's code (``build/vllm``, patched and pristine):

AITER FA (``rocm_aiter_fa.py``, ``extend_forward``), per layer of an extend
step:

  * ours, paged route (0250: the extends bring at most 512 new tokens in all):
    one ``paged_context_attention`` call with the new tokens' key / value, the
    layer's cache views and scales, the step's workspace (one
    ``paged_context_workspace`` per step);
  * ours, gather route (0200: longer steps): the new tokens' varlen call, then
    per 32K-token context chunk ``fetch_kv`` with the step's plan (one
    ``fetch_kv_plan`` per chunk and step), the context varlen call, merges;
  * upstream: the new tokens' varlen call, per chunk ``cp_mha_gather_cache``
    (Triton, exec'd from the pinned tree), the context varlen call, merges
    (fresh buffers per chunk merge), with the builder's per-step
    ``token_to_batch`` map copied to the device.

AITER's CK varlen kernel is replaced by FlashAttention-2 (aten) or, where that
does not run, a torch stand-in -- the same call in both sequences.  The merge
is vLLM's CUDA ``merge_attn_states`` (what CDNA3 and newer run), compiled from
the pinned csrc, or the pinned tree's Triton merge when the build fails.

MLA (``mla_attention.py`` + ``mla.py``), per layer of a step with ``D``
decode and ``P`` prefill tokens:

  * ours (0303): the prefill rows' ``mla_rope_and_cache`` and the decode rows'
    ``mla_rope_concat_and_cache`` (the decode query, written into the decode
    rows' view of a persistent ``q_out`` buffer, as ``MLARopeFusion.q_out``
    hands the layer; until 2026-12-03 a new tensor per layer): the step's rows of each kind and their launches once per step
    (as MLACommonMetadataBuilder builds them), per layer ``q_pe`` of the
    prefill views forward_impl makes for forward_mha anyway, and the decode
    rows' ``q_pe`` (the decode op reads the step's ``kv_c`` / ``k_pe``
    unsliced; until 2026-12-04 also sliced per layer); each op called through the
    dispatcher, as ``torch.ops.vllm`` calls it, its implementation finding the
    step's launches by the layer's name (as ``_step_launches`` does through
    the forward context; until 2026-12-03 the Triton functions were called
    directly, without the dispatch upstream's side pays).  Not modelled: the
    layer's own per-call Python (``begin()``, the ``q_out`` workspace lookup);
  * upstream: RoPE of ``q_pe`` / ``k_pe`` inside the compiled piece (replayed
    as a CUDA graph with the rest of the piece), the cache write
    (``unified_mla_kv_cache_update``, an eager custom op, modelled by one
    registered the same way: the layer lookup, ``concat_and_cache_mla``, the
    dummy dependency tensor) and the decode query ``torch.cat([ql_nope, q_pe])``.  ``concat_and_cache_mla`` itself is not
    built here (its csrc file holds every cache kernel); vLLM's CUDA
    ``concat_and_cache_mla_rope_fused`` from the same csrc stands in (same
    launch path, the cache rows plus a one-head dummy query rotated), else a
    torch ``index_copy_`` of the rows.

Both MLA sequences replay one CUDA graph per layer for the piece before the
attention op; ours holds a one-kernel stand-in for the projections, upstream's
the same stand-in plus its RoPE (``torch.compile``), so the graph launch cost
is paid by both.  The attention kernels themselves (the same in both) are not
part of either MLA sequence.

Code both backends run alike is left out of both sequences: the attention
custom op's dispatch and forward context, the per-layer cache split and the
token slices ``forward`` takes before ``extend_forward`` (AITER FA), the W_UK
bmm and the attention kernels (MLA).  The views a sequence itself makes
(context-chunk rows, the rows of each token kind) are in it.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass, field

import torch

from benchmarks.graphs import capture as _graph  # warm-up on a side stream, capture

# ---------------------------------------------------------------- models

QWEN3_30B = dict(name="qwen3-30b-a3b", layers=48, num_heads=32, num_kv_heads=4,
                 head_size=128, block_size=16, dtype=torch.bfloat16)
DEEPSEEK_V3 = dict(name="deepseek-v3", layers=61, num_heads=128, kv_lora_rank=512,
                   rope_dim=64, nope_dim=128, block_size=64, dtype=torch.bfloat16)
# 0250's default VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS and 0.34.0's
# _CP_TOKENS_PER_ITER_ROCM.
PAGED_CONTEXT_MAX_TOKENS = 512
CP_TOKENS_PER_ITER = 32 * 1024


# ---------------------------------------------------------------- upstream ops


@dataclass
class UpstreamOps:
    """Upstream's kernels for the sequences, and what stands in where."""

    gather: object = None  # cp_mha_gather_cache (pinned Triton)
    merge: object = None  # merge_attn_states(output, prefix_out, prefix_lse, suffix_out, suffix_lse, output_lse=None)
    varlen: object = None  # (q, k, v, cu_q, cu_k, max_q, max_k, causal) -> (out, lse [H, T])
    cache_mla: object = None  # (kv_c, k_pe, cache, slots, positions, cos_sin, k_scale)
    notes: dict = field(default_factory=dict)


def _varlen_ops(scale_of):
    """FlashAttention-2 varlen (aten) when it runs GQA with an [H, T] LSE, else torch."""
    from benchmarks import bench_paged_context as bpc

    picked, name = bpc._pick_varlen()

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        if name == "fa2":
            out, lse, *_ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale_of(q))
            return out, lse
        return bpc._torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale=scale_of(q))

    return varlen, name


@functools.cache
def upstream_ops() -> UpstreamOps:
    """Load / build upstream's ops once; every failure is recorded, not raised."""
    from benchmarks import upstream_kernels
    from benchmarks.bench_mla_rope_cache import build_cuda_fused, build_pinned_extension

    ops = UpstreamOps()
    try:
        ops.gather = upstream_kernels.load_cp_mha_gather_cache()
        ops.notes["gather"] = "cp_mha_gather_cache (pinned tree, Triton)"
    except Exception as exc:  # noqa: BLE001
        ops.notes["gather"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    try:
        mod = build_pinned_extension("vllm_merge_attn_states_bench",
                                     "attention/merge_attn_states.cu",
                                     "merge_attn_states_binding.cpp")

        def merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                  output_lse=None):
            mod.merge_attn_states(output, output_lse, prefix_output, prefix_lse,
                                  suffix_output, suffix_lse)

        ops.merge = merge
        ops.notes["merge"] = "merge_attn_states (pinned csrc, CUDA)"
    except Exception as exc:  # noqa: BLE001 - the Triton merge of the same tree
        traceback.print_exc()
        try:
            ops.merge = upstream_kernels.load_triton_merge_attn_states()
            ops.notes["merge"] = ("merge_attn_states (pinned tree, Triton; the CUDA build "
                                  f"failed: {type(exc).__name__})")
        except Exception as exc2:  # noqa: BLE001
            ops.notes["merge"] = f"unavailable: {type(exc2).__name__}: {exc2}"[:300]
    ops.varlen, name = _varlen_ops(lambda q: q.shape[-1] ** -0.5)
    ops.notes["varlen"] = ("FlashAttention-2 varlen (aten), standing in for AITER's CK "
                           "flash_attn_varlen_func" if name == "fa2" else
                           "torch varlen stand-in (no FlashAttention-2 in this torch)")
    try:
        fused = build_cuda_fused()
        dummy_q: dict = {}

        def cache_mla(kv_c, k_pe, cache, slots, positions, cos_sin, k_scale):
            q = dummy_q.get(kv_c.shape[0])
            if q is None:
                q = dummy_q[kv_c.shape[0]] = torch.zeros(
                    kv_c.shape[0], 1, k_pe.shape[-1], device=kv_c.device, dtype=kv_c.dtype)
            fused(positions, q, k_pe, kv_c, cos_sin, False, slots, cache, "auto", k_scale)

        ops.cache_mla = cache_mla
        ops.notes["cache_mla"] = ("concat_and_cache_mla_rope_fused (pinned csrc, CUDA, "
                                  "one-head dummy q) standing in for concat_and_cache_mla")
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()

        def cache_mla(kv_c, k_pe, cache, slots, positions, cos_sin, k_scale):
            cache.view(-1, cache.shape[-1]).index_copy_(0, slots, torch.cat([kv_c, k_pe], -1))

        ops.cache_mla = cache_mla
        ops.notes["cache_mla"] = ("torch cat + index_copy_ standing in for concat_and_cache_mla "
                                  f"(the CUDA build failed: {type(exc).__name__})")
    return ops


# ---------------------------------------------------------------- AITER FA


def fa_caches(model: dict, max_tokens: int, device="cuda") -> list[torch.Tensor]:
    """One packed cache ``(num_blocks, Hkv, bs, 2D)`` per layer (0.34.0's layout)."""
    num_blocks = max_tokens // model["block_size"] + 64
    shape = (num_blocks, model["num_kv_heads"], model["block_size"], 2 * model["head_size"])
    return [torch.randn(shape, device=device, dtype=model["dtype"])
            for _ in range(model["layers"])]


def _split_kv_cache(kv_cache: torch.Tensor, head_size: int):
    # AiterFlashAttentionImpl._split_kv_cache for the packed layout.
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


@dataclass
class FaStep:
    """One extend step of ``reqs`` requests, ``context`` cached + ``new`` new tokens each."""

    # (eager: bool = True) -> None: the step as the patched backend / upstream
    # runs it; eager=False leaves out host-only builder work (for capture).
    ours: object
    upstream: object
    route: str  # "paged" or "gather"
    output: torch.Tensor
    num_chunks: int
    layers: int


def fa_step(model: dict, caches: list[torch.Tensor], ops: UpstreamOps, reqs: int,
            context: int, new: int, layers: int | None = None, seed: int = 0) -> FaStep:
    from vllm.v1.attention.ops.triton_fetch_kv import fetch_kv, fetch_kv_plan
    from vllm.v1.attention.ops.triton_paged_context_attention import (
        paged_context_attention,
        paged_context_workspace,
    )

    dev = caches[0].device
    layers = layers or model["layers"]
    hq, hkv, d, bs, dtype = (model[k] for k in ("num_heads", "num_kv_heads", "head_size",
                                                 "block_size", "dtype"))
    scale = d**-0.5
    gen = torch.Generator(device="cpu").manual_seed(seed + reqs * 1000003 + context + new)
    pages = -(-(context + new) // bs)
    num_blocks = caches[0].shape[0]
    ids = torch.randperm(num_blocks - 1, generator=gen)[: reqs * pages] + 1
    block_table = ids.view(reqs, pages).to(torch.int32).to(dev)
    total_new = reqs * new
    q = torch.randn(total_new, hq, d, device=dev, dtype=dtype)
    k = torch.randn(total_new, hkv, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    output = torch.empty_like(q)
    cu_q = torch.arange(reqs + 1, dtype=torch.int32, device=dev) * new
    seq_lens = torch.full((reqs,), context + new, dtype=torch.int32, device=dev)
    k_scale = torch.tensor(1.0, dtype=torch.float32, device=dev)  # layer._k_scale
    v_scale = torch.tensor(1.0, dtype=torch.float32, device=dev)
    # Per-layer views the backend passes (its forward slices these every layer).
    views = [_split_kv_cache(c, d) for c in caches[:layers]]

    # Context chunks as the builder makes them (0.34.0 and 0200 alike).
    max_chunk = CP_TOKENS_PER_ITER // reqs
    num_chunks = -(-context // max_chunk)
    chunk_starts = torch.arange(num_chunks, dtype=torch.int32)[:, None] * max_chunk
    chunk_lens = torch.clamp(torch.full((1, reqs), context) - chunk_starts, 0, max_chunk)
    cu_kv_cpu = torch.zeros(num_chunks, reqs + 1, dtype=torch.int32)
    cu_kv_cpu[:, 1:] = chunk_lens.cumsum(1)
    cu_kv = cu_kv_cpu.to(dev)
    starts = chunk_starts.expand(num_chunks, reqs).contiguous().to(dev)
    totals = cu_kv_cpu[:, -1].tolist()
    max_kv = chunk_lens.max(dim=1).values.tolist()
    workspace = torch.empty(2, max(totals + [1]), hkv, d, device=dev, dtype=dtype)
    varlen, merge, gather = ops.varlen, ops.merge, ops.gather

    def upstream_builder():
        # The builder's token_to_batch maps (0.34.0; 0200 removed them).
        max_cum = max(totals + [0])
        rng = torch.arange(max_cum, dtype=torch.int32)[None, None, :]
        idx = (rng == cu_kv_cpu[:, 1:][:, :, None]).sum(dim=1)
        host = torch.cumsum(idx, dim=1)  # async_tensor_h2d: pinned, non-blocking
        return (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)

    # For GPU-only timing (a captured step) the host-built map is made once
    # here: host work and pinned allocations cannot be captured.
    token_to_batch_once = upstream_builder()

    def upstream(eager: bool = True):
        token_to_batch = upstream_builder() if eager else token_to_batch_once
        key_fetched, value_fetched = workspace[0], workspace[1]
        for kc, vc in views:
            out, lse = varlen(q, k, v, cu_q, cu_q, new, new, True)
            chunked_out = chunked_lse = None
            for c in range(num_chunks):
                gather(key_cache=kc, value_cache=vc, key=key_fetched, value=value_fetched,
                       block_tables=block_table, k_scales=k_scale, v_scales=v_scale,
                       cu_seqlens_kv=cu_kv[c], token_to_batch=token_to_batch[c],
                       seq_starts=starts[c], dequant=False, kv_cache_layout="NHD",
                       total_tokens=totals[c])
                suf_out, suf_lse = varlen(q, key_fetched, value_fetched, cu_q, cu_kv[c], new,
                                          max_kv[c], False)
                if chunked_out is None:
                    chunked_out, chunked_lse = suf_out, suf_lse
                else:
                    tmp_out, tmp_lse = torch.empty_like(out), torch.empty_like(lse)
                    merge(tmp_out, chunked_out, chunked_lse, suf_out, suf_lse, output_lse=tmp_lse)
                    chunked_out, chunked_lse = tmp_out, tmp_lse
            merge(output, chunked_out, chunked_lse, out, lse)

    paged = total_new <= PAGED_CONTEXT_MAX_TOKENS
    if paged:
        def ours(eager: bool = True):
            # The builder (0250): the step's buffers, its metadata bound to them.
            ws = paged_context_workspace(block_table, cu_q, seq_lens, num_tokens=total_new,
                                         num_heads=hq, num_kv_heads=hkv, head_size=d,
                                         dtype=dtype, max_context_len=context)
            for kc, vc in views:
                paged_context_attention(q, kc, vc, block_table, cu_q, seq_lens, scale, key=k,
                                        value=v, k_scale=k_scale, v_scale=v_scale, out=output,
                                        max_context_len=context, workspace=ws)
    else:
        def ours(eager: bool = True):
            plans = [fetch_kv_plan(block_table, cu_kv[c], starts[c], num_tokens=totals[c],
                                   block_size=bs, head_size=d, cache_dtype=dtype,
                                   out_dtype=dtype, kv_cache_layout="NHD")
                     for c in range(num_chunks)]
            key_fetched, value_fetched = workspace[0], workspace[1]
            for kc, vc in views:
                out, lse = varlen(q, k, v, cu_q, cu_q, new, new, True)
                chunked_out = chunked_lse = spare_out = spare_lse = None
                for c in range(num_chunks):
                    fetch_kv(key_cache=kc, value_cache=vc, key_out=key_fetched,
                             value_out=value_fetched, block_table=block_table, k_scale=k_scale,
                             v_scale=v_scale, cu_seqlens_kv=cu_kv[c], seq_starts=starts[c],
                             kv_cache_layout="NHD", max_num_tokens=totals[c], plan=plans[c])
                    suf_out, suf_lse = varlen(q, key_fetched, value_fetched, cu_q, cu_kv[c], new,
                                              max_kv[c], False)
                    if chunked_out is None:
                        chunked_out, chunked_lse = suf_out, suf_lse
                    else:
                        if spare_out is None:
                            spare_out, spare_lse = torch.empty_like(out), torch.empty_like(lse)
                        merge(spare_out, chunked_out, chunked_lse, suf_out, suf_lse,
                              output_lse=spare_lse)
                        chunked_out, spare_out = spare_out, chunked_out
                        chunked_lse, spare_lse = spare_lse, chunked_lse
                merge(output, chunked_out, chunked_lse, out, lse)

    return FaStep(ours=ours, upstream=upstream, route="paged" if paged else "gather",
                  output=output, num_chunks=num_chunks, layers=layers)


def fa_flops(model: dict, reqs: int, context: int, new: int) -> int:
    """Attention FLOPs of one layer: QK^T and PV over context + causal new tokens."""
    hq, d = model["num_heads"], model["head_size"]
    return 4 * reqs * hq * d * new * (context + (new + 1) / 2)


# ---------------------------------------------------------------- MLA


def _rope_gptj_inplace(positions, q_pe, k_pe, cos_sin):
    """vLLM's native GPT-J rotary embedding of q_pe / k_pe, in place (mla.py's
    ``q[..., P:], k_pe = rotary_emb(positions, q[..., P:], k_pe)``)."""
    from benchmarks.bench_mla_rope_cache import _rope_qk

    q_rot, k_rot = _rope_qk(positions, q_pe, k_pe, cos_sin)
    q_pe.copy_(q_rot)
    k_pe.copy_(k_rot)


_COMPILED_ROPE = None


def _compiled_rope():
    global _COMPILED_ROPE
    if _COMPILED_ROPE is None:
        _COMPILED_ROPE = torch.compile(_rope_gptj_inplace, dynamic=True)
    return _COMPILED_ROPE


# What upstream's unified_mla_kv_cache_update finds through the forward
# context for a layer name: (kv_cache, slot_mapping, positions, cos_sin); what
# 0303's ops find there: the step's MLARopeRows launches of each kind
# ({"decode": {...}, "prefill": {...}}, renewed per step as the builder does).
_LAYER_CONTEXT: dict = {}
_OUR_LAYER_ROWS: dict = {}
_LIBRARY = None


def _library() -> torch.library.Library:
    """The three MLA ops as vLLM registers its own (a custom op with a Python
    implementation, called through the dispatcher): upstream's cache write,
    and 0303's two fused ops with the parameters of theirs."""
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    from vllm.v1.attention.ops import triton_mla_rope_cache as mla

    lib = torch.library.Library("eager_step_bench", "FRAGMENT")
    lib.define("mla_kv_cache_update(Tensor kv_c, Tensor k_pe, str layer_name, "
               "str kv_cache_dtype, Tensor k_scale) -> Tensor")
    lib.define("mla_rope_concat_and_cache(Tensor ql_nope, Tensor q_pe, Tensor kv_c, "
               "Tensor k_pe, Tensor(a!) kv_cache, Tensor(b!) q_out, Tensor slot_mapping, "
               "Tensor positions, Tensor cos_sin_cache, bool is_neox, str kv_cache_dtype, "
               "Tensor k_scale, Tensor? q_scale, bool use_aiter, bool all_q_rope, "
               "str layer_name) -> ()")
    lib.define("mla_rope_and_cache(Tensor(a!) q_pe, Tensor kv_c, Tensor(b!) k_pe, "
               "Tensor(c!) kv_cache, Tensor slot_mapping, Tensor positions, "
               "Tensor cos_sin_cache, bool is_neox, str kv_cache_dtype, Tensor k_scale, "
               "str layer_name) -> ()")

    def update(kv_c, k_pe, layer_name, kv_cache_dtype, k_scale):
        kv_cache, slots, positions, cos_sin = _LAYER_CONTEXT[layer_name]
        lib.cache_mla(kv_c, k_pe, kv_cache, slots, positions, cos_sin, k_scale)
        return torch.empty(0, device=kv_c.device, dtype=kv_c.dtype)

    def decode(ql_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, positions,
               cos_sin_cache, is_neox, kv_cache_dtype, k_scale, q_scale, use_aiter,
               all_q_rope, layer_name):
        mla.mla_rope_concat_and_cache(
            ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache,
            is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, q_out=q_out,
            q_scale=q_scale, launches=_OUR_LAYER_ROWS[layer_name]["decode"])

    def prefill(q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache, is_neox,
                kv_cache_dtype, k_scale, layer_name):
        mla.mla_rope_and_cache(
            q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache, is_neox,
            kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
            launches=_OUR_LAYER_ROWS[layer_name]["prefill"])

    for key in ("CUDA", "CPU"):
        lib.impl("mla_kv_cache_update", update, key)
        lib.impl("mla_rope_concat_and_cache", decode, key)
        lib.impl("mla_rope_and_cache", prefill, key)
    _LIBRARY = lib
    return lib


def _kv_cache_update_op(ops: UpstreamOps):
    """``unified_mla_kv_cache_update``: look the layer up, write its cache
    rows, return the dummy dependency tensor."""
    _library().cache_mla = ops.cache_mla
    return torch.ops.eager_step_bench.mla_kv_cache_update


def mla_caches(model: dict, num_blocks: int, device="cuda") -> list[torch.Tensor]:
    width = model["kv_lora_rank"] + model["rope_dim"]
    return [torch.zeros(num_blocks, model["block_size"], width, device=device,
                        dtype=model["dtype"]) for _ in range(model["layers"])]


@dataclass
class MlaStep:
    ours: object  # (graph_pieces: bool) -> None
    upstream: object
    layers: int
    # One layer's calls of each sequence, one by one (eager_mla_parts.py):
    # name -> a call with no arguments, the same call the step makes per layer.
    parts: dict = field(default_factory=dict)


def mla_step(model: dict, caches: list[torch.Tensor], ops: UpstreamOps, decodes: int,
             prefill: int, layers: int | None = None, seed: int = 0) -> MlaStep:
    from benchmarks.bench_mla_rope_cache import cos_sin_cache
    from vllm.v1.attention.ops import triton_mla_rope_cache as mla

    dev = caches[0].device
    layers = layers or model["layers"]
    h, lr, r, p, bs, dtype = (model[k] for k in ("num_heads", "kv_lora_rank", "rope_dim",
                                                  "nope_dim", "block_size", "dtype"))
    num_tokens = decodes + prefill
    gen = torch.Generator(device=dev).manual_seed(seed)
    num_blocks = caches[0].shape[0]
    # Decodes: one token each in a random block; the prefill chunk: consecutive
    # slots of randomly permuted blocks.
    perm = torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1
    dec_slots = perm[:decodes] * bs + torch.randint(0, bs, (decodes,), device=dev,
                                                    generator=gen)
    tok = torch.arange(prefill, device=dev)
    pre_slots = perm[decodes:][tok // bs] * bs + tok % bs
    slots = torch.cat([dec_slots, pre_slots]).long()
    positions = torch.cat([torch.randint(0, 100000, (decodes,), device=dev, generator=gen),
                           tok + 4096]).long()
    cos_sin = cos_sin_cache(dev)
    q = torch.randn(num_tokens, h, p + r, device=dev, dtype=dtype, generator=gen)
    kv = torch.randn(num_tokens, lr + r, device=dev, dtype=dtype, generator=gen)
    kv_c, k_pe = kv[:, :lr], kv[:, lr:]
    # The decode rows' q_nope @ W_UK (computed in forward_impl by both).
    ql_nope = torch.randn(h, decodes, lr, device=dev, dtype=dtype,
                          generator=gen).transpose(0, 1)
    k_scale = torch.tensor(1.0, dtype=torch.float32, device=dev)
    q_out_buffer = torch.empty(max(decodes, 1), h, lr + r, device=dev, dtype=dtype)
    stand_in = torch.zeros(1024, device=dev)

    def piece_common():  # the projections of the piece before attention, both sides
        stand_in.add_(1)

    def piece_upstream():
        stand_in.add_(1)
        _compiled_rope()(positions, q[..., p:], k_pe, cos_sin)

    graphs: dict = {}

    def replay(name, fn, graph_pieces):
        if not graph_pieces:
            fn()
            return
        if name not in graphs:
            graphs[name] = _graph(fn)
        graphs[name].replay()

    # forward_impl's views of the prefill rows, which forward_mha reads on both
    # sides (0303 hands the same views to the fused prefill call); not modelled
    # on either side, as forward_mha itself is not.
    mha_q, mha_kv_c, mha_k_pe = q[decodes:], kv_c[decodes:], k_pe[decodes:]

    names = [f"model.layers.{layer}.self_attn.attn" for layer in range(layers)]
    our_ops = torch.ops.eager_step_bench
    rows = {"decode": {}, "prefill": {}}  # the step's launches of each kind
    for layer, name in enumerate(names):
        _OUR_LAYER_ROWS[name] = rows
        _LAYER_CONTEXT[name] = (caches[layer], slots, positions, cos_sin)
    update = _kv_cache_update_op(ops)

    def ours(graph_pieces: bool = True):
        # The step's rows, as MLACommonMetadataBuilder builds them once per step
        # (build_mla_rope_step_rows: the slices of each token kind, each with
        # the step's launches, filled by the step's first layer).
        d_sl, d_pos = slots[:decodes], positions[:decodes]
        p_sl, p_pos = slots[decodes:], positions[decodes:]
        rows["decode"] = {}
        rows["prefill"] = {}
        for name, cache in zip(names, caches):
            replay("ours", piece_common, graph_pieces)
            # Through the dispatcher, positionally, as MLARopeKVStep calls
            # torch.ops.vllm (and upstream its cache write).
            if prefill:
                our_ops.mla_rope_and_cache(mha_q[..., p:], mha_kv_c, mha_k_pe, cache, p_sl,
                                           p_pos, cos_sin, False, "auto", k_scale, name)
            if decodes:
                # The decode rows' view of the layers' persistent q_out buffer
                # (MLARopeFusion.q_out; its workspace lookup is not modelled);
                # the step's kv_c / k_pe, whose decode rows the op reads.
                our_ops.mla_rope_concat_and_cache(
                    ql_nope, q[:decodes, :, p:], kv_c, k_pe, cache,
                    q_out_buffer[:decodes], d_sl, d_pos, cos_sin, False, "auto", k_scale, None,
                    False, False, name)

    def upstream(graph_pieces: bool = True):
        for name in names:
            replay("upstream", piece_upstream, graph_pieces)
            # MLAAttention.forward: the cache write through its custom op.
            update(kv_c, k_pe, name, "auto", k_scale)
            if decodes:
                torch.cat((ql_nope, q[:decodes, :, p:]), dim=-1)

    # The first layer's calls, as the two steps make them: the decode rows'
    # slots and positions sliced once, as ours() slices them once per step.
    name, cache = names[0], caches[0]
    d_sl, d_pos = slots[:decodes], positions[:decodes]
    parts = {
        "torch op": piece_common,
        "graph piece, ours": lambda: replay("ours", piece_common, True),
        "graph piece, upstream": lambda: replay("upstream", piece_upstream, True),
        "cache write op, upstream": lambda: update(kv_c, k_pe, name, "auto", k_scale),
    }
    if decodes:
        parts["decode op, ours"] = lambda: our_ops.mla_rope_concat_and_cache(
            ql_nope, q[:decodes, :, p:], kv_c, k_pe, cache, q_out_buffer[:decodes], d_sl,
            d_pos, cos_sin, False, "auto", k_scale, None, False, False, name)
        # The same call's implementation, without the dispatcher.
        parts["decode function, ours"] = lambda: mla.mla_rope_concat_and_cache(
            ql_nope, q[:decodes, :, p:], kv_c, k_pe, cache, d_sl, d_pos, cos_sin, False,
            kv_cache_dtype="auto", k_scale=k_scale, q_out=q_out_buffer[:decodes],
            q_scale=None, launches=rows["decode"])
        parts["decode query cat, upstream"] = lambda: torch.cat(
            (ql_nope, q[:decodes, :, p:]), dim=-1)
    return MlaStep(ours=ours, upstream=upstream, layers=layers, parts=parts)


def mla_bytes(model: dict, decodes: int, prefill: int) -> int:
    """What the fused calls must read and write once per layer (bf16 cache)."""
    h, lr, r = model["num_heads"], model["kv_lora_rank"], model["rope_dim"]
    t = decodes + prefill
    return 2 * (t * (lr + r) * 2 + decodes * h * (lr + r) * 2 + prefill * h * r * 2)


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


__all__ = [
    "DEEPSEEK_V3", "QWEN3_30B", "FaStep", "MlaStep", "UpstreamOps", "fa_caches", "fa_flops",
    "fa_step", "mla_bytes", "mla_caches", "mla_step", "relative_rms",
    "upstream_ops",
]
