"""The end-to-end ROCm recipes (``scripts/e2e.py``, docs/sweeps-and-e2e.md): ``cli`` runs
them, ``mixed_batch`` is the order-contract case an install's Python runs."""
