"""Resource facts of a compiled kernel, parsed from the text the compiler emits.

AMD (amdgcn assembly of Triton's hip backend): the kernel descriptor's
``.vgpr_count`` (arch VGPRs + AGPRs), ``.agpr_count``, ``.sgpr_count``,
``.private_segment_fixed_size`` (scratch bytes per lane), the spill counts, the
``; NumVgprs`` / ``; Occupancy`` comments, and the LDS bytes Triton allocates
at launch (``metadata.shared``); global / buffer loads and stores counted by
access width in bytes.
"""

from __future__ import annotations

import re
from collections import Counter

from .targets import Target, amd_waves_per_simd

# Version of the facts' format: part of every cache key, so a change here
# invalidates cached results.
FACTS_VERSION = 1

_AMD_FIELDS = {
    "vgpr_total": r"\.vgpr_count:\s+(\d+)",
    "agpr": r"\.agpr_count:\s+(\d+)",
    "sgpr": r"\.sgpr_count:\s+(\d+)",
    "vgpr_spill": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill": r"\.sgpr_spill_count:\s+(\d+)",
    "scratch_bytes": r"\.private_segment_fixed_size:\s+(\d+)",
    "static_lds_bytes": r"\.group_segment_fixed_size:\s+(\d+)",
    "vgpr": r";\s*NumVgprs:\s+(\d+)",
    "llvm_occupancy": r";\s*Occupancy:\s+(\d+)",
}
_AMD_WIDTH = {"ubyte": 1, "sbyte": 1, "byte": 1, "ushort": 2, "sshort": 2, "short": 2,
              "dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16}
_AMD_MEM = re.compile(r"^\s*(?:global|buffer)_(load|store)_([a-z0-9]+)", re.M)


def _one(pattern: str, text: str, name: str) -> int:
    found = re.findall(pattern, text)
    if len(found) != 1:
        raise ValueError(f"expected one {name} in the compiler output, found {found!r}")
    return int(found[0])


def amd_memory_ops(asm: str) -> dict[str, dict[int, int]]:
    """{"load": {bytes: count}, "store": {...}} over global_* and buffer_* ops."""
    ops = {"load": Counter(), "store": Counter()}
    for kind, suffix in _AMD_MEM.findall(asm):
        width = _AMD_WIDTH.get(suffix.removesuffix("_d16").removesuffix("_d16_hi"))
        if width is not None:
            ops[kind][width] += 1
    return {k: dict(sorted(v.items())) for k, v in ops.items()}


def amd_facts(target: Target, asm: str, lds_bytes: int, num_warps: int) -> dict:
    f = {name: _one(pat, asm, name) for name, pat in _AMD_FIELDS.items()}
    f["lds_bytes"] = lds_bytes + f.pop("static_lds_bytes")
    f["waves_per_simd"] = amd_waves_per_simd(target, f["llvm_occupancy"], f["lds_bytes"], num_warps)
    f["spills"] = f["vgpr_spill"] > 0 or f["scratch_bytes"] > 0
    f["memory_ops"] = amd_memory_ops(asm)
    return f
