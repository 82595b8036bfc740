"""fetch_kv vs upstream cp_mha_gather_cache vs a same-bytes copy (GPU).

Each case gathers the cached context of 4 ragged requests (non-zero,
unaligned starts; lengths not multiples of the block size) from a cache of
randomly permuted blocks into a dense ``[tokens, H_kv, D]`` workspace, the job
AITER FA's extend path does per 32K-token chunk.

  ours      vllm/v1/attention/ops/triton_fetch_kv.fetch_kv with a
            fetch_kv_plan built once outside the timed region: what AITER FA's
            extend path runs per layer (its metadata builder builds the plan
            once per step for all layers; the builder's own cost is the
            ``fetch_kv_plan`` kernel below)
  ours_noplan the same call without a plan (each program looks up its
            request and pages itself): the standalone API
  baseline  upstream vLLM 0.34.0 ``cp_mha_gather_cache`` (one program per
            (token, head)), loaded at run time from the pinned tree by
            benchmarks/upstream_kernels.py; its token_to_batch map is built
            outside the timed region, as upstream's metadata builder does
  copy      added by the harness

``nbytes`` = K+V bytes read from the cache + K+V bytes written, for the
fetched tokens only.  Times are CUDA-graph replays (``graph=True``): kernel
time without host launch overhead, cold: the graph rotates over buffer sets
(disjoint blocks of one cache pool, their own outputs and plans) holding 4x
the L2 (benchmarks/timing.py), and every impl, the copy included, gets the
same rotation; ``results_warm`` is set 0 alone.  ``FETCH_KV_BENCH_TILE_BYTES=4096,16384``
adds ``ours_tile<N>k`` variants (no plan) run with another ``_TILE_BYTES``
(tuning).

``test_fetch_kv_plan`` (kernel ``fetch_kv_plan``) times the plan builder itself
(graph replays), its per-step cost: ``ours`` builds the plan into a persistent
buffer; it has no upstream counterpart (no baseline), and ``nbytes`` counts the
metadata it reads and the plan it writes; it is timed without a copy
(``copy_ceiling=False``: a copy of those few bytes bounds nothing).

Run: PYTHONPATH=vllm_overlay:tests/without_vllm:. VLLM_PINNED_TREE=<vllm 0.34.0 tree> \
     python -m pytest -q benchmarks/bench_fetch_kv.py --benchmark-json=out.json
"""

import os

import pytest
import torch
import vllm.v1.attention.ops.triton_fetch_kv as _fetch_kv_mod
from vllm.v1.attention.ops.triton_fetch_kv import fetch_kv, fetch_kv_plan

from benchmarks.upstream_kernels import UpstreamUnavailable, load_cp_mha_gather_cache

pytestmark = pytest.mark.gpu

# What "baseline" is in this suite (recorded with every case by kernel_bench).
BASELINE = (
    'upstream cp_mha_gather_cache (vLLM 0.34.0 rocm_aiter_fa.py, loaded at run time from the pinned tree)'
)

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
# Share of the chunk each request gets, and where its fetch starts.
REQ_SHARES = (0.1, 0.2, 0.3, 0.4)
REQ_STARTS = (0, 100, 37, 4099)
# Physical blocks the cache holds beyond those referenced, so the referenced
# ones are scattered like in a real pool.
SPARE_BLOCKS = 8192
_DEVICE = "cuda"  # the CPU smoke check of this file swaps it

try:
    _UPSTREAM = load_cp_mha_gather_cache()
    _UPSTREAM_MISSING = ""
except UpstreamUnavailable as exc:
    _UPSTREAM = None
    _UPSTREAM_MISSING = f"baseline skipped: {exc}"


def _cases():
    cases = []
    for tokens in (4096, 32768):
        for h in (1, 4, 8):
            for bs in (16, 32):
                cases.append(("NHD", BF16, BF16, h, 128, bs, tokens))
    for d in (64, 256):
        cases.append(("NHD", BF16, BF16, 8, d, 16, 32768))
    for h in (1, 4, 8):
        cases.append(("NHD", FP8, BF16, h, 128, 16, 32768))
    cases.append(("NHD", FP8, BF16, 8, 128, 16, 4096))
    for h in (1, 8):
        cases.append(("SHUFFLE", BF16, BF16, h, 128, 16, 32768))
    cases.append(("SHUFFLE", FP8, BF16, 8, 128, 16, 32768))
    return cases


