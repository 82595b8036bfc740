"""The AMD compile tier: the series' Triton kernels compiled for gfx942 and gfx950 on a CPU,
with their resource facts (docs/compile-tier.md)."""
