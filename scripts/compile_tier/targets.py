"""The AMD compile targets, and ``DEVICES``: the one table of hardware specifications, each
cited, that occupancy and the AMD roofline (docs/roofline-amd.md) read."""

from __future__ import annotations

from dataclasses import dataclass

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
}


@dataclass(frozen=True)
class Target:
    """One AMD compile target: a Triton ``GPUTarget`` plus the device whose limits apply."""

    name: str  # gfx942 | gfx950 (also GPUTarget.arch)
    device: str  # key of DEVICES
    fp8_e4m3: str  # the target's native e4m3 torch dtype (name)
    warp_size: int = 64

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("hip", self.name, self.warp_size)


TARGETS = {
    "gfx942": Target("gfx942", "MI300X", "float8_e4m3fnuz"),
    "gfx950": Target("gfx950", "MI355X", "float8_e4m3fn"),
}

