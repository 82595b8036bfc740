"""GPU tier: the configs the wrappers pick for AMD targets, run on the GPU at hand.

The compile tier checks the CDNA tiles of paged_context_attention and fetch_kv's
wave64 warp counts for registers and vector widths, but no AMD GPU runs them.
Their numerics do not depend on the target: here the wrappers are told they
run on gfx942 (``_gpu_target`` / ``_gpu_warp_size``), so a CUDA GPU compiles
and runs the AMD tiles and warp counts, and the kernel tests' own cases and
references (tests/kernels) check the results: paged_context_attention against
its float64 reference, fetch_kv bit for bit.  Only ``gpu``-marked tests: they
skip on the CPU tier.
"""

from __future__ import annotations

import pytest
import torch

import test_triton_fetch_kv as fetch_tests  # noqa: E402
import test_triton_paged_context_attention as paged_tests  # noqa: E402
from vllm.v1.attention.ops import triton_fetch_kv as fetch_mod  # noqa: E402
from vllm.v1.attention.ops import triton_paged_context_attention as paged_mod  # noqa: E402

pytestmark = pytest.mark.gpu

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@pytest.fixture
def as_gfx942(monkeypatch):
    from triton.backends.compiler import GPUTarget

    monkeypatch.setattr(paged_mod, "_gpu_target", lambda: GPUTarget("hip", "gfx942", 64))
    monkeypatch.setattr(fetch_mod, "_gpu_warp_size", lambda: 64)


D256_CASES = [
    paged_tests.Case("gpu_d256_gqa4", [2100, 300], [96, 17], num_kv_heads=2, group=4,
                     head_size=256, dtype=torch.bfloat16),
    paged_tests.Case("gpu_d256_fp8_window_splits", [3000], [70], num_kv_heads=2, group=4,
                     head_size=256, dtype=torch.bfloat16, cache_dtype=FP8,
                     sliding_window=1000, num_splits=3),
    paged_tests.Case("gpu_d128_block64", [2500, 600], [64, 130], num_kv_heads=4, group=8,
                     head_size=128, block_size=64, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("with_new", [False, True], ids=["context", "with_new"])
@pytest.mark.parametrize("case", paged_tests.GPU_CASES + D256_CASES, ids=lambda c: c.name)
def test_paged_context_cdna_tiles_match_reference(case, with_new, device, as_gfx942):
    tile = paged_mod._tile_config(paged_mod._gpu_target(), case.head_size, case.group,
                                  case.dtype)
    assert (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages) in {
        (*t,) for t in paged_mod._CDNA_TILES.values()}
    data = paged_tests.build(case, device)
    out, lse = paged_tests.run_kernel(case, data, with_new=with_new)
    paged_tests.assert_close_to_reference(case, data, out, lse, with_new=with_new)


# The SHUFFLE pages that get fewer than 4 warps at wave64 (and two that keep 4).
SHUFFLE_CASES = [
    fetch_tests._real_case(f"shuffle_{dt}_d{d}_bs{bs}", 4, 8192, 4, d, bs, cache, out, kind,
                           seed)
    for seed, (dt, d, bs, cache, out, kind) in enumerate([
        ("fp8_to_bf16", 64, 16, FP8, BF16, "shuffle_planes"),
        ("fp8_to_bf16", 128, 16, FP8, BF16, "shuffle_interleaved"),
        ("fp8_to_bf16", 64, 32, FP8, BF16, "shuffle_planes"),
        ("bf16", 64, 16, BF16, BF16, "shuffle_interleaved"),
        ("fp8", 128, 16, FP8, FP8, "shuffle_planes"),
        ("bf16", 128, 16, BF16, BF16, "shuffle_planes"),
        ("fp8_to_bf16", 256, 64, FP8, BF16, "shuffle_interleaved"),
    ])
]


@pytest.mark.parametrize("path", fetch_tests.PATHS)
@pytest.mark.parametrize("case", SHUFFLE_CASES + fetch_tests.GPU_CASES, ids=lambda c: c.name)
def test_fetch_kv_wave64_warps_bit_exact(case, path, device, as_gfx942):
    fetch_tests.run_case(case, device, path=path)


@pytest.mark.parametrize("path", fetch_tests.PATHS)
@pytest.mark.parametrize("case", SHUFFLE_CASES, ids=lambda c: c.name)
def test_fetch_kv_small_shuffle_pages_bit_exact(case, path, device):
    """The same SHUFFLE pages with this GPU's own warp counts (on sm_90 an fp8
    page of D 64 gets 2 warps)."""
    fetch_tests.run_case(case, device, path=path)
