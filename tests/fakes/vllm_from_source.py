"""What the test tiers' vLLM (a source tree, not an installed package) cannot detect.

The CPU tier imports the patched tree from PYTHONPATH; ``make test-gpu-backend``
imports its pruned copy (.gpu_payload).  Neither has package metadata or a
compiled extension, so vLLM detects neither Triton nor a platform there:
``vllm/triton_utils/importing.py`` sets ``HAS_TRITON`` False (no GPU driver, or
``version("vllm")`` not found) and binds placeholders in ``vllm.triton_utils``, and
``vllm/platforms/__init__.py`` falls back to ``UnspecifiedPlatform``, whose
``num_compute_units`` raises.  The series' kernel files take ``triton`` / ``tl``
from ``vllm.triton_utils`` and the compute-unit count from
``vllm.utils.platform_utils`` as upstream's do; ``bind()`` gives them, before any
kernel module is imported, the real Triton (run by ``TRITON_INTERPRET=1`` on the
CPU, compiled on a GPU) and, on a GPU only, the device's multiprocessor count.
``HAS_TRITON`` and the platform's class stay as vLLM computed them.  Test
processes only (tests/conftest.py, the CPU engine runners).
"""

from __future__ import annotations

from importlib.util import find_spec


def bind() -> bool:
    """Bind the real Triton (and, on a GPU, the compute-unit count); True if it did."""
    if find_spec("vllm") is None or find_spec("triton") is None or find_spec("torch") is None:
        return False
    import torch
    import triton
    import triton.language as tl

    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        return False
    triton_utils.triton, triton_utils.tl = triton, tl
    from vllm.platforms import current_platform
    from vllm.platforms.interface import UnspecifiedPlatform

    if torch.cuda.is_available() and isinstance(current_platform, UnspecifiedPlatform):
        type(current_platform).num_compute_units = classmethod(
            lambda cls, device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count)
    return True
