"""Upstream's ``unified_attention`` as benchmarks/upstream_kernels.py loads it from
the pinned tree, called as bench_paged_context's ``upstream_unified`` calls it
(the ``triton_attn`` backend's arguments for a batch of extends).

CPU tier (interpreter, fp32/fp16, tiny shapes).  Each request's logical
context and new-token K/V are written into a packed ``(blocks, Hkv, 16, 2D)``
cache through a permuted block table (every other slot NaN); the output is
compared with a float64 reference computed from the logical K/V and with
``paged_context_attention`` (context from the cache, new tokens passed
separately).  Both launch paths are covered: extends of more than 8 tokens
run the 2D kernel; shorter ones the split-K (3D) kernel and its reduce, which
write the backend's scratch.  The suite's own ``make_step`` is run too, on the
CPU with small heads, so its agreement check covers ``upstream_unified``.
Skipped when the pinned tree (build/vllm, ``make apply``) is not there.
"""

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
import torch

from vllm.v1.attention.ops.triton_paged_context_attention import paged_context_attention

REPO = Path(__file__).resolve().parents[2]


def _load_upstream_kernels():
    spec = importlib.util.spec_from_file_location(
        "_series_upstream_kernels", REPO / "benchmarks" / "upstream_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


upstream_kernels = _load_upstream_kernels()


@pytest.fixture(scope="module")
def unified():
    try:
        return upstream_kernels.load_unified_attention()
    except upstream_kernels.UpstreamUnavailable as exc:
        pytest.skip(f"no pinned tree: {exc}")


def build(context_lens, query_lens, dtype, device, hkv=2, group=4, d=64, bs=16, seed=0):
    """Logical K/V per request, the packed cache holding context + new tokens, queries."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    pages = [-(-s // bs) for s in seq_lens]
    num_blocks = 1 + sum(pages) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    cache = torch.full((num_blocks, hkv, bs, 2 * d), float("nan"), dtype=dtype)
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)
    keys, values = [], []
    for r, s in enumerate(seq_lens):
        table[r, :pages[r]] = torch.tensor(ids[:pages[r]], dtype=torch.int32)
        ids = ids[pages[r]:]
        k = torch.randn(s, hkv, d, generator=gen).to(dtype)
        v = torch.randn(s, hkv, d, generator=gen).to(dtype)
        pos = torch.arange(s)
        key_cache[table[r, pos // bs].long(), pos % bs] = k
        value_cache[table[r, pos // bs].long(), pos % bs] = v
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(query_lens), hkv * group, d, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q.to(device), cache=cache.to(device), table=table.to(device),
                cu_q=cu_q.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
                keys=keys, values=values, context_lens=context_lens, query_lens=query_lens,
                hkv=hkv, d=d)


def reference(b, scale):
    """float64 causal attention of each request's new tokens over its logical K/V."""
    group = b["q"].shape[1] // b["hkv"]
    outs = []
    for r, (c, n) in enumerate(zip(b["context_lens"], b["query_lens"], strict=True)):
        q = b["q"][int(b["cu_q"][r]):int(b["cu_q"][r + 1])].cpu().double()
        k = b["keys"][r].double().repeat_interleave(group, 1)
        v = b["values"][r].double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,mhd->hnm", q, k) * scale
        keep = torch.arange(c + n)[None] <= (torch.arange(n) + c)[:, None]
        s = s.masked_fill(~keep, -math.inf)
        outs.append(torch.einsum("hnm,mhd->nhd", s.softmax(-1), v))
    return torch.cat(outs)


def call_as_triton_attn(unified, b, out, split_k):
    """TritonAttentionImpl.forward's call (unquantized cache), as in the suite."""
    key_cache, value_cache = b["cache"].transpose(1, 2).split(b["d"], dim=-1)
    reqs = len(b["query_lens"])
    descale = torch.ones(1, dtype=torch.float32, device=out.device).expand(reqs, b["hkv"])
    unified(q=b["q"], k=key_cache, v=value_cache, out=out, cu_seqlens_q=b["cu_q"],
            max_seqlen_q=max(b["query_lens"]), seqused_k=b["seq_lens"],
            max_seqlen_k=int(b["seq_lens"].max()), softmax_scale=b["d"] ** -0.5, causal=True,
            window_size=(-1, -1), block_table=b["table"], softcap=0, q_descale=None,
            k_descale=descale, v_descale=descale, **split_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_lens,split_k_path", [([12, 9, 20], False), ([3, 8, 5], True)],
                         ids=["2d", "3d"])
def test_unified_attention_matches_reference_and_paged_context(unified, device, dtype,
                                                               query_lens, split_k_path):
    context_lens = [20, 37, 16]
    b = build(context_lens, query_lens, dtype, device)
    nq = b["q"].shape[1]
    split_k = upstream_kernels.triton_attn_split_k_args(nq, b["hkv"], b["d"], device)
    assert split_k["seq_threshold_3D"] == 128 // b["hkv"]  # MIN_LAUNCH_GRID_SIZE_2D // Hkv
    for name in ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum"):
        split_k[name].fill_(float("nan"))
    out = torch.full_like(b["q"], float("nan"))
    call_as_triton_attn(unified, b, out, split_k)

    ref = reference(b, b["d"] ** -0.5)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    # The 3D path writes the scratch; the 2D path never touches it.
    assert (not split_k["softmax_segm_max"].isnan().all()) == split_k_path

    # paged_context_attention: context from the cache, new tokens given apart.
    key_cache, value_cache = b["cache"].transpose(1, 2).split(b["d"], dim=-1)
    new_k = torch.cat([k[c:] for k, c in zip(b["keys"], context_lens, strict=True)]).to(device)
    new_v = torch.cat([v[c:] for v, c in zip(b["values"], context_lens, strict=True)]).to(device)
    ours, _ = paged_context_attention(b["q"], key_cache, value_cache, b["table"], b["cu_q"],
                                      b["seq_lens"], b["d"] ** -0.5, key=new_k, value=new_v)
    torch.testing.assert_close(out, ours, atol=tol, rtol=tol)


def test_loads_from_the_staged_files_and_names_a_missing_definition(unified, tmp_path,
                                                                    monkeypatch):
    """PINNED_PY (what ``upstream_kernels.py stage`` copies for a GPU machine without
    build/vllm) holds every file the loader reads; a tree missing one of the
    definitions raises UpstreamUnavailable, which names it."""
    for rel in upstream_kernels.PINNED_PY:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(upstream_kernels.pinned_tree() / rel, tmp_path / rel)
    monkeypatch.setenv("VLLM_PINNED_TREE", str(tmp_path))
    assert callable(upstream_kernels.load_unified_attention())
    assert upstream_kernels.triton_attn_split_k_args(8, 2, 64, "cpu")["num_par_softmax_segments"] == 16
    staged = tmp_path / upstream_kernels._UNIFIED
    staged.write_text(staged.read_text().replace("def reduce_segments(", "def reduce_segments_v2("))
    with pytest.raises(upstream_kernels.UpstreamUnavailable,
                       match="triton_unified_attention.py in the pinned tree has no reduce_segments"):
        upstream_kernels.load_unified_attention()


@pytest.mark.slow
def test_suite_step_checks_upstream_unified_against_the_paged_route(
        unified, device, monkeypatch, bench_pkg):
    """make_step on the CPU (fp16, 8 query / 2 kv heads): its check runs every route,
    upstream_unified included, and fails when upstream_unified is wrong."""
    bench = bench_pkg("bench_paged_context")
    if bench._UNIFIED is None:
        pytest.skip(bench._UNIFIED_MISSING)
    monkeypatch.setattr(bench, "DTYPE", torch.float16)
    monkeypatch.setattr(bench, "NUM_HEADS", 8)
    monkeypatch.setattr(bench, "NUM_KV_HEADS", 2)
    reqs, context, new = 2, 48, 16
    env = bench.make_env(max_tokens=4 * reqs * (context + new), device=device)
    impls, nbytes = bench.make_step(env, reqs, context, new)
    assert callable(impls["upstream_unified"])
    assert nbytes == bench.step_bytes(reqs, context, new)

    # A wrong call (not causal over the new tokens) is caught before any timing.
    def not_causal(**kwargs):
        unified(**{**kwargs, "causal": False})

    monkeypatch.setattr(bench, "_UNIFIED", not_causal)
    with pytest.raises(AssertionError, match="upstream_unified vs the split paged route"):
        bench.make_step(env, reqs, context, new, set_index=1)

    monkeypatch.setattr(bench, "_UNIFIED", None)  # no pinned tree: recorded unavailable
    impls, _ = bench.make_step(env, reqs, context, new, set_index=2, check=False)
    assert impls["upstream_unified"] is None
