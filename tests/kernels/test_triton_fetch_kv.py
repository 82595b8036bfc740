# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""fetch_kv (vllm/v1/attention/ops/triton_fetch_kv.py) against a torch reference.

fetch_kv is data movement: outputs must equal the reference bit for bit (the
dequant path too: torch's own fp8 -> fp32, * scale in fp32, -> output dtype is
exactly what the kernel is specified to do).  Outputs are poisoned with NaN
first, so rows the kernel should not touch must still hold the poison and rows
it misses show up.

The reference never looks at the kernel's layout arithmetic: it builds the
logical K/V ``[num_blocks, block_size, H, D]`` first, derives each cache
layout's storage from that with torch reshapes, and gathers with torch
indexing per request.

Every data case runs through both of fetch_kv's paths: ``lookup`` (each
program finds its request and pages) and ``plan`` (a fetch_kv_plan built from
the same metadata first).  The plan's own tests: one plan reused by two caches
(two layers), every row covered once with the block-table entries of its
pages, refusal of a plan built for other rows, and (GPU) the builder captured
in a CUDA graph.

CPU tier: small shapes under TRITON_INTERPRET=1 (fp16/fp32/fp8 only: bf16 math
is wrong in the interpreter).  GPU tier (``gpu`` marker): the same cases
compiled, plus real sizes in bf16 and fp8 e4m3fn, caches whose element offsets
pass 2**31, and CUDA-graph replays with new lengths.
"""

from dataclasses import dataclass

import pytest
import torch

from vllm.v1.attention.ops import triton_fetch_kv
from vllm.v1.attention.ops.triton_fetch_kv import FetchKVPlan, fetch_kv, fetch_kv_plan

# Self-contained: these tests also ship to vLLM's tests/kernels/attention/.  They run
# on the GPU when there is one, else on the CPU under TRITON_INTERPRET=1; tests marked
# ``gpu`` need a GPU.
gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (compiled kernels, real sizes)"
)


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


FP8 = torch.float8_e4m3fn
PATHS = ["lookup", "plan"]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Case:
    name: str
    lens: list[int]  # tokens fetched per request
    starts: list[int]  # first logical position fetched per request
    num_kv_heads: int
    head_size: int
    block_size: int
    cache_dtype: torch.dtype
    out_dtype: torch.dtype
    # "packed": 0.34.0's (blocks, H, bs, 2D) cache viewed as K/V
    # "dense": separate contiguous [blocks, bs, H, D] K and V
    # "shuffle_interleaved": SHUFFLE, K and V of a block side by side
    # "shuffle_planes": SHUFFLE, all K blocks then all V blocks
    cache_kind: str = "packed"
    row_offset: int = 0  # cu_seqlens_kv[0]
    spare_rows: int = 3  # output rows past cu_seqlens_kv[-1] that must stay poisoned
    extra_blocks: int = 2  # unreferenced blocks in the cache
    pass_max_num_tokens: bool = False
    index_dtype: torch.dtype = torch.int32  # block_table / cu_seqlens_kv / seq_starts
    k_scale: float = 1.0
    v_scale: float = 1.0
    seed: int = 0

    @property
    def layout(self) -> str:
        return "SHUFFLE" if self.cache_kind.startswith("shuffle") else "NHD"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.element_size()])


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, what: str
) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    diff = _bits(actual) != _bits(expected)
    if diff.any():
        idx = diff.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(diff.sum())} elements differ, first at {idx}: "
            f"got {actual[tuple(idx)].item()} expected {expected[tuple(idx)].item()}"
        )


def _random_values(shape, dtype, gen) -> torch.Tensor:
    """Random cache contents on gen's device; fp8: random bytes, no NaN (0x7f/0xff)."""
    if dtype.itemsize == 1:
        mag = torch.randint(
            0, 0x7F, shape, generator=gen, dtype=torch.uint8, device=gen.device
        )
        return (mag | (torch.randint_like(mag, 0, 2) << 7)).view(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device).to(
        dtype
    )


