"""Each ``make bench`` case beside the MI300X / MI355X roofline and upstream's sequence.

The bound is docs/roofline-amd.md's (``compile_tier.roofline``: bytes the suite
counts / HBM bandwidth, FLOPs / dense bf16 peak, from ``targets.DEVICES``);
the fraction is bound / measured time (1.0 = at the bound).  On an AMD GPU the
fraction is against the device's own row (gfx942: MI300X, gfx950: MI355X); on
another GPU the bounds are listed and no fraction is computed.  The ratio vs
upstream is the suite's own ``speedup`` (ours vs the baseline, same run).
Host-timed suites (``benchmeta.HOST_TIMED``) have no roofline.
"""

from __future__ import annotations

import json
from pathlib import Path

from compile_tier.roofline import AMD, case_flops
from compile_tier.targets import DEVICES
from seriestool.benchmeta import HOST_TIMED

__all__ = ["DEVICE_OF_ARCH", "cases", "newest"]

DEVICE_OF_ARCH = {DEVICES[name]["arch"]: name for name in AMD}


def newest(folder: Path) -> Path | None:
    files = sorted(folder.glob("*.json"))
    return files[-1] if files else None


def cases(results_file: Path, arch: str | None) -> list[dict]:
    """One row per benchmark case: kernel, case, ours µs, ratio vs upstream,
    the bound on each AMD device (µs) and the fraction of the device's own."""
    data = json.loads(results_file.read_text())
    own = DEVICE_OF_ARCH.get(arch or "")
    rows = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        kernel = info.get("kernel")
        if not kernel:
            continue
        ours = ((info.get("results") or {}).get("ours") or {}).get("us")
        row = {"kernel": kernel, "case": info.get("case"), "ours_us": ours,
               "vs_upstream": info.get("speedup"), "bounds_us": {}, "fraction_of_bound": None,
               "bound_device": own}
        host = any(str(kernel).startswith(p) for p in HOST_TIMED)
        if info.get("nbytes") and not host:
            flops, _ = case_flops(kernel, info.get("shapes", {}))
            for name in AMD:
                d = DEVICES[name]
                bound = max(info["nbytes"] / d["hbm_bytes_per_s"], flops / d["bf16_dense_flops"])
                row["bounds_us"][name] = round(bound * 1e6, 4)
            if own and ours:
                row["fraction_of_bound"] = round(row["bounds_us"][own] / ours, 4)
        rows.append(row)
    return rows
