"""End-to-end recipes for ROCm machines (``scripts/e2e.py``): see docs/sweeps-and-e2e.md."""