def make_block_table(lens, starts, block_size, extra_blocks, gen):
    """Permuted physical blocks (block 0 never used), 0-padded rows."""
    pages = [-(-(s + n) // block_size) for s, n in zip(starts, lens)]
    num_blocks = 1 + sum(pages) + extra_blocks
    perm = torch.randperm(num_blocks - 1, generator=gen)[: sum(pages)] + 1
    table = torch.zeros(len(lens), max(pages + [1]) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n]
        used += n
    return table, num_blocks


def build_cache(kind, k_logical, v_logical):
    """Storage of the layout holding k/v_logical; the K/V views fetch_kv takes."""
    nb, bs, h, d = k_logical.shape
    if kind == "packed":
        packed = torch.cat([k_logical, v_logical], dim=-1).transpose(1, 2).contiguous()
        return packed.transpose(1, 2).split(d, dim=-1)
    if kind == "dense":
        return k_logical.clone(), v_logical.clone()
    x = 16 // k_logical.element_size()
    # K per (block, head): [D // x, bs, x];  V per (block, head): [bs // x, D, x]
    k_sh = (
        k_logical.reshape(nb, bs, h, d // x, x).permute(0, 2, 3, 1, 4).reshape(nb, -1)
    )
    v_sh = (
        v_logical.reshape(nb, bs // x, x, h, d).permute(0, 3, 1, 4, 2).reshape(nb, -1)
    )
    if kind == "shuffle_interleaved":
        storage = torch.stack([k_sh, v_sh], dim=1)  # [nb, 2, bs*H*D]
        return storage[:, 0].view(nb, bs, h, d), storage[:, 1].view(nb, bs, h, d)
    assert kind == "shuffle_planes"
    storage = torch.stack([k_sh, v_sh], dim=0)  # [2, nb, bs*H*D]
    return storage[0].view(nb, bs, h, d), storage[1].view(nb, bs, h, d)


def poisoned(shape, dtype, device) -> torch.Tensor:
    if dtype.itemsize == 1:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def reference(
    k_logical, v_logical, key_out, value_out, table, cu, starts, k_scale, v_scale
):
    """Expected outputs: the poisoned outputs with each request's rows filled in."""
    ko, vo = key_out.clone(), value_out.clone()
    bs = k_logical.shape[1]
    dequant = k_logical.dtype != ko.dtype
    for b, start in enumerate(starts.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        pos = torch.arange(start, start + hi - lo, device=table.device)
        blocks = table[b, pos // bs].long()
        k, v = k_logical[blocks, pos % bs], v_logical[blocks, pos % bs]
        if dequant:
            k = (k.to(torch.float32) * k_scale).to(ko.dtype)
            v = (v.to(torch.float32) * v_scale).to(vo.dtype)
        ko[lo:hi], vo[lo:hi] = k, v
    return ko, vo


def make_plan(case: Case, table, cu, starts, num_tokens, **kwargs) -> FetchKVPlan:
    return fetch_kv_plan(
        table,
        cu,
        starts,
        num_tokens=num_tokens,
        block_size=case.block_size,
        head_size=case.head_size,
        cache_dtype=case.cache_dtype,
        out_dtype=case.out_dtype,
        kv_cache_layout=case.layout,
        **kwargs,
    )


def run_case(case: Case, device: str, *, path: str = "lookup", check=True):
    gen = torch.Generator().manual_seed(case.seed)
    table, num_blocks = make_block_table(
        case.lens, case.starts, case.block_size, case.extra_blocks, gen
    )
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    value_gen = torch.Generator(device=device).manual_seed(case.seed)
    k_logical = _random_values(shape, case.cache_dtype, value_gen)
    v_logical = _random_values(shape, case.cache_dtype, value_gen)
    # block 0 is never referenced: poison it so that any read of it shows
    k_logical[0] = poisoned(shape[1:], case.cache_dtype, device)
    v_logical[0] = poisoned(shape[1:], case.cache_dtype, device)
    key_cache, value_cache = build_cache(case.cache_kind, k_logical, v_logical)

    cu = torch.tensor([0] + case.lens).cumsum(0).to(torch.int32) + case.row_offset
    total = int(cu[-1])
    out_shape = (total + case.spare_rows, case.num_kv_heads, case.head_size)
    key_out = poisoned(out_shape, case.out_dtype, device)
    value_out = poisoned(out_shape, case.out_dtype, device)
    starts = torch.tensor(case.starts, dtype=torch.int32)
    scales = {}
    if case.cache_dtype != case.out_dtype:
        scales = {
            "k_scale": torch.tensor([case.k_scale], device=device),
            "v_scale": torch.tensor([case.v_scale], device=device),
        }
    table, cu, starts = (t.to(device, case.index_dtype) for t in (table, cu, starts))
    expected = reference(
        k_logical,
        v_logical,
        key_out,
        value_out,
        table,
        cu,
        starts,
        case.k_scale,
        case.v_scale,
    )
    max_num_tokens = total if case.pass_max_num_tokens else None
    if path == "plan":
        scales["plan"] = make_plan(
            case, table, cu, starts, max_num_tokens or out_shape[0]
        )
    else:
        assert path == "lookup"
    fetch_kv(
        key_cache,
        value_cache,
        key_out,
        value_out,
        table,
        cu,
        starts,
        kv_cache_layout=case.layout,
        max_num_tokens=max_num_tokens,
        **scales,
    )
    if check:
        assert_bitwise_equal(key_out, expected[0], f"{case.name} [{path}] key_out")
        assert_bitwise_equal(value_out, expected[1], f"{case.name} [{path}] value_out")
    return key_out, value_out


F16, F32 = torch.float16, torch.float32
CPU_CASES = [
    Case("one_req_aligned_h1_d64_bs16_f32", [32], [0], 1, 64, 16, F32, F32),
    Case("one_req_ragged_start_h2_d128_bs16_f16", [37], [5], 2, 128, 16, F16, F16),
    Case("one_req_single_token_mid_page", [1], [21], 2, 64, 16, F16, F16),
    Case(
        "many_reqs_ragged_h8_d64_bs32_f16",
        [1, 17, 40, 16, 3],
        [0, 15, 33, 16, 62],
        8,
        64,
        32,
        F16,
        F16,
    ),
    Case(
        "many_reqs_with_empty_and_offset_rows_h2_d128_bs32_f32",
        [9, 0, 50, 0, 31],
        [40, 7, 1, 0, 32],
        2,
        128,
        32,
        F32,
        F32,
        row_offset=4,
    ),
    Case(
        "dense_cache_int64_indices_h2_d64_bs16_f16",
        [20, 45],
        [3, 16],
        2,
        64,
        16,
        F16,
        F16,
        cache_kind="dense",
        index_dtype=torch.int64,
    ),
    Case(
        "head_size_80_not_power_of_two_h2_bs16_f16",
        [19, 30],
        [4, 17],
        2,
        80,
        16,
        F16,
        F16,
    ),
    Case(
        "max_num_tokens_given_h2_d64_bs16_f16",
        [23, 9],
        [9, 30],
        2,
        64,
        16,
        F16,
        F16,
        pass_max_num_tokens=True,
        spare_rows=20,
    ),
    Case(
        "dequant_fp8_to_f16_h2_d128_bs16",
        [33, 12],
        [7, 0],
        2,
        128,
        16,
        FP8,
        F16,
        k_scale=0.37,
        v_scale=2.5,
    ),
    Case(
        "dequant_fp8_to_f32_h1_d64_bs32",
        [70],
        [13],
        1,
        64,
        32,
        FP8,
        F32,
        k_scale=1.7,
        v_scale=0.011,
    ),
    Case("fp8_copy_without_scales_h2_d64_bs16", [25], [6], 2, 64, 16, FP8, FP8),
    Case(
        "shuffle_interleaved_h2_d64_bs16_f16",
        [30, 5],
        [3, 40],
        2,
        64,
        16,
        F16,
        F16,
        cache_kind="shuffle_interleaved",
    ),
    Case(
        "shuffle_planes_h1_d128_bs32_f32",
        [41, 20],
        [17, 0],
        1,
        128,
        32,
        F32,
        F32,
        cache_kind="shuffle_planes",
    ),
    Case(
        "shuffle_dequant_fp8_to_f16_h2_d128_bs16",
        [29, 18],
        [2, 16],
        2,
        128,
        16,
        FP8,
        F16,
        cache_kind="shuffle_interleaved",
        k_scale=0.5,
        v_scale=3.0,
    ),
    Case(
        "shuffle_dequant_fp8_to_f32_h8_d64_bs32",
        [33],
        [31],
        8,
        64,
        32,
        FP8,
        F32,
        cache_kind="shuffle_planes",
        k_scale=0.25,
        v_scale=1.25,
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_fetch_kv_matches_reference(case, path, device):
    run_case(case, device, path=path)


TUNING_CASES = [
    # The request lookup scans requests in steps; force several steps.
    (
        "lookup_in_several_steps",
        {"_MAX_REQ_STEP": 16},
        Case(
            "seventeen_reqs",
            [(7 * i) % 23 for i in range(17)],
            [(5 * i) % 19 for i in range(17)],
            1,
            64,
            16,
            F16,
            F16,
        ),
    ),
    # Up to 8 pages per program: groups that run past a request's last page.
    (
        "eight_pages_per_program",
        {"_TILE_BYTES": 1 << 20},
        Case(
            "ragged_groups",
            [3, 130, 17, 0, 64],
            [30, 1, 16, 0, 15],
            2,
            64,
            16,
            F32,
            F32,
        ),
    ),
    (
        "eight_pages_per_program_dequant",
        {"_TILE_BYTES": 1 << 20},
        Case(
            "ragged_groups_fp8",
            [129, 40],
            [3, 16],
            1,
            128,
            16,
            FP8,
            F16,
            k_scale=0.3,
            v_scale=1.9,
        ),
    ),
    (
        "one_page_per_program",
        {"_TILE_BYTES": 1},
        Case("ragged_pages", [20, 33], [9, 0], 2, 64, 16, F16, F16),
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "constants,case", [c[1:] for c in TUNING_CASES], ids=[c[0] for c in TUNING_CASES]
)
def test_fetch_kv_tuning_paths_match_reference(
    constants, case, path, device, monkeypatch
):
    import vllm.v1.attention.ops.triton_fetch_kv as module

    for name, value in constants.items():
        assert hasattr(module, name)
        monkeypatch.setattr(module, name, value)
    run_case(case, device, path=path)


@pytest.mark.parametrize("path", PATHS)
def test_fetch_kv_zero_requests_is_a_no_op(path, device):
    kc = torch.zeros(4, 16, 1, 64, device=device)
    out = poisoned((5, 1, 64), torch.float32, device)
    before = out.clone()
    meta = (
        torch.zeros(0, 2, dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.int32, device=device),
    )
    kwargs = {}
    if path == "plan":
        kwargs["plan"] = fetch_kv_plan(
            *meta, num_tokens=5, block_size=16, head_size=64, cache_dtype=torch.float32
        )
        assert kwargs["plan"].num_items == 0
    fetch_kv(kc, kc, out, out.clone(), *meta, **kwargs)
    assert_bitwise_equal(out, before, "untouched output")


# ---------------------------------------------------------------- the plan


def test_fetch_kv_plan_reused_by_two_caches(device):
    """One plan, two layers: a packed fp16 cache, a dense fp8 cache dequantised to fp16.

    Both need the same rows per item (2-byte outputs), so the plan of the step
    serves both; each output must match its own reference.
    """
    lens, starts, h, d, bs = [37, 0, 70, 5], [5, 9, 16, 60], 2, 64, 16
    gen = torch.Generator().manual_seed(21)
    table, num_blocks = make_block_table(lens, starts, bs, 2, gen)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    table, cu = table.to(device), cu.to(device)
    seq_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    plan = fetch_kv_plan(
        table,
        cu,
        seq_starts,
        num_tokens=total,
        block_size=bs,
        head_size=d,
        cache_dtype=F16,
    )
    shape = (num_blocks, bs, h, d)
    value_gen = torch.Generator(device=device).manual_seed(22)
    for layer, (kind, cache_dtype, scales) in enumerate(
        [("packed", F16, (1.0, 1.0)), ("dense", FP8, (0.5, 3.0))]
    ):
        k_logical = _random_values(shape, cache_dtype, value_gen)
        v_logical = _random_values(shape, cache_dtype, value_gen)
        k_logical[0] = poisoned(shape[1:], cache_dtype, device)
        v_logical[0] = poisoned(shape[1:], cache_dtype, device)
        key_cache, value_cache = build_cache(kind, k_logical, v_logical)
        key_out = poisoned((total + 2, h, d), F16, device)
        value_out = poisoned((total + 2, h, d), F16, device)
        expected = reference(
            k_logical, v_logical, key_out, value_out, table, cu, seq_starts, *scales
        )
        kwargs = {}
        if cache_dtype != F16:
            kwargs = {
                "k_scale": torch.tensor([scales[0]], device=device),
                "v_scale": torch.tensor([scales[1]], device=device),
            }
        fetch_kv(
            key_cache,
            value_cache,
            key_out,
            value_out,
            table,
            cu,
            seq_starts,
            max_num_tokens=total,
            plan=plan,
            **kwargs,
        )
        assert_bitwise_equal(key_out, expected[0], f"layer {layer} key_out")
        assert_bitwise_equal(value_out, expected[1], f"layer {layer} value_out")


@pytest.mark.parametrize(
    "tile_bytes", [None, 1], ids=["default_tile", "one_page_per_item"]
)
def test_fetch_kv_plan_rows_cover_every_token_once(tile_bytes, device, monkeypatch):
    """Plan rows, read back: each fetched row exactly once, blocks from the block table.

    Row format (fetch_kv_plan): [out_first, lo, hi, 0, block per page ...]; tile
    rows lo .. hi - 1 go to output rows out_first ..; idle items are all zero.
    """
    import vllm.v1.attention.ops.triton_fetch_kv as module

    if tile_bytes is not None:
        monkeypatch.setattr(module, "_TILE_BYTES", tile_bytes)
    lens, starts, bs, offset = [9, 0, 50, 0, 31, 64], [40, 7, 1, 0, 32, 16], 16, 4
    gen = torch.Generator().manual_seed(23)
    table, _ = make_block_table(lens, starts, bs, 2, gen)
    cu = torch.tensor([0] + lens).cumsum(0) + offset
    plan = fetch_kv_plan(
        table.to(device),
        cu.to(device, torch.int32),
        torch.tensor(starts, dtype=torch.int32, device=device),
        num_tokens=int(cu[-1]) + 7,
        block_size=bs,
        head_size=64,
        cache_dtype=F16,
    )
    ppp = plan.pages_per_program
    assert (
        ppp == (1 if tile_bytes else 4)
        and plan.block_size * plan.pages_per_program == ppp * bs
    )
    rows = plan.table.cpu().long()
    assert rows.shape == (int(cu[-1] + 7) // (ppp * bs) + 2 * len(lens), 8)
    seen = []
    for row in rows.tolist():
        out_first, lo, hi, pad, blocks = row[0], row[1], row[2], row[3], row[4:]
        assert pad == 0 and all(b == 0 for b in blocks[ppp:])
        if hi <= lo:
            assert row == [0] * len(row), "idle item not zeroed"
            continue
        assert 0 <= lo < hi <= ppp * bs
        b = int(torch.searchsorted(cu, out_first, right=True)) - 1
        pos0 = starts[b] + out_first - int(cu[b])  # position of tile row lo
        first_page, rem = divmod(pos0 - lo, bs)
        assert rem == 0, "tile not page-aligned"
        end_page = -(-(starts[b] + lens[b]) // bs)
        for j in range(ppp):
            want = int(table[b, first_page + j]) if first_page + j < end_page else 0
            assert blocks[j] == want, (row, b, j)
        seen.extend(range(out_first, out_first + hi - lo))
    assert sorted(seen) == list(range(offset, int(cu[-1])))


def _plan_for(device, **overrides):
    kwargs = {"num_tokens": 8, "block_size": 16, "head_size": 64, "cache_dtype": F16}
    kwargs.update(overrides)
    return fetch_kv_plan(
        torch.ones(1, 2, dtype=torch.int32, device=device),
        torch.tensor([0, 8], dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        **kwargs,
    )


PLAN_MISMATCHES = [
    # (id, plan builder overrides, fetch_kv argument edits, exception, match)
    ("other_block_size", {"block_size": 32}, {}, ValueError, r"block size 32"),
    (
        "other_pages_per_program_dtype",
        {"cache_dtype": F32},
        {},
        ValueError,
        r"a plan for 2 pages per program.*needs 4",
    ),
    (
        "other_pages_per_program_head_size",
        {"head_size": 128},
        {},
        ValueError,
        r"head size 128",
    ),
    (
        "plan_for_nhd_used_with_shuffle",
        {},
        {"kv_cache_layout": lambda a: "SHUFFLE"},
        ValueError,
        "kv_cache_layout is not the plan",
    ),
    (
        "other_num_reqs",
        {},
        {
            "cu_seqlens_kv": lambda a: a["seq_starts"].new_tensor([0, 4, 8]),
            "seq_starts": lambda a: a["seq_starts"].new_zeros(2),
            "block_table": lambda a: a["block_table"].new_ones(2, 2),
        },
        ValueError,
        r"a plan for 1 requests",
    ),
    (
        "max_num_tokens_differs",
        {},
        {"max_num_tokens": lambda a: 7},
        ValueError,
        r"max_num_tokens 7 is not",
    ),
    (
        "plan_bound_past_outputs",
        {"num_tokens": 9},
        {},
        ValueError,
        "plan covers 9 tokens",
    ),
    ("not_a_plan", None, {}, TypeError, "FetchKVPlan"),
]


@pytest.mark.parametrize(
    "overrides,edits,exc,match",
    [c[1:] for c in PLAN_MISMATCHES],
    ids=[c[0] for c in PLAN_MISMATCHES],
)
def test_fetch_kv_refuses_a_plan_built_for_another_call(
    overrides, edits, exc, match, device
):
    """A plan fixes the rows per item (block size x pages per program) and the batch."""
    plan = "plan" if overrides is None else _plan_for(device, **overrides)
    args = _valid_args(device)
    for key, fn in edits.items():
        args[key] = fn(args)
    out = args["key_out"].clone()
    with pytest.raises(exc, match=match):
        fetch_kv(**args, plan=plan)
    assert_bitwise_equal(args["key_out"], out, "untouched output")


def test_fetch_kv_plan_writes_into_out_buffer(device):
    big = _plan_for(device, num_tokens=200)
    plan = _plan_for(device, out=big.table)
    assert plan.table.data_ptr() == big.table.data_ptr() and plan.num_items == 2
    assert torch.equal(plan.table, _plan_for(device).table)


PLAN_INVALID = [
    ("unknown_layout", {"kv_cache_layout": "HND"}, ValueError, "kv_cache_layout"),
    ("block_size_not_pow2", {"block_size": 12}, ValueError, "power of two"),
    ("negative_num_tokens", {"num_tokens": -1}, ValueError, "num_tokens"),
    ("num_tokens_past_int32", {"num_tokens": 2**31}, ValueError, "num_tokens"),
    (
        "out_wrong_width",
        {"out": torch.zeros(4, 16, dtype=torch.int32)},
        ValueError,
        r"out must be int32 \[>= 2, 8\]",
    ),
    (
        "out_too_few_rows",
        {"out": torch.zeros(1, 8, dtype=torch.int32)},
        ValueError,
        "out must be",
    ),
    (
        "out_int64",
        {"out": torch.zeros(4, 8, dtype=torch.int64)},
        ValueError,
        "out must be",
    ),
    (
        "cu_seqlens_wrong_length",
        {"cu_seqlens_kv": torch.tensor([0, 4, 8], dtype=torch.int32)},
        AssertionError,
        "cu_seqlens_kv",
    ),
    (
        "float_block_table",
        {"block_table": torch.ones(1, 2)},
        TypeError,
        "int32 or int64",
    ),
]


@pytest.mark.parametrize(
    "edits,exc,match", [c[1:] for c in PLAN_INVALID], ids=[c[0] for c in PLAN_INVALID]
)
def test_fetch_kv_plan_rejects_bad_arguments(edits, exc, match):
    kwargs = {
        "block_table": torch.ones(1, 2, dtype=torch.int32),
        "cu_seqlens_kv": torch.tensor([0, 8], dtype=torch.int32),
        "seq_starts": torch.zeros(1, dtype=torch.int32),
        "num_tokens": 8,
        "block_size": 16,
        "head_size": 64,
        "cache_dtype": F16,
    }
    kwargs.update(edits)
    with pytest.raises(exc, match=match):
        fetch_kv_plan(**kwargs)


# ---------------------------------------------------------------- validation


def _valid_args(device="cpu"):
    kc = torch.zeros(4, 16, 2, 64, device=device, dtype=torch.float16)
    ko = torch.zeros(8, 2, 64, device=device, dtype=torch.float16)
    return {
        "key_cache": kc,
        "value_cache": kc.clone(),
        "key_out": ko,
        "value_out": ko.clone(),
        "block_table": torch.ones(1, 2, dtype=torch.int32, device=device),
        "cu_seqlens_kv": torch.tensor([0, 8], dtype=torch.int32, device=device),
        "seq_starts": torch.zeros(1, dtype=torch.int32, device=device),
    }


def test_second_layer_of_a_step_builds_and_plans_nothing(device, monkeypatch):
    """The plan kernel runs once per step, the copy launch is built for the
    step's first layer of a geometry; the next layers only check and launch."""
    built, planned = [], []
    plan_kernel = triton_fetch_kv._fetch_kv_plan_kernel

    class Counting(triton_fetch_kv.KernelCall):
        def __init__(self, kernel, grid, **fixed):
            built.append(kernel)
            super().__init__(kernel, grid, **fixed)

    class CountingPlanKernel:
        def __getitem__(self, grid):
            planned.append(grid)
            return plan_kernel[grid]

    monkeypatch.setattr(triton_fetch_kv, "KernelCall", Counting)
    monkeypatch.setattr(triton_fetch_kv, "_fetch_kv_plan_kernel", CountingPlanKernel())
    args = _valid_args(device)
    plan = fetch_kv_plan(
        args["block_table"],
        args["cu_seqlens_kv"],
        args["seq_starts"],
        num_tokens=8,
        block_size=16,
        head_size=64,
        cache_dtype=torch.float16,
    )
    for _ in range(3):
        fetch_kv(**args, plan=plan)
    assert len(planned) == 1
    assert built == [triton_fetch_kv._fetch_kv_kernel]


def test_a_layer_of_another_dtype_gets_its_own_launch(device):
    """A relaunch does not read the dtypes again: the plan keys each layer's
    launch by its tensors' dtypes, so a layer that differs from the step's
    first only in dtype (bf16 for fp16: the same strides, the same plan)
    builds its own launch, and every copy is exact."""
    args = _valid_args(device)
    metadata = [args[k] for k in ("block_table", "cu_seqlens_kv", "seq_starts")]
    plan = fetch_kv_plan(
        *metadata, num_tokens=8, block_size=16, head_size=64, cache_dtype=F16
    )
    for dtype in (F16, torch.bfloat16, F16):
        key_cache = torch.randn(4, 16, 2, 64, device=device).to(dtype)
        value_cache = torch.randn_like(key_cache)
        key_out = torch.zeros(8, 2, 64, device=device, dtype=dtype)
        value_out = torch.zeros_like(key_out)
        fetch_kv(key_cache, value_cache, key_out, value_out, *metadata, plan=plan)
        # Block table [1, 1], one request of 8 tokens from position 0.
        assert_bitwise_equal(key_out, key_cache[1, :8], f"{dtype} key_out")
        assert_bitwise_equal(value_out, value_cache[1, :8], f"{dtype} value_out")
    assert len(plan.copies) == 2


def _fp8_args():
    args = _valid_args()
    args["key_cache"] = args["key_cache"].to(FP8)
    args["value_cache"] = args["value_cache"].to(FP8)
    return args


def _edit(**changes):
    def make():
        args = _valid_args()
        for key, fn in changes.items():
            args[key] = fn(args)
        return args

    return make


INVALID = [
    (
        "unknown_layout",
        _edit(kv_cache_layout=lambda a: "HND"),
        ValueError,
        "kv_cache_layout",
    ),
    (
        "cache_not_4d",
        _edit(key_cache=lambda a: a["key_cache"][0]),
        ValueError,
        "expected 4",
    ),
    (
        "out_heads_mismatch",
        _edit(
            key_out=lambda a: torch.zeros(8, 1, 64, dtype=torch.float16),
            value_out=lambda a: torch.zeros(8, 1, 64, dtype=torch.float16),
        ),
        AssertionError,
        "output H, D",
    ),
    (
        "k_v_cache_shapes_differ",
        _edit(value_cache=lambda a: torch.zeros(5, 16, 2, 64, dtype=torch.float16)),
        AssertionError,
        "cache shapes differ",
    ),
    (
        "cache_out_dtype_mismatch",
        _edit(
            key_out=lambda a: a["key_out"].float(),
            value_out=lambda a: a["value_out"].float(),
        ),
        TypeError,
        "cannot fetch",
    ),
    (
        "uint8_cache",
        _edit(
            key_cache=lambda a: a["key_cache"].view(torch.uint8)[..., :64],
            value_cache=lambda a: a["value_cache"].view(torch.uint8)[..., :64],
        ),
        TypeError,
        "not uint8",
    ),
    (
        "k_v_out_dtypes_differ",
        _edit(value_out=lambda a: a["value_out"].float()),
        TypeError,
        "same cache and output dtypes",
    ),
    ("fp8_without_scales", _fp8_args, ValueError, "needs one-element k_scale"),
    (
        "fp8_scale_not_tensor",
        lambda: {**_fp8_args(), "k_scale": 1.0, "v_scale": torch.ones(1)},
        ValueError,
        "one-element",
    ),
    (
        "fp8_scale_not_scalar",
        lambda: {**_fp8_args(), "k_scale": torch.ones(2), "v_scale": torch.ones(1)},
        ValueError,
        "one-element",
    ),
    (
        "block_size_not_pow2",
        _edit(
            key_cache=lambda a: torch.zeros(4, 12, 2, 64, dtype=torch.float16),
            value_cache=lambda a: torch.zeros(4, 12, 2, 64, dtype=torch.float16),
        ),
        ValueError,
        "power of two",
    ),
    (
        "cu_seqlens_wrong_length",
        _edit(cu_seqlens_kv=lambda a: torch.tensor([0, 4, 8], dtype=torch.int32)),
        AssertionError,
        "cu_seqlens_kv",
    ),
    (
        "block_table_too_few_rows",
        _edit(block_table=lambda a: a["block_table"][:0]),
        AssertionError,
        "too few rows",
    ),
    (
        "float_block_table",
        _edit(block_table=lambda a: a["block_table"].float()),
        TypeError,
        "int32 or int64",
    ),
    (
        "max_num_tokens_too_big",
        _edit(max_num_tokens=lambda a: 9),
        ValueError,
        "max_num_tokens",
    ),
    (
        "shuffle_not_dense",
        _edit(
            kv_cache_layout=lambda a: "SHUFFLE",
            key_cache=lambda a: torch.zeros(
                4, 2, 16, 64, dtype=torch.float16
            ).transpose(1, 2),
            value_cache=lambda a: torch.zeros(
                4, 2, 16, 64, dtype=torch.float16
            ).transpose(1, 2),
        ),
        ValueError,
        "dense",
    ),
    (
        "shuffle_head_not_multiple_of_x",
        _edit(
            kv_cache_layout=lambda a: "SHUFFLE",
            key_cache=lambda a: torch.zeros(4, 16, 2, 4, dtype=torch.float16),
            value_cache=lambda a: torch.zeros(4, 16, 2, 4, dtype=torch.float16),
            key_out=lambda a: torch.zeros(8, 2, 4, dtype=torch.float16),
            value_out=lambda a: torch.zeros(8, 2, 4, dtype=torch.float16),
        ),
        ValueError,
        "multiples of x",
    ),
]


@pytest.mark.parametrize(
    "make_args,exc,match", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_fetch_kv_rejects_bad_arguments(make_args, exc, match):
    with pytest.raises(exc, match=match):
        fetch_kv(**make_args())


# ---------------------------------------------------------------- GPU tier

BF16 = torch.bfloat16


def _random_lens(num_reqs, total, gen):
    cuts = torch.randperm(total - 1, generator=gen)[: num_reqs - 1].sort().values + 1
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
    return (edges[1:] - edges[:-1]).tolist()


def _real_case(name, num_reqs, total, h, d, bs, cache_dtype, out_dtype, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = _random_lens(num_reqs, total, gen)
    starts = torch.randint(0, 3000, (num_reqs,), generator=gen).tolist()
    # >= 32,768 blocks in every real-size cache (index-overflow rule)
    return Case(
        name,
        lens,
        starts,
        h,
        d,
        bs,
        cache_dtype,
        out_dtype,
        cache_kind=kind,
        extra_blocks=32768,
        k_scale=0.0625,
        v_scale=1.5,
        seed=seed,
    )


GPU_CASES = [
    _real_case(
        "real_bf16_packed_h8_d128_bs16_32k",
        8,
        32768,
        8,
        128,
        16,
        BF16,
        BF16,
        "packed",
        1,
    ),
    _real_case(
        "real_bf16_packed_h1_d256_bs32_4k", 3, 4096, 1, 256, 32, BF16, BF16, "packed", 2
    ),
    _real_case(
        "real_bf16_dense_h4_d64_bs16_8k", 16, 8192, 4, 64, 16, BF16, BF16, "dense", 3
    ),
    _real_case(
        "real_fp8_to_bf16_packed_h8_d128_bs16_32k",
        8,
        32768,
        8,
        128,
        16,
        FP8,
        BF16,
        "packed",
        4,
    ),
    _real_case(
        "real_fp8_to_f16_packed_h4_d128_bs32_8k",
        5,
        8192,
        4,
        128,
        32,
        FP8,
        F16,
        "packed",
        5,
    ),
    _real_case(
        "real_bf16_shuffle_h8_d128_bs16_16k",
        4,
        16384,
        8,
        128,
        16,
        BF16,
        BF16,
        "shuffle_interleaved",
        6,
    ),
    _real_case(
        "real_fp8_to_bf16_shuffle_h8_d128_bs16_16k",
        4,
        16384,
        8,
        128,
        16,
        FP8,
        BF16,
        "shuffle_planes",
        7,
    ),
    _real_case(
        "real_many_reqs_bf16_h2_d128_bs16",
        700,
        20000,
        2,
        128,
        16,
        BF16,
        BF16,
        "packed",
        8,
    ),
    _real_case(
        "real_more_reqs_than_one_lookup_step_f16_h1_d64_bs16",
        1500,
        6000,
        1,
        64,
        16,
        F16,
        F16,
        "packed",
        9,
    ),
]


@gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_fetch_kv_real_sizes(case, path, device):
    run_case(case, device, path=path)


@gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "cache_dtype,out_dtype", [(BF16, BF16), (FP8, BF16)], ids=["bf16", "fp8_to_bf16"]
)
def test_fetch_kv_cache_past_2pow31_elements(cache_dtype, out_dtype, path, device):
    """Packed cache, 40,000 blocks x 65,536 elements: block offsets pass 2**31."""
    num_blocks, bs, h, d = 40_000, 16, 8, 256
    gen = torch.Generator(device=device).manual_seed(11)
    packed = torch.empty(num_blocks, h, bs, 2 * d, dtype=cache_dtype, device=device)
    if cache_dtype.itemsize == 1:
        mag = torch.randint(
            0, 0x7F, packed.shape, generator=gen, device=device, dtype=torch.uint8
        )
        packed.view(torch.uint8).copy_(mag | (torch.randint_like(mag, 0, 2) << 7))
    else:
        packed.normal_(generator=gen)
    assert packed[-1].data_ptr() - packed.data_ptr() > 2**31 * packed.element_size()
    key_cache, value_cache = packed.transpose(1, 2).split(d, dim=-1)
    lens, starts = [700, 1, 333, 2048], [0, 37, 100, 15]
    pages = [-(-(s + n) // bs) for s, n in zip(starts, lens)]
    # Mostly blocks past 2**31 elements, a few low ones, never block 0.
    high = torch.randperm(num_blocks - 33_000, device="cpu")[: sum(pages)] + 33_000
    high[::7] = torch.arange(1, 1 + high[::7].numel())
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = high[used : used + n]
        used += n
    table = table.to(device)
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    seq_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    total = int(cu[-1])
    key_out = poisoned((total + 5, h, d), out_dtype, device)
    value_out = poisoned((total + 5, h, d), out_dtype, device)
    scales = {}
    if cache_dtype != out_dtype:
        scales = {
            "k_scale": torch.tensor([0.75], device=device),
            "v_scale": torch.tensor([1.25], device=device),
        }
    expected = reference(
        key_cache, value_cache, key_out, value_out, table, cu, seq_starts, 0.75, 1.25
    )
    if path == "plan":
        scales["plan"] = fetch_kv_plan(
            table,
            cu,
            seq_starts,
            num_tokens=total + 5,
            block_size=bs,
            head_size=d,
            cache_dtype=cache_dtype,
            out_dtype=out_dtype,
        )
    fetch_kv(
        key_cache, value_cache, key_out, value_out, table, cu, seq_starts, **scales
    )
    torch.cuda.synchronize()
    assert_bitwise_equal(key_out, expected[0], "key_out")
    assert_bitwise_equal(value_out, expected[1], "value_out")


# Metadata a captured graph is replayed with: (lengths, starts) of 4 requests.
GRAPH_STEPS = (
    ([100, 0, 2000, 37], [5, 0, 16, 300]),
    ([4000, 3000, 1, 1191], [0, 17, 6000, 31]),
)


def graph_steps(cu, seq_starts, outs):
    """Write each GRAPH_STEPS entry into the captured cu / seq_starts, NaN-fill
    the outputs, and yield its lengths."""
    for lens, starts in GRAPH_STEPS:
        cu.copy_(torch.tensor([0] + lens).cumsum(0))
        seq_starts.copy_(torch.tensor(starts))
        for o in outs:
            o.fill_(float("nan"))
        yield lens


@gpu
def test_fetch_kv_cuda_graph_replay_sees_new_lengths(device):
    """No host reads of device metadata: a captured call sees new cu_seqlens/starts."""
    gen = torch.Generator().manual_seed(12)
    bs, h, d, nb = 16, 4, 128, 2048
    packed = torch.randn(nb, h, bs, 2 * d, generator=gen).to(BF16).to(device)
    key_cache, value_cache = packed.transpose(1, 2).split(d, dim=-1)
    table = (torch.randperm(nb - 1, generator=gen)[: 4 * 400] + 1).view(4, 400)
    table = table.to(torch.int32).to(device)
    cu = torch.zeros(5, dtype=torch.int32, device=device)
    seq_starts = torch.zeros(4, dtype=torch.int32, device=device)
    key_out = torch.empty(8192, h, d, dtype=BF16, device=device)
    value_out = torch.empty_like(key_out)

    def call():
        fetch_kv(key_cache, value_cache, key_out, value_out, table, cu, seq_starts)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in graph_steps(cu, seq_starts, (key_out, value_out)):
        expected = reference(
            key_cache, value_cache, key_out, value_out, table, cu, seq_starts, 1.0, 1.0
        )
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(key_out, expected[0], f"key_out lens={lens}")
        assert_bitwise_equal(value_out, expected[1], f"value_out lens={lens}")


@gpu
@pytest.mark.parametrize(
    "persistent_out", [False, True], ids=["allocated", "out_buffer"]
)
def test_fetch_kv_plan_built_inside_cuda_graph(persistent_out, device):
    """The builder is capturable: a graph of plan + two fetches follows new metadata."""
    gen = torch.Generator().manual_seed(13)
    bs, h, d, nb = 16, 1, 128, 2048
    packed = torch.randn(nb, h, bs, 2 * d, generator=gen).to(BF16).to(device)
    key_cache, value_cache = packed.transpose(1, 2).split(d, dim=-1)
    dense_k = torch.randn(nb, bs, h, d, generator=gen).to(BF16).to(device)
    dense_v = torch.randn(nb, bs, h, d, generator=gen).to(BF16).to(device)
    table = (torch.randperm(nb - 1, generator=gen)[: 4 * 400] + 1).view(4, 400)
    table = table.to(torch.int32).to(device)
    cu = torch.zeros(5, dtype=torch.int32, device=device)
    seq_starts = torch.zeros(4, dtype=torch.int32, device=device)
    outs = [torch.empty(8192, h, d, dtype=BF16, device=device) for _ in range(4)]
    plan_kwargs = {
        "num_tokens": 8192,
        "block_size": bs,
        "head_size": d,
        "cache_dtype": BF16,
    }
    buffer = fetch_kv_plan(table, cu, seq_starts, **plan_kwargs).table.clone()

    def call():
        plan = fetch_kv_plan(
            table, cu, seq_starts, **plan_kwargs, out=buffer if persistent_out else None
        )
        for kc, vc, ko, vo in (
            (key_cache, value_cache, *outs[:2]),
            (dense_k, dense_v, *outs[2:]),
        ):
            fetch_kv(
                kc, vc, ko, vo, table, cu, seq_starts, max_num_tokens=8192, plan=plan
            )

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in graph_steps(cu, seq_starts, outs):
        expected = [
            reference(kc, vc, ko, vo, table, cu, seq_starts, 1.0, 1.0)
            for kc, vc, ko, vo in (
                (key_cache, value_cache, *outs[:2]),
                (dense_k, dense_v, *outs[2:]),
            )
        ]
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, e) in enumerate(zip(outs, [t for pair in expected for t in pair])):
            assert_bitwise_equal(o, e, f"output {i} lens={lens}")
