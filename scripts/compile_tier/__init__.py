"""The AMD compile tier: the series' Triton kernels compiled for gfx942, gfx950
and sm_90 on a CPU, with their resource facts (docs/compile-tier.md)."""
