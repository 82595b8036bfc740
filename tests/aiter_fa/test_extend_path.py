"""AITER FA's extend path, end to end on the CPU and GPU tiers, against dense attention.

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
    in the config; the overlay's Triton kernels (``TRITON_INTERPRET=1`` on the
    CPU tier, compiled on a GPU); vLLM's merge of partial attention results:
    on the CPU its torch version (``_merge_attn_states_torch``), on a GPU its
    Triton kernel (``triton_merge_attn_states``, the merge ROCm runs below
    CDNA3), compiled with the real Triton.  ``vllm.triton_utils`` hands out
    Triton placeholders whenever vLLM is not an installed package (it asks the
    package metadata for the version, and the tree runs from source), so the
    test loads that module with the real ``triton``; its CUDA op is not built;
  * faked: the ``aiter`` package (absent off ROCm), by tests/fakes/aiter_fa.py:
    ``aiter.flash_attn_varlen_func`` (over the ``mha_varlen_fwd`` /
    ``fmha_v3_varlen_fwd`` ops), ``aiter.ops.triton.unified_attention``'s
    ``unified_attention`` and the ``torch.ops.aiter.paged_attention_v1`` op,
    written from AITER's source (e4048607) and exported as AITER exports them:
    they check what AITER checks, read their inputs as the kernels do (the
    strides each kernel is given, ``min_seqlen_q``'s sequence skip, the launch
    grid's ``max_seqlen_q``) and compute in float64 torch, independent of the
    series' kernels: exact up to one rounding of their output, on the CPU or,
    on the GPU tier, in float64 on the GPU (tests/aiter_fa/test_aiter_fa_fakes.py
    pins what they refuse);
  * not run: ``do_kv_cache_update`` (needs vLLM's compiled ``_C_cache_ops``);
    the test writes the paged cache itself, as that op would.

The cache is vLLM 0.34.0's packed ``(num_blocks, H_kv, block_size, 2 * D)``;
block 0 and every block or slot no request owns hold NaN, so an unmasked read
of them shows.  Block tables are permutations of blocks 1..N, their unused
tail entries name a free (NaN) block, as stale entries would.

Tiers (tests/conftest.py): every test without the ``gpu`` marker runs on the
``device`` fixture, so on the CPU tier under the interpreter and on a GPU with
compiled kernels: GQA 4 (8 query heads, 2 kv heads), head size 32, block size
16, contexts of 21-55 tokens (not multiples of 16); fp16 (a mixed batch also
over an fp8 e4m3fn cache): AITER's varlen kernels take fp16/bf16 only, and bf16
math is wrong in the interpreter.  The ``gpu``-marked tests run the
same routes at GPU-tier sizes (skipped on the CPU tier): bf16 and fp16 queries,
GQA 8 (32 query / 4 kv heads, head size 128) and GQA 4 (32 / 8, head size 64),
block size 16, contexts of 2,000-4,100 tokens (not multiples of 16), bf16 over
an fp8 e4m3fn cache; decodes then take the ``paged_attention_v1`` op (head
size >= 64).  bf16 runs on the GPU tier only: under ``TRITON_INTERPRET=1``
(Triton 3.6) ``paged_context_attention`` returns bf16 results off by orders of
magnitude where fp16 is right, a limitation of the interpreter (the
kernel's compiled bf16 is checked in tests/kernels on the GPU).

Routes covered: 0250's paged context (default threshold, and a step at exactly
the threshold); 0200's gather (flag 0, one token over the threshold, and 4-5
context chunks through a shrunk ``_CP_TOKENS_PER_ITER_ROCM`` so the reused merge
buffers alternate); 0200's other two fetch_kv call sites (KV-sharing layer with
key=None, sliding-window extend); two batches out of order whose one-token rows
run on the prefill / extend path (0260: not skipped by ``min_seqlen_q``).
Decodes run through the ``unified_attention``
fallback (head size < 64) or, at the GPU sizes, ``paged_attention_v1``; the
SHUFFLE layout is not run here.

``AITER_FA_ERRORS=<file>`` appends each checked output's worst error (in units
of the dtype's unit roundoff and of the tolerance) to that file, one JSON object
a line, so a GPU run reports what it observed.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from aiter_export import AiterExport
from aiter_fa import install_fa_fakes


@dataclass(frozen=True)
class Shape:
    """The attention layer under test; max_model_len also bounds a step's tokens."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int = 1024

    @property
    def scale(self) -> float:
        return self.head_size**-0.5


