"""GPU tier stand-in for vllm.utils.platform_utils (tests/without_vllm/README.md)."""

from functools import cache

from vllm.platforms import current_platform


@cache
def num_compute_units(device_id: int = 0) -> int:
    return current_platform.num_compute_units(device_id)
