"""Kernel tests: every test starts with empty launch caches.

The MLA wrapper caches what it derives from checked arguments per launch key
(vllm/v1/attention/ops/triton_launcher.py); tests that monkeypatch a module's
tuning constants must not find launches derived from the defaults.  (fetch_kv
and paged_context_attention keep theirs in the step's plan / workspace.)
"""

import pytest
from vllm.v1.attention.ops import triton_launcher


@pytest.fixture(autouse=True)
def _empty_launch_caches():
    triton_launcher.clear_caches()
    yield
    triton_launcher.clear_caches()