SMALL = Shape(num_heads=8, num_kv_heads=2, head_size=32)  # both tiers
GQA8_D128 = Shape(num_heads=32, num_kv_heads=4, head_size=128, max_model_len=8192)  # GPU
GQA4_D64 = Shape(num_heads=32, num_kv_heads=8, head_size=64, max_model_len=8192)  # GPU
BLOCK_SIZE = 16
LAYER = "model.layers.0.self_attn.attn"
BACKEND = "vllm.v1.attention.backends.rocm_aiter_fa"
# Against a float64 reference, |err| <= TOL * (1 + |ref|), in units of the
# dtype's unit roundoff u.  fp16 (u = 4.9e-4): P, the partial outputs and the
# output are each rounded once to fp16: 4 u = 2e-3 (observed on the CPU
# interpreter: <= 2 u, <= 0.25 of the bound, for up to 5 chunks).
# The same cases compiled on a GPU are held to this bound (the kernels' fp32
# dots use IEEE products, not tf32).
TOL = {torch.float16: 4 * torch.finfo(torch.float16).eps / 2}
# GPU-tier sizes (bf16/fp16, thousands of context tokens), per output element:
# |err| <= (roundings * u + 256 * u32) * A + u * |ref|, where
# A = sum_j p_j |v_j| is the attention average of |V| (the reference computes
# it) and u the query dtype's unit roundoff (bf16 3.9e-3, fp16 4.9e-4).  Each
# partial result on the way, whatever its number of keys, is an average with
# weight w <= 1 in the final one and magnitude <= its own A, so rounding it to
# the dtype costs <= u * A: the new tokens' partial output (the fake's one
# rounding), the context's (paged route: P rounded for P @ V, then its output;
# gather route: each chunk's output and each running merge's result), and the
# final output costs u * |ref|.  The paged route has 3 such roundings; the
# gather route of n chunks 2n.  256 u32 covers the fp32 logits, exp and merge
# arithmetic.  fetch_kv copies exactly (fp8 * a power-of-two scale is exact in
# bf16/fp16).  A read of a slot no request owns still shows: it holds NaN.
# Observed: on the CPU interpreter with fp16 in place of bf16 and contexts of
# 39-89 tokens, <= 3.2 u and <= 0.51 of the bound; on a GPU: not run yet.
GPU_DTYPES = [
    pytest.param(torch.bfloat16, None, id="bf16"),
    pytest.param(torch.float16, None, id="fp16"),
    pytest.param(torch.bfloat16, (0.25, 0.5), id="bf16-fp8kv"),
]
U32 = 2.0**-24


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


