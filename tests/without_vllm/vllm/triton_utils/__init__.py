"""GPU tier stand-in for vllm.triton_utils: the real Triton (tests/without_vllm/README.md)."""

import triton
import triton.language as tl

HAS_TRITON = True

__all__ = ["HAS_TRITON", "tl", "triton"]
