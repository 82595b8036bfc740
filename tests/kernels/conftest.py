"""Kernel tests: every test starts with empty launch caches.

The wrappers cache what they derive from checked arguments per launch key
(vllm/v1/attention/ops/triton_launcher.py); tests that monkeypatch a module's
tuning constants must not find launches derived from the defaults.
"""

import pytest
from vllm.v1.attention.ops import triton_launcher


@pytest.fixture(autouse=True)
def _empty_launch_caches():
    triton_launcher.clear_caches()
    yield
    triton_launcher.clear_caches()