# --------------------------------------------------------------------------
# The reference, and the fake AITER (tests/fakes/aiter_fa.py: float64 torch,
# written from AITER's source; nothing from the series).
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
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None, :]
    if causal:
        s = s.masked_fill(j > i + (m - n), float("-inf"))
    if window_left >= 0:
        s = s.masked_fill(j < i + (m - n) - window_left, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf for empty rows
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse


@pytest.fixture
def fake_aiter():
    """The FA-path AITER fakes (tests/fakes/aiter_fa.py), exported as AITER
    exports them, installed for the test; ``varlen_calls`` / ``unified_calls`` /
    ``decode_calls`` record the flash_attn_varlen_func / unified_attention /
    paged_attention_v1 calls."""
    export = AiterExport()
    fake = install_fa_fakes(export)
    with export:
        yield fake


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


def _vllm_triton_merge():
    """vLLM's Triton ``merge_attn_states``, compiled with the real Triton.

    Imported as it is, the module would take ``vllm.triton_utils``'
    placeholders (vLLM runs from source: no package metadata, so no Triton), so
    a private copy is executed with ``triton`` / ``tl`` bound to the real ones.
    """
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

        return merge_attn_states
    from vllm.v1.attention.ops import merge_attn_states as merge_mod

    name = "vllm.v1.attention.ops.triton_merge_attn_states_real_triton"
    path = Path(merge_mod.__file__).with_name("triton_merge_attn_states.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_utils, "triton", triton)
        mp.setattr(triton_utils, "tl", tl)
        spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod.merge_attn_states


@pytest.fixture(scope="module")
def backend(device):
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
    # vLLM's merge dispatches on the platform (here: neither CUDA, ROCm nor
    # CPU) to its CUDA op, its Triton kernel or its torch version: bind the
    # torch one on the CPU (no compiled Triton there) and the Triton one on a GPU.
    from vllm.v1.attention.ops import merge_attn_states as merge_mod

    if device == "cpu":
        mod.merge_attn_states = merge_mod._merge_attn_states_torch
    else:
        mod.merge_attn_states = _vllm_triton_merge()
    sys.modules[name] = mod
    yield mod
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """model_dir(shape): a local model directory holding only a config.json."""
    made = {}

    def get(shape: Shape):
        if shape not in made:
            d = tmp_path_factory.mktemp(
                f"llama_h{shape.num_heads}_kv{shape.num_kv_heads}_d{shape.head_size}")
            (d / "config.json").write_text(json.dumps({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": shape.num_heads * shape.head_size,
                "head_dim": shape.head_size,
                "num_attention_heads": shape.num_heads,
                "num_key_value_heads": shape.num_kv_heads,
                "num_hidden_layers": 1,
                "intermediate_size": 512,
                "max_position_embeddings": max(4096, shape.max_model_len),
                "vocab_size": 1024,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "float32",
            }))
            made[shape] = d
        return made[shape]

    return get


@pytest.fixture
def cpu_host_staging(device, monkeypatch):
    """build() stages host tensors in pinned memory, which CPU-only torch lacks."""
    if device != "cpu":
        return
    from vllm.utils import torch_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    zeros = torch.zeros

    def zeros_unpinned(*args, pin_memory=False, **kwargs):
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros_unpinned)


@pytest.fixture
def make_backend(backend, model_dir, fake_aiter, cpu_host_staging, device, monkeypatch):
    """Build (layer, builder, impl) with the real VllmConfig, Attention layer and builder.

    ``paged_max_tokens``: VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS (None: unset,
    the default 512); ``chunk_tokens``: the gather route's per-chunk workspace
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
             dtype=torch.float16, kv_scales=None, shape=SMALL):
        if paged_max_tokens is None:
            monkeypatch.delenv("VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS", raising=False)
        else:
            monkeypatch.setenv("VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS",
                               str(paged_max_tokens))
        if chunk_tokens is not None:
            monkeypatch.setattr(backend, "_CP_TOKENS_PER_ITER_ROCM", chunk_tokens)
        model_config = ModelConfig(model=str(model_dir(shape)), dtype=str(dtype).split(".")[1],
                                   skip_tokenizer_init=True, max_model_len=shape.max_model_len,
                                   seed=0)
        cache_config = CacheConfig(block_size=BLOCK_SIZE,
                                   cache_dtype="auto" if kv_scales is None else "fp8")
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=SchedulerConfig(max_num_seqs=16,
                                             max_num_batched_tokens=shape.max_model_len,
                                             max_model_len=shape.max_model_len,
                                             is_encoder_decoder=False),
            device_config=DeviceConfig(device=device),
        )
        with set_current_vllm_config(vllm_config):
            layer = Attention(shape.num_heads, shape.head_size, shape.scale,
                              num_kv_heads=shape.num_kv_heads,
                              cache_config=cache_config, prefix=LAYER,
                              per_layer_sliding_window=sliding_window,
                              attn_backend=backend.AiterFlashAttentionBackend)
        assert isinstance(layer.impl, backend.AiterFlashAttentionImpl)
        layer.to(device)  # its k/v scale buffers, as loading the model would
        # A layer whose model writes K/V itself and calls attention with key=None
        # (the KV-sharing route of forward).
        layer.kv_cache_update_bypass = kv_bypass
        if kv_scales is not None:  # as weight loading would set them
            layer._k_scale.fill_(kv_scales[0])
            layer._v_scale.fill_(kv_scales[1])
            layer._k_scale_float, layer._v_scale_float = kv_scales
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=shape.num_kv_heads,
                                 head_size=shape.head_size,
                                 dtype=dtype if kv_scales is None else torch.uint8)
        builder = backend.AiterFlashAttentionMetadataBuilder(
            spec, [LAYER], vllm_config, torch.device(device))
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
    absavg: torch.Tensor  # float64 [T, Hq, D]: sum_j p_j |v_j|


def make_step(reqs, device, seed=0, window=None, dtype=torch.float16, kv_scales=None,
              shape=SMALL):
    """Random q/k/v, a NaN-poisoned packed cache holding each request's sequence, the reference.

    kv_scales: (k_scale, v_scale) for an fp8 (e4m3fn) cache, which is allocated
    uint8 as vLLM does; K/V are drawn on the fp8 grid times the scale, so the
    cache holds them exactly and the new tokens' unquantized K/V equal them.
    The data is drawn on the CPU (the same numbers on every device), then the
    step lives on ``device``, where the float64 reference is computed.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    hkv, hs = shape.num_kv_heads, shape.head_size
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
    cache_shape = (num_blocks, hkv, BLOCK_SIZE, 2 * hs)
    if kv_scales is None:
        kv_cache = cache_view = torch.full(cache_shape, float("nan"), dtype=dtype)
    else:
        fp8 = torch.float8_e4m3fn
        kv_cache = torch.full(cache_shape, 0x7F, dtype=torch.uint8)  # 0x7F: e4m3fn NaN
        cache_view = kv_cache.view(fp8)
        assert torch.isnan(cache_view.float()).all()
    queries, keys, values, refs, absavgs, slots = [], [], [], [], [], []
    for i, (r, n) in enumerate(zip(reqs, lens)):
        ids = [perm.pop() for _ in range(nblk[i])]
        block_table[i, : nblk[i]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, hkv, hs, generator=g)
        v = torch.randn(n, hkv, hs, generator=g)
        q = torch.randn(r.q, shape.num_heads, hs, generator=g).to(dtype)
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
        cache_view[blk, :, pos % BLOCK_SIZE, :hs] = k_store
        cache_view[blk, :, pos % BLOCK_SIZE, hs:] = v_store
        slots.append(blk[r.ctx:] * BLOCK_SIZE + pos[r.ctx:] % BLOCK_SIZE)
        queries.append(q)
        keys.append(k[r.ctx:])
        values.append(v[r.ctx:])
        # One pass gives the output and the attention average of |V|.
        qd, kd, vd = q.to(device), k.to(device), v.to(device)
        ref = _attend(qd, kd, torch.cat([vd, vd.abs()], dim=-1), shape.scale, True,
                      -1 if window is None else window - 1)[0]
        refs.append(ref[..., :hs])
        absavgs.append(ref[..., hs:])
    q_lens = torch.tensor([r.q for r in reqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_reqs=len(reqs),
        num_actual_tokens=int(q_lens.sum()),
        max_query_len=int(q_lens.max()),
        max_seq_len=max(lens),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.cat(slots).long().to(device),
        causal=True,
    )
    return Step(common, torch.cat(queries).to(device), torch.cat(keys).to(device),
                torch.cat(values).to(device), kv_cache.to(device), torch.cat(refs),
                torch.cat(absavgs))


def run_forward(layer, builder, step, with_kv=True):
    meta = builder.build(common_prefix_len=0, common_attn_metadata=step.common)
    output = torch.full_like(step.query, float("nan"))
    key, value = (step.key, step.value) if with_kv else (None, None)
    ret = layer.impl.forward(layer, step.query, key, value, step.kv_cache, meta, output)
    # Upstream's decode branch for windowed / multi-token decodes ends in a bare
    # `return` (None); callers use `output`.
    assert ret is output or ret is None
    return meta, output


def _check(output, ref, tol):
    got = output.double()
    assert torch.isfinite(got).all(), "NaN/inf in the output (an unmasked cache read?)"
    err = (got - ref).abs()
    over = (err / tol).nan_to_num(nan=0.0)  # 0 / 0: an exact 0 (a token whose V rounds to 0)
    path = os.environ.get("AITER_FA_ERRORS")
    if path:  # what this run observed, for the TOL comments
        with open(path, "a") as f:
            f.write(json.dumps({
                "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                "device": str(output.device), "dtype": str(output.dtype).split(".")[1],
                "max_err": err.max().item(),
                "max_err_in_u": err.max().item() / unit_roundoff(output.dtype),
                "max_err_over_tol": over.max().item(),
            }) + "\n")
    worst = int(torch.argmax((err - tol).flatten()))
    assert (err <= tol).all(), (
        f"max |err| {err.max().item():.3e}, {over.max().item():.2f}x the tolerance; "
        f"worst at token/head/dim "
        f"{tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))}")


def assert_matches_reference(output, step, token_slice=slice(None)):
    ref = step.ref[token_slice]
    _check(output[token_slice], ref, TOL[output.dtype] * (1 + ref.abs()))


def assert_within_roundoff(output, step, roundings):
    """GPU-tier sizes: the bound of GPU_DTYPES' comment, ``roundings`` partial results."""
    u = unit_roundoff(output.dtype)
    _check(output, step.ref, (roundings * u + 256 * U32) * step.absavg + u * step.ref.abs())


# Three extends, ragged contexts (none a multiple of 16), 12 new tokens.
EXTENDS = [Req(ctx=37, q=3), Req(ctx=50, q=5), Req(ctx=21, q=4)]


# --------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------


def assert_single_paged_call(spies, fake_aiter, prefills=False):
    """The paged route's extends: one paged_context_attention call that takes
    the new tokens' key/value and writes the output itself -- no gather, no
    AITER varlen call for the extends' new tokens, no merge."""
    assert len(spies["paged_context_attention"]) == 1 and not spies["fetch_kv"]
    call = spies["paged_context_attention"][0]
    assert call["key"] is not None and call["value"] is not None
    assert call["out"] is not None
    assert not spies["merge_attn_states"]
    # Causal varlen calls left: the fresh prefills' only.
    assert len(fake_aiter.varlen_calls) == (1 if prefills else 0)


@pytest.mark.parametrize("paged_max_tokens", [None, 12], ids=["default", "at-threshold"])
def test_paged_route_short_extends(make_backend, spies, fake_aiter, device, paged_max_tokens):
    """0250: few new tokens (12, default threshold 512) -> one paged call, no merge."""
    layer, builder = make_backend(paged_max_tokens=paged_max_tokens)
    assert builder.paged_context_max_tokens == (paged_max_tokens or 512)
    step = make_step(EXTENDS, device, seed=1)
    meta, output = run_forward(layer, builder, step)

    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == (0, 3, 0)
    ext = meta.extend_metadata
    assert ext.paged_context and ext.chunk_context_metadata.num_chunks == 0
    assert ext.max_context_len == 50
    assert ext.seq_lens.tolist() == [40, 55, 25]
    assert_single_paged_call(spies, fake_aiter)
    assert_matches_reference(output, step)


@pytest.mark.parametrize("paged_max_tokens", [0, 11], ids=["flag-off", "over-threshold"])
def test_gather_route_one_chunk(make_backend, spies, fake_aiter, device, paged_max_tokens):
    """0200: the gather route (flag 0, or more new tokens than the threshold)."""
    layer, builder = make_backend(paged_max_tokens=paged_max_tokens)
    step = make_step(EXTENDS, device, seed=2)
    meta, output = run_forward(layer, builder, step)

    ext = meta.extend_metadata
    assert not ext.paged_context and ext.chunk_context_metadata.num_chunks == 1
    assert len(spies["fetch_kv"]) == 1 and not spies["paged_context_attention"]
    assert spies["fetch_kv"][0]["max_num_tokens"] == 37 + 50 + 21
    assert len(spies["merge_attn_states"]) == 1
    assert [c["causal"] for c in fake_aiter.varlen_calls] == [True, False]
    assert fake_aiter.varlen_calls[1]["k_lens"] == [37, 50, 21]
    assert_matches_reference(output, step)


def test_gather_route_many_chunks_reuses_merge_buffers(make_backend, spies, fake_aiter, device):
    """0200 over >= 3 context chunks: merges alternate between two buffers.

    A 48-token workspace gives each of the 3 extends 16 context tokens per chunk:
    contexts 37 / 50 / 21 take 4 chunks; request 3 has no context in chunks 3-4,
    request 1 none in chunk 4 (empty rows: out 0, lse -inf).
    """
    layer, builder = make_backend(paged_max_tokens=0, chunk_tokens=48)
    assert builder.extend_workspace.shape[1] == 48
    step = make_step(EXTENDS, device, seed=3)
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
    (torch.float16, None),
    (torch.float16, (0.25, 0.5)),
], ids=["fp16", "fp16-fp8kv"])
@pytest.mark.parametrize("route", ["paged", "gather-3-chunks"])
def test_decode_extend_prefill_batch(make_backend, spies, fake_aiter, device, route, dtype,
                                     kv_scales):
    """A whole step, decode -> extend -> prefill: every token matches dense attention.

    fp8 cache: the context is dequantised by fetch_kv into the workspace or
    inside paged_context_attention, with the layer's k/v scales.
    """
    kw = {"dtype": dtype, "kv_scales": kv_scales}
    if route == "paged":
        layer, builder = make_backend(**kw)
    else:  # 2 extends, 16-token workspace: 8 context tokens each per chunk
        layer, builder = make_backend(paged_max_tokens=0, chunk_tokens=16, **kw)
    step = make_step(MIXED, device, seed=4, **kw)
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


