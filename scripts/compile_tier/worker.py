"""One compile worker: ``python -m compile_tier.worker TARGET CACHE OUT`` (one target per
process: Triton 3.6 compiling gfx942 and then gfx950 in one process breaks e4m3fnuz on
gfx950).  Each spec is specialised as Triton's JIT would, keyed, and its facts read from the
cache or compiled and parsed from the amdgcn text (docs/compile-tier.md)."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

from .cases import build_specs
from .targets import DEVICES, TARGETS, Target

# Version of the facts' format: part of every cache key, so a change invalidates the cache.
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


def amd_memory_ops(asm: str) -> dict[str, dict[int, int]]:
    """{"load": {bytes: count}, "store": {...}} over global_* and buffer_* ops."""
    ops = {"load": Counter(), "store": Counter()}
    for kind, suffix in _AMD_MEM.findall(asm):
        width = _AMD_WIDTH.get(suffix.removesuffix("_d16").removesuffix("_d16_hi"))
        if width is not None:
            ops[kind][width] += 1
    return {k: dict(sorted(v.items())) for k, v in ops.items()}


def amd_waves_per_simd(target: Target, llvm_occupancy: int, lds_bytes: int,
                       num_warps: int) -> int:
    """LLVM's register-bound occupancy, capped by LDS: Triton allocates LDS at launch, which
    the ``; Occupancy`` comment does not see; a workgroup of ``num_warps`` waves spread over
    the CU's SIMDs fits ``LDS per CU // lds_bytes`` times."""
    if lds_bytes == 0:
        return llvm_occupancy
    device = DEVICES[target.device]
    groups = device["lds_bytes_per_cu"] // lds_bytes
    return min(llvm_occupancy, groups * num_warps // device["simds_per_cu"])


def amd_facts(target: Target, asm: str, lds_bytes: int, num_warps: int) -> dict:
    f = {}
    for name, pattern in _AMD_FIELDS.items():
        found = re.findall(pattern, asm)
        if len(found) != 1:
            raise ValueError(f"expected one {name} in the compiler output, found {found!r}")
        f[name] = int(found[0])
    f["lds_bytes"] = lds_bytes + f.pop("static_lds_bytes")
    f["waves_per_simd"] = amd_waves_per_simd(target, f["llvm_occupancy"], f["lds_bytes"], num_warps)
    f["spills"] = f["vgpr_spill"] > 0 or f["scratch_bytes"] > 0
    f["memory_ops"] = amd_memory_ops(asm)
    return f


def specialize(fn, spec, backend):
    """(signature, constexprs, attrs) of one launch, as the JIT computes them."""
    from triton._C.libtriton import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in spec.constexprs:
            signature[name] = "constexpr"
            constexprs[name] = spec.constexprs[name]
            continue
        kp = fn.params[i]
        ty, attr = native_specialize_impl(backend, spec.args[name], kp.is_const,
                                          not kp.do_not_specialize,
                                          not kp.do_not_specialize_on_alignment)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = spec.args[name]
        elif attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return signature, constexprs, attrs


def run_target(target_name: str, cache: Path) -> list[dict]:
    """One record (kernel, case, config, expect, key, cached, facts) per spec; a failed
    compile is a result (its error), not cached."""
    import triton
    from triton.compiler import ASTSource, make_backend

    target = TARGETS[target_name]
    backend = type(make_backend(target.gpu_target()))
    records = []
    for spec in build_specs(target):
        signature, constexprs, attrs = specialize(spec.fn, spec, backend)
        blob = json.dumps(dict(
            source=spec.fn.cache_key, target=target.name, signature=signature,
            constexprs={k: repr(v) for k, v in constexprs.items()},
            attrs={str(k): v for k, v in attrs.items()}, options=spec.options,
            triton=triton.__version__, facts=FACTS_VERSION,
        ), sort_keys=True)
        key = hashlib.sha256(blob.encode()).hexdigest()
        path = cache / key[:2] / f"{key}.json"
        cached = path.is_file()
        if cached:
            facts = json.loads(path.read_text())
        else:
            try:
                kernel = triton.compile(ASTSource(spec.fn, signature, constexprs, attrs),
                                        target=target.gpu_target(), options=spec.options)
                facts = amd_facts(target, kernel.asm["amdgcn"], kernel.metadata.shared,
                                  spec.options["num_warps"])
            except Exception as exc:  # noqa: BLE001
                facts = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".tmp").write_text(json.dumps(facts, sort_keys=True))
                path.with_suffix(".tmp").replace(path)  # a killed worker leaves no half file
            print(f"{target_name}: compiled {spec.kernel} {spec.case}", file=sys.stderr, flush=True)
        records.append(dict(
            target=target.name, kernel=spec.kernel, case=spec.case, config=spec.config,
            expect=spec.expect, key=key, cached=cached, facts=facts,
        ))
    return records


if __name__ == "__main__":
    target_name, cache, out = sys.argv[1:4]
    Path(out).write_text(json.dumps(run_target(target_name, Path(cache))))
