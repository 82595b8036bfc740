"""AITER FA's extend path, end to end on the CPU tier, against dense attention.

Runs the PATCHED ``vllm.v1.attention.backends.rocm_aiter_fa`` (0200 + 0250):
the real metadata builder, ``AiterFlashAttentionImpl.forward`` and its
``extend_forward``, for batches ordered decode -> extend -> prefill, and
compares every token's output with a float64 dense attention over
``[cached context | new tokens]`` (causal within the new tokens).

What is real and what is faked:

  * real: the backend file of the build tree, executed with the platform
    reporting ROCm so its ROCm-only block runs (it imports ``fetch_kv``,
    ``paged_context_attention`` and ``use_paged_context``) and the builder's
    ROCm gate for the paged route is taken; the builder (constructor and
    ``build``) on a real ``VllmConfig``; a real ``Attention`` layer registered
    in the config; the overlay's Triton kernels (``TRITON_INTERPRET=1``);
    vLLM's own CPU ``merge_attn_states`` (``_merge_attn_states_torch``: off a
    GPU ``vllm.triton_utils`` replaces Triton with placeholders, so vLLM's
    Triton merge cannot run here, and its CUDA op is not built);
  * faked: the ``aiter`` package (absent off ROCm).  ``aiter.flash_attn_varlen_func``
    and ``aiter.ops.triton.unified_attention.unified_attention`` are written here
    in float64 torch, independent of the series' kernels.  The fake varlen
    function also checks the host maxima it is given (``max_seqlen_q/k``),
    since the real kernel sizes its grid from them;
  * not run: ``do_kv_cache_update`` (needs vLLM's compiled ``_C_cache_ops``);
    the test writes the paged cache itself, as that op would.

The cache is vLLM 0.33.0's packed ``(num_blocks, H_kv, block_size, 2 * D)``;
block 0 and every block or slot no request owns hold NaN, so an unmasked read
of them shows.  Block tables are permutations of blocks 1..N, their unused
tail entries name a free (NaN) block, as stale entries would.  GQA 4
(8 query heads, 2 kv heads), head size 32, block size 16, contexts that are not
multiples of 16; fp32 (one mixed batch also fp16, and fp16 over an fp8 e4m3fn
cache).

Routes covered: 0250's paged context (default threshold, and a step at exactly
the threshold); 0200's gather (flag 0, one token over the threshold, and 4-5
context chunks through a shrunk ``_CP_TOKENS_PER_ITER_ROCM`` so the reused merge
buffers alternate); 0200's other two fetch_kv call sites (KV-sharing layer with
key=None, sliding-window extend).  Decodes run through the ``unified_attention``
fallback (head size < 64); the ``paged_attention_v1`` HIP op (head size >= 64)
and the SHUFFLE layout are not run here.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import sys
import types
from dataclasses import dataclass

import pytest
import torch

NUM_HEADS = 8
NUM_KV_HEADS = 2
HEAD_SIZE = 32
BLOCK_SIZE = 16
SCALE = HEAD_SIZE**-0.5
LAYER = "model.layers.0.self_attn.attn"
BACKEND = "vllm.v1.attention.backends.rocm_aiter_fa"
# Against a float64 reference, |err| <= TOL * (1 + |ref|), in units of the
# dtype's unit roundoff u.  fp32 (u = 6e-8): dots of <= 55 context tokens, two
# softmax normalisations and a merge, each a few u: 64 u = 3.8e-6 (observed
# <= 5e-7).  fp16 (u = 4.9e-4): P, the partial outputs and the output are each
# rounded once to fp16: 4 u = 2e-3 (observed <= 4.6e-4).
TOL = {dt: n * torch.finfo(dt).eps / 2 for dt, n in ((torch.float32, 64), (torch.float16, 4))}


# --------------------------------------------------------------------------
# The fake AITER (float64 torch; nothing from the series).
# --------------------------------------------------------------------------


def _attend(q, k, v, scale, causal, window_left=-1):
    """One sequence: q [n, Hq, D], k/v [m, Hkv, D] -> (out [n, Hq, D], lse [Hq, n]).

    float64.  causal: bottom-right aligned (query i sees keys j <= i + m - n),
    flash-attention's convention; window_left >= 0 also drops keys
    j < i + m - n - window_left.  A row that sees no key: out 0, lse -inf.
    """
    n, hq, _ = q.shape
    m = k.shape[0]
    group = hq // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    if causal:
        s = s.masked_fill(j > i + (m - n), float("-inf"))
    if window_left >= 0:
        s = s.masked_fill(j < i + (m - n) - window_left, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf for empty rows
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse


class FakeAiter:
    """Torch stand-ins for the AITER functions AITER FA's forward calls."""

    def __init__(self):
        self.varlen_calls = []

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        min_seqlen_q=None, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=None, alibi_slopes=None, return_lse=False, out=None, sink_ptr=None,
    ):
        assert dropout_p == 0.0 and alibi_slopes is None and sink_ptr is None
        window_left, window_right = (-1, -1) if window_size is None else window_size
        assert window_right in (-1, 0) and (window_left == -1 or causal)
        assert q.dim() == 3 and k.shape == v.shape and k.shape[1:] == (NUM_KV_HEADS, HEAD_SIZE)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert len(cq) == len(ck) and cq[0] == 0 and ck[0] == 0
        assert cq[-1] <= q.shape[0] and ck[-1] <= k.shape[0]
        q_lens = [b - a for a, b in itertools.pairwise(cq)]
        k_lens = [b - a for a, b in itertools.pairwise(ck)]
        # The real kernel sizes its launch from these host maxima.
        assert max(q_lens) <= max_seqlen_q, (q_lens, max_seqlen_q)
        assert max(k_lens) <= max_seqlen_k, (k_lens, max_seqlen_k)
        if min_seqlen_q is not None:
            assert min(q_lens) >= min_seqlen_q
        self.varlen_calls.append({"causal": causal, "return_lse": return_lse,
                                  "q_lens": q_lens, "k_lens": k_lens, "window": window_left})
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        res = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
        for b in range(len(q_lens)):
            o, l_ = _attend(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                            scale, causal, window_left)
            res[cq[b]:cq[b + 1]] = o
            lse[:, cq[b]:cq[b + 1]] = l_
        if out is None:
            out = torch.empty_like(q)
        out.copy_(res.to(out.dtype))
        return (out, lse.float()) if return_lse else out

    def unified_attention(
        self, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
        softmax_scale, causal, alibi_slopes, window_size, block_table, softcap,
        q_descale, k_descale, v_descale, sinks=None,
    ):
        """Paged decode: k/v are [num_blocks, block_size, Hkv, D] cache views."""
        assert causal and alibi_slopes is None and sinks is None and softcap == 0
        assert window_size[1] in (-1, 0)
        cq = cu_seqlens_q.tolist()
        lens = seqused_k.tolist()
        assert max(lens) <= max_seqlen_k
        for b, seq_len in enumerate(lens):
            assert cq[b + 1] - cq[b] <= max_seqlen_q
            pos = torch.arange(seq_len)
            blocks = block_table[b].long()[pos // k.shape[1]]
            kb = k[blocks, pos % k.shape[1]].double()
            vb = v[blocks, pos % k.shape[1]].double()
            if k_descale is not None:  # fp8 cache: [num_seqs, Hkv] descales
                kb = kb * k_descale[b].double()[None, :, None]
                vb = vb * v_descale[b].double()[None, :, None]
            o, _ = _attend(q[cq[b]:cq[b + 1]], kb, vb, softmax_scale, True, window_size[0])
            out[cq[b]:cq[b + 1]] = o.to(out.dtype)


@pytest.fixture
def fake_aiter(monkeypatch):
    fake = FakeAiter()
    pkg = types.ModuleType("aiter")
    pkg.__path__ = []
    pkg.flash_attn_varlen_func = fake.flash_attn_varlen_func
    ops = types.ModuleType("aiter.ops")
    ops.__path__ = []
    ops_triton = types.ModuleType("aiter.ops.triton")
    ops_triton.__path__ = []
    unified = types.ModuleType("aiter.ops.triton.unified_attention")
    unified.unified_attention = fake.unified_attention
    pkg.ops, ops.triton, ops_triton.unified_attention = ops, ops_triton, unified
    for mod in (pkg, ops, ops_triton, unified):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return fake


# --------------------------------------------------------------------------
# The patched backend, executed as on ROCm.
# --------------------------------------------------------------------------


class _RocmPlatform:
    """The current platform, except that it reports ROCm."""

    def __init__(self, real):
        self._real = real

    def is_rocm(self):
        return True

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def backend():
    """A private copy of the patched backend module, executed with is_rocm() True."""
    real = importlib.import_module(BACKEND)  # imports its dependencies
    from vllm.platforms import current_platform

    name = BACKEND + "_as_rocm"
    spec = importlib.util.spec_from_file_location(name, real.__file__)
    mod = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(current_platform, "is_rocm", lambda: True)
        mp.setitem(sys.modules, name, mod)
        spec.loader.exec_module(mod)
    # The ROCm-only block ran: the series' kernels are bound in the module.
    from vllm.v1.attention.ops import triton_fetch_kv, triton_paged_context_attention

    missing = [n for n in ("fetch_kv", "paged_context_attention", "use_paged_context")
               if not hasattr(mod, n)]
    assert not missing, (f"{real.__file__} binds no {missing} on ROCm: is the tree "
                         "built with 0200 and 0250 (make apply)?")
    assert mod.fetch_kv is triton_fetch_kv.fetch_kv
    assert mod.paged_context_attention is triton_paged_context_attention.paged_context_attention
    assert mod.use_paged_context is triton_paged_context_attention.use_paged_context
    mod.current_platform = _RocmPlatform(current_platform)
    # vLLM's merge dispatches to its CUDA op, its Triton kernel or (on the CPU
    # platform) its torch version; off a GPU vllm.triton_utils stubs Triton out,
    # so bind vLLM's own CPU merge.
    from vllm.v1.attention.ops import merge_attn_states as merge_mod

    mod.merge_attn_states = merge_mod._merge_attn_states_torch
    sys.modules[name] = mod
    yield mod
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local model directory holding only a config.json (GQA 4, head size 32)."""
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": NUM_HEADS * HEAD_SIZE,
        "head_dim": HEAD_SIZE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": 1,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "vocab_size": 1024,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }))
    return d


@pytest.fixture
def cpu_host_staging(monkeypatch):
    """build() stages host tensors in pinned memory, which CPU-only torch lacks."""
    from vllm.utils import torch_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    zeros = torch.zeros

    def zeros_unpinned(*args, pin_memory=False, **kwargs):
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros_unpinned)


@pytest.fixture
def make_backend(backend, model_dir, fake_aiter, cpu_host_staging, monkeypatch):
    """Build (layer, builder, impl) with the real VllmConfig, Attention layer and builder.

    ``paged_max_tokens``: VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS (None: unset,
    the default 256); ``chunk_tokens``: the gather route's per-chunk workspace
    (``_CP_TOKENS_PER_ITER_ROCM``, 32K upstream).
    """
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", raising=False)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert not backend.rocm_aiter_ops.is_shuffle_kv_cache_enabled()

    def make(paged_max_tokens=None, chunk_tokens=None, sliding_window=None, kv_bypass=False,
             dtype=torch.float32, kv_scales=None):
        if paged_max_tokens is None:
            monkeypatch.delenv("VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS", raising=False)
        else:
            monkeypatch.setenv("VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS",
                               str(paged_max_tokens))
        if chunk_tokens is not None:
            monkeypatch.setattr(backend, "_CP_TOKENS_PER_ITER_ROCM", chunk_tokens)
        model_config = ModelConfig(model=str(model_dir), dtype=str(dtype).split(".")[1],
                                   skip_tokenizer_init=True, max_model_len=1024, seed=0)
        cache_config = CacheConfig(block_size=BLOCK_SIZE,
                                   cache_dtype="auto" if kv_scales is None else "fp8")
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                             max_model_len=1024, is_encoder_decoder=False),
            device_config=DeviceConfig(device="cpu"),
        )
        with set_current_vllm_config(vllm_config):
            layer = Attention(NUM_HEADS, HEAD_SIZE, SCALE, num_kv_heads=NUM_KV_HEADS,
                              cache_config=cache_config, prefix=LAYER,
                              per_layer_sliding_window=sliding_window,
                              attn_backend=backend.AiterFlashAttentionBackend)
        assert isinstance(layer.impl, backend.AiterFlashAttentionImpl)
        # A layer whose model writes K/V itself and calls attention with key=None
        # (the KV-sharing route of forward).
        layer.kv_cache_update_bypass = kv_bypass
        if kv_scales is not None:  # as weight loading would set them
            layer._k_scale.fill_(kv_scales[0])
            layer._v_scale.fill_(kv_scales[1])
            layer._k_scale_float, layer._v_scale_float = kv_scales
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                 head_size=HEAD_SIZE,
                                 dtype=dtype if kv_scales is None else torch.uint8)
        builder = backend.AiterFlashAttentionMetadataBuilder(
            spec, [LAYER], vllm_config, torch.device("cpu"))
        assert builder.reorder_batch_threshold == 1
        return layer, builder

    return make


@pytest.fixture
def spies(backend, monkeypatch):
    """Count the series' kernels and the merges the Impl calls (they still run)."""
    calls = {"fetch_kv": [], "paged_context_attention": [], "merge_attn_states": []}

    def spy(name):
        real = getattr(backend, name)

        def wrapper(*args, **kwargs):
            calls[name].append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(backend, name, wrapper)

    for name in calls:
        spy(name)
    return calls


# --------------------------------------------------------------------------
# Batches, cache, reference.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    ctx: int  # tokens already in the cache
    q: int  # new tokens this step


@dataclass
class Step:
    common: object  # CommonAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    ref: torch.Tensor  # float64 [T, Hq, D]


def make_step(reqs, seed=0, window=None, dtype=torch.float32, kv_scales=None):
    """Random q/k/v, a NaN-poisoned packed cache holding each request's sequence, the reference.

    kv_scales: (k_scale, v_scale) for an fp8 (e4m3fn) cache, which is allocated
    uint8 as vLLM does; K/V are drawn on the fp8 grid times the scale, so the
    cache holds them exactly and the new tokens' unquantized K/V equal them.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    lens = [r.ctx + r.q for r in reqs]
    nblk = [math.ceil(n / BLOCK_SIZE) for n in lens]
    num_blocks = 1 + sum(nblk) + 3  # block 0 and a few free blocks stay unused
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never block 0
    # perm[0] (and two more) stay free: pop() takes from the end.
    max_blocks = max(nblk) + 1
    # Entries past a request's blocks are stale in vLLM's persistent block
    # tables: here they name a free (NaN) block, so reading one shows.
    block_table = torch.full((len(reqs), max_blocks), perm[0], dtype=torch.int32)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    if kv_scales is None:
        kv_cache = cache_view = torch.full(shape, float("nan"), dtype=dtype)
    else:
        fp8 = torch.float8_e4m3fn
        kv_cache = torch.full(shape, 0x7F, dtype=torch.uint8)  # 0x7F: e4m3fn NaN
        cache_view = kv_cache.view(fp8)
        assert torch.isnan(cache_view.float()).all()
    queries, keys, values, refs, slots = [], [], [], [], []
    for i, (r, n) in enumerate(zip(reqs, lens)):
        ids = [perm.pop() for _ in range(nblk[i])]
        block_table[i, : nblk[i]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=g)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=g)
        q = torch.randn(r.q, NUM_HEADS, HEAD_SIZE, generator=g).to(dtype)
        if kv_scales is None:
            k, v = k.to(dtype), v.to(dtype)
            k_store, v_store = k, v
        else:
            k_store, v_store = (k / kv_scales[0]).to(fp8), (v / kv_scales[1]).to(fp8)
            k = (k_store.float() * kv_scales[0]).to(dtype)
            v = (v_store.float() * kv_scales[1]).to(dtype)
        pos = torch.arange(n)
        blk = torch.tensor(ids)[pos // BLOCK_SIZE]
        # What do_kv_cache_update leaves: context and new tokens in the cache.
        cache_view[blk, :, pos % BLOCK_SIZE, :HEAD_SIZE] = k_store
        cache_view[blk, :, pos % BLOCK_SIZE, HEAD_SIZE:] = v_store
        slots.append(blk[r.ctx:] * BLOCK_SIZE + pos[r.ctx:] % BLOCK_SIZE)
        queries.append(q)
        keys.append(k[r.ctx:])
        values.append(v[r.ctx:])
        refs.append(_attend(q, k, v, SCALE, True, -1 if window is None else window - 1)[0])
    q_lens = torch.tensor([r.q for r in reqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_reqs=len(reqs),
        num_actual_tokens=int(q_lens.sum()),
        max_query_len=int(q_lens.max()),
        max_seq_len=max(lens),
        block_table_tensor=block_table,
        slot_mapping=torch.cat(slots).long(),
        causal=True,
    )
    return Step(common, torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache,
                torch.cat(refs))


def run_forward(layer, builder, step, with_kv=True):
    meta = builder.build(common_prefix_len=0, common_attn_metadata=step.common)
    output = torch.full_like(step.query, float("nan"))
    key, value = (step.key, step.value) if with_kv else (None, None)
    ret = layer.impl.forward(layer, step.query, key, value, step.kv_cache, meta, output)
    # Upstream's decode branch for windowed / multi-token decodes ends in a bare
    # `return` (None); callers use `output`.
    assert ret is output or ret is None
    return meta, output


def assert_matches_reference(output, step, token_slice=slice(None)):
    got = output[token_slice].double()
    ref = step.ref[token_slice]
    assert torch.isfinite(got).all(), "NaN/inf in the output (an unmasked cache read?)"
    err = (got - ref).abs()
    tol = TOL[output.dtype] * (1 + ref.abs())
    worst = int(torch.argmax((err - tol).flatten()))
    assert (err <= tol).all(), (
        f"max |err| {err.max().item():.3e}; worst at token/head/dim "
        f"{tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))}")


# Three extends, ragged contexts (none a multiple of 16), 12 new tokens.
EXTENDS = [Req(ctx=37, q=3), Req(ctx=50, q=5), Req(ctx=21, q=4)]


# --------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("paged_max_tokens", [None, 12], ids=["default", "at-threshold"])
def test_paged_route_short_extends(make_backend, spies, fake_aiter, paged_max_tokens):
    """0250: few new tokens (12, default threshold 256) -> paged context, one merge."""
    layer, builder = make_backend(paged_max_tokens=paged_max_tokens)
    assert builder.paged_context_max_tokens == (paged_max_tokens or 256)
    step = make_step(EXTENDS, seed=1)
    meta, output = run_forward(layer, builder, step)

    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == (0, 3, 0)
    ext = meta.extend_metadata
    assert ext.paged_context and ext.chunk_context_metadata.num_chunks == 0
    assert ext.max_context_len == 50
    assert ext.seq_lens.tolist() == [40, 55, 25]
    assert len(spies["paged_context_attention"]) == 1 and not spies["fetch_kv"]
    assert len(spies["merge_attn_states"]) == 1
    # Only the new tokens' causal varlen call.
    assert [c["causal"] for c in fake_aiter.varlen_calls] == [True]
    assert_matches_reference(output, step)


@pytest.mark.parametrize("paged_max_tokens", [0, 11], ids=["flag-off", "over-threshold"])
def test_gather_route_one_chunk(make_backend, spies, fake_aiter, paged_max_tokens):
    """0200: the gather route (flag 0, or more new tokens than the threshold)."""
    layer, builder = make_backend(paged_max_tokens=paged_max_tokens)
    step = make_step(EXTENDS, seed=2)
    meta, output = run_forward(layer, builder, step)

    ext = meta.extend_metadata
    assert not ext.paged_context and ext.chunk_context_metadata.num_chunks == 1
    assert len(spies["fetch_kv"]) == 1 and not spies["paged_context_attention"]
    assert spies["fetch_kv"][0]["max_num_tokens"] == 37 + 50 + 21
    assert len(spies["merge_attn_states"]) == 1
    assert [c["causal"] for c in fake_aiter.varlen_calls] == [True, False]
    assert fake_aiter.varlen_calls[1]["k_lens"] == [37, 50, 21]
    assert_matches_reference(output, step)


def test_gather_route_many_chunks_reuses_merge_buffers(make_backend, spies, fake_aiter):
    """0200 over >= 3 context chunks: merges alternate between two buffers.

    A 48-token workspace gives each of the 3 extends 16 context tokens per chunk:
    contexts 37 / 50 / 21 take 4 chunks; request 3 has no context in chunks 3-4,
    request 1 none in chunk 4 (empty rows: out 0, lse -inf).
    """
    layer, builder = make_backend(paged_max_tokens=0, chunk_tokens=48)
    assert builder.extend_workspace.shape[1] == 48
    step = make_step(EXTENDS, seed=3)
    meta, output = run_forward(layer, builder, step)

    chunks = meta.extend_metadata.chunk_context_metadata
    assert chunks.num_chunks == 4
    assert chunks.total_token_per_batch == [48, 37, 21, 2]
    assert chunks.max_seq_lens == [16, 16, 16, 2]
    assert len(spies["fetch_kv"]) == 4
    ctx_calls = [c for c in fake_aiter.varlen_calls if not c["causal"]]
    assert [c["k_lens"] for c in ctx_calls] == [[16, 16, 16], [16, 16, 5], [5, 16, 0],
                                                [0, 2, 0]]
    merges = spies["merge_attn_states"]
    assert len(merges) == 4  # 3 chunk merges + the final one with the new tokens
    chunk_merges = merges[:-1]
    for m in chunk_merges:  # never merges in place
        dst = m["output"].data_ptr()
        assert dst not in (m["prefix_output"].data_ptr(), m["suffix_output"].data_ptr())
        assert m["output_lse"].data_ptr() not in (m["prefix_lse"].data_ptr(),
                                                  m["suffix_lse"].data_ptr())
    # Each merge reads what the previous one wrote, and writes into the buffer
    # the one before it read from (at most two buffers besides the outputs).
    for prev, cur in itertools.pairwise(chunk_merges):
        assert cur["prefix_output"].data_ptr() == prev["output"].data_ptr()
        assert cur["prefix_lse"].data_ptr() == prev["output_lse"].data_ptr()
        assert cur["output"].data_ptr() == prev["prefix_output"].data_ptr()
    assert len({m["output"].data_ptr() for m in chunk_merges}) == 2
    assert merges[-1]["prefix_output"].data_ptr() == chunk_merges[-1]["output"].data_ptr()
    assert_matches_reference(output, step)


MIXED = [
    Req(ctx=29, q=1), Req(ctx=40, q=1),  # decodes
    Req(ctx=37, q=6), Req(ctx=19, q=3),  # extends
    Req(ctx=0, q=9), Req(ctx=0, q=5),  # prefills
]


@pytest.mark.parametrize("dtype, kv_scales", [
    (torch.float32, None),
    (torch.float16, None),
    (torch.float16, (0.25, 0.5)),
], ids=["fp32", "fp16", "fp16-fp8kv"])
@pytest.mark.parametrize("route", ["paged", "gather-3-chunks"])
def test_decode_extend_prefill_batch(make_backend, spies, fake_aiter, route, dtype, kv_scales):
    """A whole step, decode -> extend -> prefill: every token matches dense attention.

    fp8 cache: the context is dequantised by fetch_kv into the workspace or
    inside paged_context_attention, with the layer's k/v scales.
    """
    kw = {"dtype": dtype, "kv_scales": kv_scales}
    if route == "paged":
        layer, builder = make_backend(**kw)
    else:  # 2 extends, 16-token workspace: 8 context tokens each per chunk
        layer, builder = make_backend(paged_max_tokens=0, chunk_tokens=16, **kw)
    step = make_step(MIXED, seed=4, **kw)
    meta, output = run_forward(layer, builder, step)

    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == (2, 2, 2)
    assert (meta.num_decode_tokens, meta.num_extend_tokens) == (2, 9)
    ext = meta.extend_metadata
    if route == "paged":
        assert ext.paged_context and len(spies["paged_context_attention"]) == 1
        assert not spies["fetch_kv"]
    else:
        assert not ext.paged_context and not spies["paged_context_attention"]
        assert ext.chunk_context_metadata.num_chunks == 5  # ceil(37 / 8)
        assert len(spies["fetch_kv"]) == 5
    assert_matches_reference(output, step, slice(2, 11))  # the extends' tokens
    assert_matches_reference(output, step)  # decodes and prefills too


def test_kv_sharing_layer_fetches_new_tokens(make_backend, spies, fake_aiter):
    """0200's third fetch_kv: key=None, the new tokens' K/V are fetched from the cache."""
    layer, builder = make_backend(kv_bypass=True)
    assert builder.kv_sharing_workspace is not None
    step = make_step(MIXED, seed=5)
    meta, output = run_forward(layer, builder, step, with_kv=False)

    assert meta.extend_metadata.paged_context
    assert len(spies["fetch_kv"]) == 1 and len(spies["paged_context_attention"]) == 1
    assert_matches_reference(output, step)


def test_sliding_window_extend(make_backend, spies, fake_aiter):
    """0200's sliding-window gather (window 24): extends, decodes and prefills.

    A sliding window keeps the gather route (no paged context) whatever the flag.
    """
    layer, builder = make_backend(sliding_window=24)
    assert builder.aot_sliding_window == (23, 0) and builder.paged_context_max_tokens == 0
    step = make_step(MIXED, seed=6, window=24)
    meta, output = run_forward(layer, builder, step)

    assert not meta.extend_metadata.paged_context
    assert len(spies["fetch_kv"]) == 1 and not spies["paged_context_attention"]
    assert spies["fetch_kv"][0]["kv_cache_layout"] == "NHD"
    swa_calls = [c for c in fake_aiter.varlen_calls if c["window"] == 23]
    assert [c["k_lens"] for c in swa_calls if c["q_lens"] == [6, 3]] == [[30, 22]]
    assert_matches_reference(output, step)