def test_kv_sharing_layer_fetches_new_tokens(make_backend, spies, fake_aiter, device):
    """0200's third fetch_kv: key=None, the new tokens' K/V are fetched from the cache."""
    layer, builder = make_backend(kv_bypass=True)
    assert builder.kv_sharing_workspace is not None
    step = make_step(MIXED, device, seed=5)
    meta, output = run_forward(layer, builder, step, with_kv=False)

    assert meta.extend_metadata.paged_context
    assert len(spies["fetch_kv"]) == 1 and len(spies["paged_context_attention"]) == 1
    # The gather's work plan is the step's, built by the builder for every layer.
    plan = spies["fetch_kv"][0]["plan"]
    assert plan is not None and plan is meta.kv_sharing_metadata.fetch_kv_plan
    assert plan.table is not None and plan.num_tokens == spies["fetch_kv"][0]["key_out"].shape[0]
    assert_matches_reference(output, step)


def test_sliding_window_extend(make_backend, spies, fake_aiter, device):
    """0200's sliding-window gather (window 24): extends, decodes and prefills.

    A sliding window keeps the gather route (no paged context) whatever the flag.
    """
    layer, builder = make_backend(sliding_window=24)
    assert builder.aot_sliding_window == (23, 0) and builder.paged_context_max_tokens == 0
    step = make_step(MIXED, device, seed=6, window=24)
    meta, output = run_forward(layer, builder, step)

    assert not meta.extend_metadata.paged_context
    assert len(spies["fetch_kv"]) == 1 and not spies["paged_context_attention"]
    assert spies["fetch_kv"][0]["kv_cache_layout"] == "NHD"
    swa = meta.extend_metadata.chunk_context_metadata.swa_metadata
    assert spies["fetch_kv"][0]["plan"] is swa.fetch_kv_plan is not None
    assert swa.fetch_kv_plan.num_tokens == swa.swa_total_tokens
    swa_calls = [c for c in fake_aiter.varlen_calls if c["window"] == 23]
    assert [c["k_lens"] for c in swa_calls if c["q_lens"] == [6, 3]] == [[30, 22]]
    assert_matches_reference(output, step)


