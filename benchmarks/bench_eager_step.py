# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Eager steps: one step's attention calls over every layer, host time included.

In vLLM the attention custom op runs eagerly, once per layer, between the
pieces of a piecewise CUDA graph for every prefill, extend and mixed step, so
each call's host time is paid 48-61 times a step whenever the GPU is not
busier.  Each case runs the calls the patched backend issues for one step over
all layers of a model, launched eagerly, and the calls upstream vLLM 0.34.0
issues for the same step, on the same buffers (``eager_ops.py`` says exactly
which calls, and what stands in for AITER and for vLLM's compiled ops on a
CUDA machine):

  * ``eager_step_fa``: a Qwen3-30B-A3B-like AITER FA model (48 layers, 32
    query / 4 kv heads, D 128, bf16, block 16): extends of ``R`` requests x
    ``N`` new tokens on ``C`` cached tokens each -- the paged route for <= 512
    new tokens in all, the gather route (fetch_kv with per-step plans) above;
  * ``eager_step_mla``: a DeepSeek-V3-like MLA model (61 layers, 128 heads, L
    512, R 64, bf16 cache, block 64): decode-only steps and mixed steps
    (decodes + one prefill chunk): RoPE + cache write (+ decode query).

Per case and side: ``us`` is the eager wall clock of one step (synchronised
once at its end; median of several steps), ``*_gpu`` the same step captured
whole in one CUDA graph and replayed (GPU time without host gaps).  A side is
host-bound when its wall clock exceeds its GPU time by more than 20%.
``speedup`` = upstream wall / ours wall; ``gpu_speedup`` likewise for GPU time.

Run: ``PYTHONPATH=vllm_overlay:tests/without_vllm:. python3 -m pytest -q -s benchmarks/bench_eager_step.py``
(``make bench`` runs it with the other suites).  Upstream's Triton kernels are
exec'd from the pinned tree, its CUDA ops built from the pinned csrc
(``VLLM_PINNED_TREE``, default ``build/vllm``).
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from benchmarks import eager_ops, graphs  # noqa: E402

pytestmark = pytest.mark.gpu

BASELINE = (
    "upstream 0.34.0's calls for the same step on the same buffers: AITER FA = varlen over "
    "the new tokens + cp_mha_gather_cache + varlen over the context + merge_attn_states "
    "(FlashAttention-2 standing in for AITER's varlen, in both); MLA = RoPE inside the "
    "CUDA-graph piece + the cache write (CUDA stand-in for concat_and_cache_mla) + the "
    "decode query cat; the MLA custom ops of both sides through the dispatcher, "
    "positionally"
)

FA_CASES = [  # (requests, cached tokens each, new tokens each)
    (1, 8192, 128), (1, 8192, 512), (4, 8192, 128),
    (1, 32768, 128), (1, 32768, 512), (4, 32768, 128),
    (1, 32768, 8192),  # a long chunk: the gather route on both sides
]
MLA_CASES = [  # (decode tokens, prefill chunk tokens)
    (1, 0), (16, 0), (64, 0), (16, 512), (16, 2048),
]
HOST_BOUND = 1.2  # wall / GPU time above this: host-bound
WARMUP_STEPS = 2


def _reps(gpu_us_hint: float) -> int:
    return 3 if gpu_us_hint > 100_000 else 15


def wall_us(steps, reps: int) -> list[float]:
    """Median eager wall clock of one step of each of ``steps``, synchronised
    once at its end; rounds interleaved across the steps, so a host that slows
    down during the run slows them alike."""
    for step in steps:
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        for step, samples in zip(steps, times):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
    return [graphs.median(t) * 1e6 for t in times]


def gpu_us(step, reps: int) -> float:
    """Median replay time of the whole step captured in one CUDA graph."""
    graph = graphs.capture(step)
    us = graphs.replay_us(graph, reps)
    del graph
    return us


def _record(benchmark, request, kernel, case, shapes, nbytes, timings, notes, synced):
    ours, up, ours_gpu, up_gpu = timings
    results = {"ours": {"us": round(ours, 1)}, "baseline": {"us": round(up, 1)},
               "ours_gpu": {"us": round(ours_gpu, 1)}, "baseline_gpu": {"us": round(up_gpu, 1)}}
    extra = {
        "kernel": kernel, "case": case, "shapes": shapes, "nbytes": nbytes, "graph": False,
        "results": results, "speedup": round(up / ours, 3),
        "gpu_speedup": round(up_gpu / ours_gpu, 3), "frac_copy": None, "copy_ceiling": False,
        "ours_bound": "host" if ours > HOST_BOUND * ours_gpu else "GPU",
        "baseline_bound": "host" if up > HOST_BOUND * up_gpu else "GPU",
        "baseline_desc": BASELINE, "notes": notes,
    }
    benchmark.extra_info.update(extra)
    benchmark.group = kernel
    benchmark.pedantic(synced, rounds=1, iterations=1)
    print(f"\n[bench] {kernel}/{case}: ours={ours:.0f}us ({extra['ours_bound']}-bound, gpu "
          f"{ours_gpu:.0f}us) upstream={up:.0f}us ({extra['baseline_bound']}-bound, gpu "
          f"{up_gpu:.0f}us) speedup={extra['speedup']} gpu_speedup={extra['gpu_speedup']}",
          flush=True)


