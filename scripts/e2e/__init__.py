"""End-to-end recipes for ROCm machines: ``scripts/e2e.py``; see scripts/e2e/README.md.

Every recipe runs for each vLLM install it is given (upstream and patched: two
virtual environments or two images, each named by the command that runs its
Python), after a preflight that stops at once, with one message listing what is
missing, on a machine without ROCm torch, AITER or the AMD SMI tools.

Modules:
  * ``installs``    -- an install (command + env), the env vars a run records;
  * ``preflight``   -- the fail-fast checks (host and each install);
  * ``recipes``     -- throughput, mixed, serve, gsm8k; the results JSON;
  * ``mixed_batch`` -- run by an install's Python: the order-contract case;
  * ``cli``         -- the command line.
Standard library only: the recipes drive vLLM through the installs' own Pythons.
"""