# Batches out of the decode -> extend -> prefill order that the split still
# computes (batch_order.py): decode-like rows behind an extend run on the
# extend path (with context) or the prefill path (without).  AITER's varlen
# kernels skip every sequence of at most min_seqlen_q queries, so a one-token
# row there must not reach them with min_seqlen_q = 1.
OUT_OF_ORDER = {
    "prompt-1-after-extend": ([Req(ctx=37, q=6), Req(ctx=0, q=1)], (0, 1, 1)),
    "decode-after-extend": ([Req(ctx=37, q=6), Req(ctx=29, q=1)], (0, 2, 0)),
}


@pytest.mark.parametrize("route", ["paged", "gather"])
@pytest.mark.parametrize("case", list(OUT_OF_ORDER))
def test_out_of_order_one_token_rows_are_computed(make_backend, spies, fake_aiter, device,
                                                  route, case):
    """A one-token row on the extend or prefill path is attended, not skipped."""
    reqs, split = OUT_OF_ORDER[case]
    layer, builder = make_backend(**({} if route == "paged" else {"paged_max_tokens": 0}))
    step = make_step(reqs, device, seed=7)
    meta, output = run_forward(layer, builder, step)

    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == split
    assert bool(spies["paged_context_attention"]) == (route == "paged")
    assert_matches_reference(output, step)
    for call in fake_aiter.varlen_calls:  # none skips a row it was given
        assert min(call["q_lens"]) > call["min_seqlen_q"], call


