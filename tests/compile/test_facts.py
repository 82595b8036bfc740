"""The compile tier's parsers and occupancy arithmetic, on hand-written compiler
output (no compile): what test_compile_tier's budgets are computed from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from compile_tier import roofline, run, worker  # noqa: E402
from compile_tier.targets import TARGETS  # noqa: E402
from compile_tier.worker import amd_waves_per_simd  # noqa: E402

AMDGCN = """
	global_load_dwordx4 v[0:3], v[8:9], off
	buffer_load_dwordx4 v[4:7], v10, s[0:3], 0 offen
	buffer_load_dword v11, v12, s[4:7], 0 offen
	global_load_ubyte v13, v[14:15], off
	global_store_dwordx2 v[16:17], v[18:19], off
	buffer_store_short v20, v21, s[8:11], 0 offen
	s_load_dwordx4 s[0:3], s[4:5], 0x0
; NumVgprs: 200
; Occupancy: 2
	.agpr_count:     48
	.group_segment_fixed_size: 0
	.private_segment_fixed_size: 16
	.sgpr_count:     90
	.sgpr_spill_count: 3
	.vgpr_count:     248
	.vgpr_spill_count: 2
"""

def test_amd_memory_ops_count_global_and_buffer_accesses_by_width():
    assert worker.amd_memory_ops(AMDGCN) == {
        "load": {1: 1, 4: 1, 16: 2}, "store": {2: 1, 8: 1}}  # s_load_* is not memory data


def test_amd_facts_read_the_descriptor_and_cap_waves_by_lds():
    gfx942 = TARGETS["gfx942"]
    f = worker.amd_facts(gfx942, AMDGCN, lds_bytes=32784, num_warps=4)
    assert (f["vgpr"], f["agpr"], f["vgpr_total"], f["sgpr"]) == (200, 48, 248, 90)
    assert (f["vgpr_spill"], f["sgpr_spill"], f["scratch_bytes"]) == (2, 3, 16)
    assert f["spills"] and f["llvm_occupancy"] == 2
    # 64 KiB of LDS per CU holds one 32784-byte workgroup: 4 waves over 4 SIMDs.
    assert f["waves_per_simd"] == 1
    assert amd_waves_per_simd(gfx942, 2, 32768, 4) == 2
    assert amd_waves_per_simd(TARGETS["gfx950"], 2, 32784, 4) == 2  # 160 KiB per CU
    assert amd_waves_per_simd(gfx942, 8, 0, 1) == 8


def test_amd_facts_refuse_output_without_one_descriptor():
    with pytest.raises(ValueError, match="vgpr_total"):
        worker.amd_facts(TARGETS["gfx942"], AMDGCN.replace(".vgpr_count", ".x"), 0, 4)


def test_result_files_have_one_line_per_record():
    doc = {"target": "gfx942", "records": [{"case": "a", "vgpr": 1}, {"case": "b", "vgpr": 2}]}
    text = run.dumps(doc)
    assert json.loads(text) == doc
    assert text.count("\n") == 7


def test_roofline_counts_context_and_causal_new_token_flops():
    shapes = dict(requests=2, new_tokens=3, num_heads=4, head_size=8, context_flops=1000)
    flops, how = roofline.case_flops("paged_context", shapes)
    assert flops == 1000 + 4 * 2 * 4 * 8 * (3 * 4 // 2) and how
    assert roofline.case_flops("fetch_kv", {}) == (0, "")