@pytest.fixture(scope="module")
def env():
    if not torch.cuda.is_available():
        pytest.skip("eager-step benchmarks need a GPU")
    ops = eager_ops.upstream_ops()
    if ops.gather is None or ops.merge is None:
        pytest.skip(f"upstream kernels unavailable: {ops.notes}")
    return {"ops": ops}


@pytest.fixture(scope="module")
def fa_caches(env):
    max_tokens = max(r * (c + n) for r, c, n in FA_CASES)
    caches = eager_ops.fa_caches(eager_ops.QWEN3_30B, max_tokens)
    yield caches
    del caches[:]
    torch.cuda.empty_cache()


@pytest.mark.parametrize("reqs,context,new", FA_CASES,
                         ids=[f"r{r}_ctx{c // 1024}k_new{n}" for r, c, n in FA_CASES])
def test_eager_step_aiter_fa(benchmark, request, env, fa_caches, reqs, context, new):
    model, ops = eager_ops.QWEN3_30B, env["ops"]
    step = eager_ops.fa_step(model, fa_caches, ops, reqs, context, new)
    # Same step, same answer (bf16 rounding; other summation orders).
    step.upstream()
    ref = step.output.clone()
    step.ours()
    rel = eager_ops.relative_rms(step.output, ref)
    assert rel < 2e-2, f"ours vs upstream: relative RMS error {rel:.2e}"
    flops = eager_ops.fa_flops(model, reqs, context, new) * model["layers"]
    reps = _reps(flops / 4e8)  # ~400 TFLOP/s
    timings = (*wall_us((step.ours, step.upstream), reps),
               gpu_us(lambda: step.ours(eager=False), reps),
               gpu_us(lambda: step.upstream(eager=False), reps))
    kv_bytes = model["layers"] * reqs * context * model["num_kv_heads"] * 2 * model["head_size"] * 2

    def synced():
        step.ours()
        torch.cuda.synchronize()

    _record(benchmark, request, "eager_step_fa", f"r{reqs}_ctx{context // 1024}k_new{new}",
            dict(model=model["name"], layers=model["layers"], requests=reqs, context=context,
                 new_tokens=new, route=step.route, context_chunks=step.num_chunks,
                 num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"],
                 head_size=model["head_size"], block_size=model["block_size"], dtype="bfloat16",
                 flops=flops),
            kv_bytes, timings, {k: v for k, v in ops.notes.items() if k != "cache_mla"}, synced)
    del step
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def mla_caches(env):
    caches = eager_ops.mla_caches(eager_ops.DEEPSEEK_V3, num_blocks=1024)
    yield caches
    del caches[:]
    torch.cuda.empty_cache()


@pytest.mark.parametrize("decodes,prefill", MLA_CASES,
                         ids=[f"d{d}_p{p}" for d, p in MLA_CASES])
def test_eager_step_mla(benchmark, request, env, mla_caches, decodes, prefill):
    model, ops = eager_ops.DEEPSEEK_V3, env["ops"]
    step = eager_ops.mla_step(model, mla_caches, ops, decodes, prefill)
    reps = 31  # ms-scale steps: more rounds against host noise
    timings = (*wall_us((step.ours, step.upstream), reps),
               gpu_us(lambda: step.ours(graph_pieces=False), reps),
               gpu_us(lambda: step.upstream(graph_pieces=False), reps))

    def synced():
        step.ours()
        torch.cuda.synchronize()

    _record(benchmark, request, "eager_step_mla", f"d{decodes}_p{prefill}",
            dict(model=model["name"], layers=model["layers"], decode_tokens=decodes,
                 prefill_tokens=prefill, num_heads=model["num_heads"],
                 kv_lora_rank=model["kv_lora_rank"], rope_dim=model["rope_dim"],
                 block_size=model["block_size"], kv_cache_dtype="auto", dtype="bfloat16"),
            eager_ops.mla_bytes(model, decodes, prefill) * model["layers"], timings,
            {"cache_mla": ops.notes["cache_mla"]}, synced)
