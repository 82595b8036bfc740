"""The compile tier's facts of the device's own target, beside what the device reports.

Run on the GPU (``python -m validate_rocm.device_facts --target gfx942 --out
F.json``, vllm_overlay and scripts on PYTHONPATH, TRITON_INTERPRET unset):
every spec of ``compile_tier.cases`` for the target is specialised and
compiled as the compile tier does (``compile_tier.worker``), with the Triton
installed here, then loaded on the device, which reports its registers per
thread and spills (``CompiledKernel.n_regs`` / ``n_spills``: the HIP / CUDA
function attributes) and its occupancy, as the runtime's occupancy calculator
gives it for the kernel's workgroup size and LDS (waves per SIMD on AMD, warps
per SM on CUDA), beside the compile facts' (LLVM's waves per SIMD capped by
LDS; the resident-warp bound on sm_90).

``compare(device, committed)`` (no GPU needed) lines the records up with
benchmarks/results/compile/<target>.json: per case the committed facts, the
facts compiled here and the driver's numbers, and the differences.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

__all__ = ["compare", "main"]

# Facts compared between the committed file and this device's compile.
AMD_KEYS = ("vgpr_total", "agpr", "sgpr", "lds_bytes", "scratch_bytes", "vgpr_spill",
            "waves_per_simd")
CUDA_KEYS = ("regs", "lds_bytes", "spill_stores", "spill_loads", "stack_bytes", "warps_per_sm")


def _occupancy_api():
    """(function, name) that answers "resident workgroups per CU / SM" for a loaded
    kernel: HIP's hipModuleOccupancyMaxActiveBlocksPerMultiprocessor or CUDA's
    cuOccupancyMaxActiveBlocksPerMultiprocessor, through ctypes; None where
    neither library loads."""
    import ctypes

    for lib, name in (("libamdhip64.so", "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor"),
                      ("libcuda.so.1", "cuOccupancyMaxActiveBlocksPerMultiprocessor")):
        try:
            fn = getattr(ctypes.CDLL(lib), name)
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_size_t]
        return fn, name
    return None


def occupancy(kernel, target, api) -> dict:
    """Resident waves per SIMD (AMD) / warps per SM (CUDA) as the runtime computes
    them for this kernel, its workgroup size and its dynamic LDS / shared memory."""
    import ctypes

    if api is None:
        return {"occupancy_source": None}
    fn, name = api
    warps = kernel.metadata.num_warps
    blocks = ctypes.c_int(0)
    status = fn(ctypes.byref(blocks), ctypes.c_void_p(kernel.function),
                warps * target.warp_size, kernel.metadata.shared)
    if status != 0:
        return {"occupancy_source": f"{name} returned {status}"}
    if target.amd:
        simds = target.spec["simds_per_cu"]
        return {"occupancy_source": name, "waves_per_simd": blocks.value * warps // simds}
    return {"occupancy_source": name, "warps_per_sm": blocks.value * warps}


def run(target_name: str) -> list[dict]:
    from compile_tier.cases import OPS, build_specs
    from compile_tier.targets import TARGETS
    from compile_tier.worker import compile_kernel, specialize
    from triton.compiler import make_backend

    target = TARGETS[target_name]
    backend = type(make_backend(target.gpu_target()))
    api = _occupancy_api()
    records, seen = [], {}
    for spec in build_specs(target):
        module, name = spec.fn_name.split(":")
        fn = getattr(importlib.import_module(f"{OPS}.{module}"), name)
        signature, constexprs, attrs = specialize(fn, spec, backend)
        key = json.dumps([spec.fn_name, signature, {k: repr(v) for k, v in constexprs.items()},
                          {str(k): v for k, v in attrs.items()}, spec.options], sort_keys=True)
        if key not in seen:
            try:
                kernel, facts = compile_kernel(fn, target, signature, constexprs, attrs,
                                               spec.options)
                kernel._init_handles()  # loads it on the device: the driver's attributes
                driver = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                          "n_max_threads": getattr(kernel, "n_max_threads", None)}
                try:
                    driver.update(occupancy(kernel, target, api))
                except Exception as exc:  # noqa: BLE001 - where not obtainable, say why
                    driver["occupancy_source"] = f"{type(exc).__name__}: {exc}"[:300]
                seen[key] = (facts, driver)
            except Exception as exc:  # noqa: BLE001 - a failed compile or load is a result
                seen[key] = ({"error": f"{type(exc).__name__}: {exc}"[:1000]}, None)
        facts, driver = seen[key]
        records.append({"kernel": spec.kernel, "case": spec.case, "config": spec.config,
                        "facts": facts, "driver": driver})
    return records


def compare(device: dict, committed: dict | None) -> dict:
    """{"cases", "differences", "spills", "errors", "occupancy_differs", "rows"}:
    committed facts vs compiled here, spills (here or as the device reports),
    failed compiles / loads, and where the runtime's occupancy is not the facts'."""
    amd = str(device.get("target", "")).startswith("gfx")
    keys = AMD_KEYS if amd else CUDA_KEYS
    old = {(r["kernel"], r["case"]): r for r in (committed or {}).get("records", [])}
    rows, differences, spills, errors, occupancy_differs = [], [], [], [], []
    for rec in device.get("records", []):
        facts, driver = rec["facts"], rec.get("driver") or {}
        ref = old.get((rec["kernel"], rec["case"]))
        row = {"kernel": rec["kernel"], "case": rec["case"],
               "committed": {k: ref.get(k) for k in keys} if ref else None,
               "compiled_here": {k: facts.get(k) for k in keys}, "driver": driver}
        rows.append(row)
        name = f"{rec['kernel']}/{rec['case']}"
        if "error" in facts:
            errors.append(f"{name}: {facts['error']}")
            continue
        if ref is not None:
            diff = {k: (ref.get(k), facts.get(k)) for k in keys if ref.get(k) != facts.get(k)}
            if diff:
                differences.append({"case": name, "committed_vs_here": diff})
        if driver.get("n_spills") or facts.get("vgpr_spill") or facts.get("spill_stores"):
            spills.append(name)
        occ = "waves_per_simd" if amd else "warps_per_sm"
        if driver.get(occ) is not None and driver[occ] != facts.get(occ):
            occupancy_differs.append({"case": name, "facts": facts.get(occ),
                                      "runtime": driver[occ]})
    return {"target": device.get("target"), "triton": device.get("triton"),
            "committed_triton": (committed or {}).get("triton"), "cases": len(rows),
            "differences": differences, "spills": spills, "errors": errors,
            "occupancy_differs": occupancy_differs, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="validate_rocm.device_facts")
    p.add_argument("--target", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("device_facts: TRITON_INTERPRET must be unset", file=sys.stderr)
        return 2
    import torch
    import triton

    records = run(args.target)
    args.out.write_text(json.dumps({"target": args.target, "triton": triton.__version__,
                                    "device": torch.cuda.get_device_name(0),
                                    "records": records}, indent=1) + "\n")
    bad = sum(1 for r in records if "error" in r["facts"])
    print(f"[device-facts] {len(records)} cases of {args.target} compiled and loaded; "
          f"{bad} failed -> {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
