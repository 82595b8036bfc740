"""End-to-end ROCm recipes: ``cli`` (scripts/e2e.py), ``mixed_batch`` (the order-contract case)."""
