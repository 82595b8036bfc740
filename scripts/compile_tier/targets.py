"""The compile targets, and ``DEVICES``: the one table of hardware specifications that the
compile tier (occupancy) and the AMD roofline (docs/roofline-amd.md) read, each cited."""

from __future__ import annotations

from dataclasses import dataclass

# Vendor specifications, each with its source (waves per SIMD on AMD come from LLVM's own
# occupancy, which knows each target's limits).
_ROCM_SPECS = ("ROCm: AMD GPU specifications",
               "https://rocm.docs.amd.com/en/latest/reference/gpu-specs.html")
DEVICES = {
    "MI300X": dict(
        arch="gfx942",
        compute_units=304,
        lds_bytes_per_cu=64 * 1024,
        simds_per_cu=4,
        hbm_bytes_per_s=5.3e12,
        bf16_dense_flops=1307.4e12,
        sources={
            "CUs, LDS": _ROCM_SPECS,
            "HBM, bf16": ("AMD Instinct MI300X data sheet",
                          "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/"
                          "data-sheets/amd-instinct-mi300x-data-sheet.pdf"),
        },
    ),
    "MI355X": dict(
        arch="gfx950",
        compute_units=256,
        lds_bytes_per_cu=160 * 1024,
        simds_per_cu=4,
        hbm_bytes_per_s=8.0e12,
        bf16_dense_flops=2.5e15,
        sources={
            "CUs, LDS": _ROCM_SPECS,
            "HBM, bf16": ("AMD Instinct MI355X GPU",
                          "https://www.amd.com/en/products/accelerators/instinct/mi350/"
                          "mi355x.html"),
        },
    ),
    "H100/H200 (sm_90)": dict(
        arch="sm_90",
        registers_per_sm=65536,
        register_alloc_unit=256,  # registers per warp are allocated in these units
        max_warps_per_sm=64,
        max_blocks_per_sm=32,
        smem_bytes_per_sm=228 * 1024,
        smem_reserved_per_block=1024,
        sources={
            "limits": ("CUDA C++ Programming Guide, technical specifications per compute "
                       "capability (9.0)",
                       "https://docs.nvidia.com/cuda/cuda-c-programming-guide/"
                       "#features-and-technical-specifications"),
        },
    ),
}


@dataclass(frozen=True)
class Target:
    """One compile target: a Triton ``GPUTarget`` plus the device whose limits apply."""

    name: str  # gfx942 | gfx950 | sm_90
    backend: str  # hip | cuda
    arch: str | int  # GPUTarget.arch
    warp_size: int
    device: str  # key of DEVICES
    fp8_e4m3: str  # the target's native e4m3 torch dtype (name)

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)

    @property
    def spec(self) -> dict:
        return DEVICES[self.device]

    @property
    def amd(self) -> bool:
        return self.backend == "hip"


TARGETS = {
    t.name: t
    for t in (
        Target("gfx942", "hip", "gfx942", 64, "MI300X", "float8_e4m3fnuz"),
        Target("gfx950", "hip", "gfx950", 64, "MI355X", "float8_e4m3fn"),
        Target("sm_90", "cuda", 90, 32, "H100/H200 (sm_90)", "float8_e4m3fn"),
    )
}


def amd_waves_per_simd(target: Target, llvm_occupancy: int, lds_bytes: int,
                       num_warps: int) -> int:
    """Waves per SIMD: LLVM's register-bound occupancy, capped by LDS.

    Triton allocates LDS dynamically at launch, so the ``; Occupancy`` comment
    of the amdgcn text (registers, waves-per-EU attributes) does not see it: a
    workgroup of ``num_warps`` waves spread over the CU's SIMDs fits
    ``LDS per CU // lds_bytes`` times.
    """
    spec = target.spec
    waves = llvm_occupancy
    if lds_bytes > 0:
        groups = spec["lds_bytes_per_cu"] // lds_bytes
        waves = min(waves, groups * num_warps // spec["simds_per_cu"])
    return waves


def cuda_warps_per_sm(target: Target, regs_per_thread: int, smem_bytes: int,
                      num_warps: int) -> int:
    """Resident warps per SM from registers, shared memory and the block limits."""
    spec = target.spec
    unit = spec["register_alloc_unit"]
    regs_per_warp = -(-regs_per_thread * target.warp_size // unit) * unit
    blocks = min(
        spec["max_blocks_per_sm"],
        spec["max_warps_per_sm"] // num_warps,
        (spec["registers_per_sm"] // max(regs_per_warp, 1)) // num_warps,
        spec["smem_bytes_per_sm"] // (smem_bytes + spec["smem_reserved_per_block"]),
    )
    return blocks * num_warps