def _name(layout, cache_dtype, out_dtype, h, d, bs, tokens):
    dt = "bf16" if cache_dtype == out_dtype else "fp8_to_bf16"
    return f"{layout.lower()}_{dt}_h{h}_d{d}_b{bs}_{tokens // 1024}k"


def _nbytes(layout, cache_dtype, out_dtype, h, d, bs, tokens):
    """K+V bytes read from the cache + K+V bytes written, for the fetched tokens."""
    return tokens * h * d * 2 * (cache_dtype.itemsize + out_dtype.itemsize)


def _setup_sets(layout, cache_dtype, out_dtype, h, d, bs, tokens, sets=1, shapes=None,
                buffers=None):
    """``sets`` buffer sets of one case: one cache pool (randomly permuted blocks,
    ``SPARE_BLOCKS`` never referenced), each set with its own disjoint blocks,
    block table, plan and outputs.  Returns one impls dict per set; fills
    ``shapes`` (when given) with the case's shapes and appends each set's
    tensors to ``buffers`` (when given; for checks)."""
    gen = torch.Generator().manual_seed(0)
    lens = [int(tokens * s) for s in REQ_SHARES]
    lens[-1] = tokens - sum(lens[:-1])
    lens = [n - 3 if i % 2 else n + 3 for i, n in enumerate(lens)]  # not multiples of bs
    pages = [-(-(s + n) // bs) for s, n in zip(REQ_STARTS, lens)]
    per_set = sum(pages)
    num_blocks = 1 + sets * per_set + SPARE_BLOCKS
    perm = (torch.randperm(num_blocks - 1, generator=gen)[: sets * per_set] + 1).to(torch.int32)
    dev = _DEVICE
    if layout == "NHD":  # vLLM 0.34.0's packed cache, viewed as K / V
        raw = torch.empty(num_blocks, h, bs, 2 * d, dtype=cache_dtype, device=dev)
        key_cache, value_cache = raw.transpose(1, 2).split(d, dim=-1)
    else:  # shuffle: (blocks, 2, bs, H * D) unflattened and unbound, as the backend does
        raw = torch.empty(num_blocks, 2, bs, h * d, dtype=cache_dtype, device=dev)
        key_cache, value_cache = raw.unflatten(-1, (h, d)).unbind(1)
    raw.view(torch.uint8).random_(0, 0x7F)  # bytes < 0x7f: finite in every dtype
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(dev)
    seq_starts = torch.tensor(REQ_STARTS, dtype=torch.int32, device=dev)
    token_to_batch = torch.repeat_interleave(
        torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens)).to(dev)
    k_scale = torch.tensor([0.5], device=dev)
    v_scale = torch.tensor([2.0], device=dev)
    dequant = cache_dtype != out_dtype
    scales = {"k_scale": k_scale, "v_scale": v_scale} if dequant else {}
    tiles = [int(t) for t in os.environ.get("FETCH_KV_BENCH_TILE_BYTES", "").split(",") if t]

    impl_sets = []
    for index in range(sets):
        table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
        used = index * per_set
        for b, n in enumerate(pages):
            table[b, :n] = perm[used : used + n]
            used += n
        table = table.to(dev)
        key_out = torch.empty(tokens, h, d, dtype=out_dtype, device=dev)
        value_out = torch.empty_like(key_out)
        if buffers is not None:
            buffers.append({"table": table, "key_out": key_out, "value_out": value_out,
                            "key_cache": key_cache, "value_cache": value_cache,
                            "seq_starts": seq_starts, "cu_seqlens": cu})

        def ours_noplan(table=table, key_out=key_out, value_out=value_out):
            fetch_kv(key_cache, value_cache, key_out, value_out, table, cu, seq_starts,
                     kv_cache_layout=layout, **scales)

        plan = fetch_kv_plan(table, cu, seq_starts, num_tokens=tokens, block_size=bs,
                             head_size=d, cache_dtype=cache_dtype, out_dtype=out_dtype,
                             kv_cache_layout=layout)

        def ours(table=table, key_out=key_out, value_out=value_out, plan=plan):
            fetch_kv(key_cache, value_cache, key_out, value_out, table, cu, seq_starts,
                     kv_cache_layout=layout, max_num_tokens=tokens, plan=plan, **scales)

        impls = {"ours": ours, "baseline": None, "ours_noplan": ours_noplan}
        for tile in tiles:
            def variant(tile=tile, noplan=ours_noplan):
                saved, _fetch_kv_mod._TILE_BYTES = _fetch_kv_mod._TILE_BYTES, tile
                try:
                    noplan()
                finally:
                    _fetch_kv_mod._TILE_BYTES = saved
            impls[f"ours_tile{tile // 1024}k"] = variant

        if _UPSTREAM is not None:
            def baseline(table=table, key_out=key_out, value_out=value_out):
                _UPSTREAM(key_cache, value_cache, key_out, value_out, table, k_scale, v_scale,
                          cu, token_to_batch, seq_starts, dequant, layout, tokens)
            impls["baseline"] = baseline
        impl_sets.append(impls)

    if shapes is not None:
        shapes.update({
            "layout": layout, "cache_dtype": str(cache_dtype), "out_dtype": str(out_dtype),
            "num_kv_heads": h, "head_size": d, "block_size": bs, "tokens": tokens,
            "req_lens": lens, "seq_starts": list(REQ_STARTS), "num_blocks": num_blocks,
            "pages_per_program": plan.pages_per_program,
        })
    return impl_sets


def _setup(layout, cache_dtype, out_dtype, h, d, bs, tokens):
    """One buffer set: (ours, baseline, variants, nbytes, shapes)."""
    shapes: dict = {}
    impls = _setup_sets(layout, cache_dtype, out_dtype, h, d, bs, tokens, shapes=shapes)[0]
    ours, baseline = impls.pop("ours"), impls.pop("baseline")
    nbytes = _nbytes(layout, cache_dtype, out_dtype, h, d, bs, tokens)
    return ours, baseline, impls, nbytes, shapes


@pytest.mark.parametrize("case", _cases(), ids=lambda c: _name(*c))
def test_fetch_kv(kernel_bench, case):
    shapes: dict = {}
    kernel_bench(kernel="fetch_kv", case=_name(*case), shapes=shapes, nbytes=_nbytes(*case),
                 buffer_sets=lambda sets: _setup_sets(*case, sets=sets, shapes=shapes),
                 graph=True, notes=_UPSTREAM_MISSING)


# The plan builder: (num_reqs, block_size, tokens); bf16 NHD, D 128.
PLAN_CASES = [(4, 16, 32768), (4, 32, 32768), (64, 16, 32768), (256, 16, 32768),
              (4, 16, 4096)]


@pytest.mark.parametrize("case", PLAN_CASES,
                         ids=lambda c: f"reqs{c[0]}_b{c[1]}_{c[2] // 1024}k")
def test_fetch_kv_plan(kernel_bench, case):
    num_reqs, bs, tokens = case
    gen = torch.Generator().manual_seed(0)
    cuts = torch.randperm(tokens - 1, generator=gen)[: num_reqs - 1].sort().values + 1
    lens = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]))
    starts = torch.randint(0, 4096, (num_reqs,), generator=gen)
    max_pages = int(((starts + lens + bs - 1) // bs).max())
    table = torch.randint(1, 1 << 20, (num_reqs, max_pages), generator=gen, dtype=torch.int32)
    table, starts = table.to(_DEVICE), starts.to(torch.int32).to(_DEVICE)
    cu = torch.cat([torch.tensor([0]), lens.cumsum(0)]).to(torch.int32).to(_DEVICE)
    kwargs = {"num_tokens": tokens, "block_size": bs, "head_size": 128, "cache_dtype": BF16}
    plan = fetch_kv_plan(table, cu, starts, **kwargs)
    buffer = plan.table

    def ours():
        fetch_kv_plan(table, cu, starts, out=buffer, **kwargs)

    pages = int(((starts + lens.to(_DEVICE) + bs - 1) // bs - starts // bs).sum())
    nbytes = buffer.numel() * 4 + pages * 4 + (2 * num_reqs + 1) * 4
    shapes = {"num_reqs": num_reqs, "block_size": bs, "tokens": tokens, "head_size": 128,
              "dtype": "bf16", "layout": "NHD", "num_items": plan.num_items,
              "plan_width": buffer.shape[1], "pages_per_program": plan.pages_per_program}
    kernel_bench(kernel="fetch_kv_plan", case=f"reqs{num_reqs}_b{bs}_{tokens // 1024}k",
                 shapes=shapes, nbytes=nbytes, impls={"ours": ours, "baseline": None},
                 graph=True, copy_ceiling=False, notes="no upstream counterpart: upstream builds token_to_batch "
                 "on the host")