# --------------------------------------------------------------------------
# GPU tier: the same routes at real sizes (bf16/fp16, GQA 8 and 4, head size
# 128 and 64, thousands of context tokens).  Skipped on the CPU tier.
# --------------------------------------------------------------------------

GPU_SHAPES = [pytest.param(GQA8_D128, id="gqa8-d128"), pytest.param(GQA4_D64, id="gqa4-d64")]
# Contexts of 2-4K tokens, none a multiple of 16.  Short: 132 new tokens in all
# (<= 512, the default threshold: paged context); long: 606 (gather).
GPU_SHORT = [Req(ctx=3001, q=37), Req(ctx=1999, q=5), Req(ctx=4093, q=90)]
GPU_LONG = [Req(ctx=3001, q=400), Req(ctx=1999, q=77), Req(ctx=4093, q=129)]
GPU_MIXED = [
    Req(ctx=2500, q=1), Req(ctx=3333, q=1),  # decodes (paged_attention_v1)
    Req(ctx=3001, q=37), Req(ctx=1999, q=90),  # extends
    Req(ctx=0, q=700), Req(ctx=0, q=301),  # prefills
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_scales", GPU_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_paged_route(make_backend, spies, fake_aiter, device, shape, dtype, kv_scales):
    """0250 at GPU sizes: 132 new tokens on 2-4K cached -> one paged call, no merge."""
    layer, builder = make_backend(shape=shape, dtype=dtype, kv_scales=kv_scales)
    step = make_step(GPU_SHORT, device, seed=11, dtype=dtype, kv_scales=kv_scales, shape=shape)
    meta, output = run_forward(layer, builder, step)

    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == (0, 3, 0)
    ext = meta.extend_metadata
    assert ext.paged_context and ext.chunk_context_metadata.num_chunks == 0
    assert ext.max_context_len == 4093
    assert_single_paged_call(spies, fake_aiter)
    assert_within_roundoff(output, step, roundings=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_scales", GPU_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("route", ["over-threshold", "flag-off", "chunks-2048"])
def test_gpu_gather_route(make_backend, spies, fake_aiter, device, route, shape, dtype,
                          kv_scales):
    """0200 at GPU sizes: the gather via fetch_kv, in one chunk or many.

    over-threshold: 606 new tokens (> 512) with the default flag; flag-off: the
    short extends with the flag 0; chunks-2048: the long extends through a
    2,048-token workspace, 682 context tokens per extend and chunk: 7 chunks,
    the last holding 1 token of one request (the multi-chunk merge loop).
    """
    reqs = GPU_SHORT if route == "flag-off" else GPU_LONG
    kw = {"paged_max_tokens": 0} if route == "flag-off" else {}
    if route == "chunks-2048":
        kw["chunk_tokens"] = 2048
    layer, builder = make_backend(shape=shape, dtype=dtype, kv_scales=kv_scales, **kw)
    step = make_step(reqs, device, seed=12, dtype=dtype, kv_scales=kv_scales, shape=shape)
    meta, output = run_forward(layer, builder, step)

    ext = meta.extend_metadata
    chunks = ext.chunk_context_metadata
    per_request = builder.extend_workspace.shape[1] // len(reqs)
    expected_chunks = math.ceil(max(r.ctx for r in reqs) / per_request)
    assert expected_chunks == (7 if route == "chunks-2048" else 1)
    assert not ext.paged_context and chunks.num_chunks == expected_chunks
    assert len(spies["fetch_kv"]) == expected_chunks and not spies["paged_context_attention"]
    assert len(spies["merge_attn_states"]) == expected_chunks
    ctx_calls = [c for c in fake_aiter.varlen_calls if not c["causal"]]
    assert len(ctx_calls) == expected_chunks
    # Every cached token is attended to exactly once, chunk by chunk.
    assert [sum(col) for col in zip(*(c["k_lens"] for c in ctx_calls), strict=True)] == [
        r.ctx for r in reqs]
    assert chunks.total_token_per_batch == [sum(c["k_lens"]) for c in ctx_calls]
    assert_within_roundoff(output, step, roundings=2 * expected_chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_scales", GPU_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("route", ["paged", "gather-3-chunks"])
def test_gpu_decode_extend_prefill_batch(make_backend, spies, fake_aiter, device, route, shape,
                                         dtype, kv_scales):
    """A whole GPU-sized step, decode -> extend -> prefill, every token against the reference.

    gather-3-chunks: 2 extends through a 2,048-token workspace, 1,024 context
    tokens each per chunk: 3 chunks for 3,001 cached tokens.
    """
    kw = {} if route == "paged" else {"paged_max_tokens": 0, "chunk_tokens": 2048}
    layer, builder = make_backend(shape=shape, dtype=dtype, kv_scales=kv_scales, **kw)
    step = make_step(GPU_MIXED, device, seed=13, dtype=dtype, kv_scales=kv_scales, shape=shape)
    meta, output = run_forward(layer, builder, step)

    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == (2, 2, 2)
    assert (meta.num_decode_tokens, meta.num_extend_tokens) == (2, 127)
    ext = meta.extend_metadata
    if route == "paged":
        assert ext.paged_context
        assert_single_paged_call(spies, fake_aiter, prefills=True)
        roundings = 3
    else:
        assert not ext.paged_context and not spies["paged_context_attention"]
        assert ext.chunk_context_metadata.num_chunks == 3 == len(spies["fetch_kv"])
        roundings = 6
    # Head size >= 64: the decodes take the paged_attention_v1 op, with the
    # cache dtype that picks its dequantisation.
    assert [c["seq_lens"] for c in fake_aiter.decode_calls] == [[2501, 3334]]
    assert fake_aiter.decode_calls[0]["kv_cache_dtype"] == ("auto" if kv_scales is None
                                                            else "fp8")
    assert_within_roundoff(output, step, roundings)


# --------------------------------------------------------------------------
# Serving: the JIT warmup covers the forward's launches; the profiling run
# reserves the paged-context workspace.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_scales", [None, (0.25, 0.5)], ids=["fp16", "fp8kv"])
def test_jit_warmup_covers_the_forward_launches(make_backend, fake_aiter, device, monkeypatch,
                                                kv_scales):
    """The builder registers its geometry with vLLM's JIT warmup; what the
    warmup compiles covers every launch of the paged route, the gather route
    (with and without plans) and the KV-sharing fetch (compile keys as Triton's
    JIT computes them, tests/kernels/compile_keys.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    import compile_keys
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.v1.attention.ops import triton_fetch_kv as fk
    from vllm.v1.attention.ops import triton_paged_context_attention as pc

    recorded = compile_keys.record(monkeypatch, (
        (fk, "_fetch_kv_kernel"), (fk, "_fetch_kv_plan_kernel"),
        (pc, "_paged_context_attention_kernel"), (pc, "_combine_splits_kernel")))
    registry = JitWarmupRegistry(None)
    kw = {"kv_scales": kv_scales}
    with registry.activate():
        routes = {
            "paged": make_backend(**kw),
            "gather": make_backend(paged_max_tokens=0, chunk_tokens=16, **kw),
            "kv-sharing": make_backend(kv_bypass=True, **kw),
        }
    assert len(registry) == 2  # the paged and the gather geometry (kv-sharing: = paged)
    registry.warmup()
    warm = set(recorded.keys)
    assert warm
    for route, (layer, builder) in routes.items():
        step = make_step(MIXED, device, seed=6, **kw)
        recorded.add_cache(step.kv_cache)
        run_forward(layer, builder, step, with_kv=route != "kv-sharing")
    new = recorded.keys - warm
    assert not new, compile_keys.explain(new, warm)


def test_profiling_run_reserves_the_paged_workspace(make_backend, fake_aiter, device):
    """The Impl's profiling branch (no metadata) takes the paged route's
    buffers at their bound from the workspace manager, so memory profiling
    counts them; after the lock a step's workspace is views of them."""
    from vllm.v1.attention.ops import triton_paged_context_attention as pc
    from vllm.v1.worker import workspace

    layer, builder = make_backend()
    workspace.init_workspace_manager(torch.device(device))
    try:
        manager = workspace.current_workspace_manager()
        q = torch.zeros(4, SMALL.num_heads, SMALL.head_size, dtype=torch.float16,
                        device=device)
        kv = torch.zeros(4, SMALL.num_kv_heads, SMALL.head_size, dtype=torch.float16,
                         device=device)
        layer.impl.forward(layer, q, kv, kv, torch.empty(0, device=device), None,
                           torch.empty_like(q))
        sizes = pc.paged_context_workspace_size(512, SMALL.num_heads, SMALL.num_kv_heads,
                                                SMALL.head_size, torch.float16, device)
        (reserved,) = manager._persistent_resources[0].values()
        assert [b.numel() for b in reserved] == list(sizes)
        workspace.lock_workspace()
        step = make_step(EXTENDS, device, seed=1)
        meta, output = run_forward(layer, builder, step)
        ws = meta.extend_metadata.paged_workspace
        assert ws.lse.untyped_storage().data_ptr() == reserved[0].untyped_storage().data_ptr()
        assert_matches_reference(output, step)
    finally:
        workspace.reset_workspace_manager()
