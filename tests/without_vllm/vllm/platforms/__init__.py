"""GPU tier stand-in for vllm.platforms.current_platform (tests/without_vllm/README.md).

The few methods the series' kernel files call, as the pinned tree defines them:
ROCm (vllm/platforms/rocm.py) prefers e4m3fnuz when the GPU is gfx94x
(``is_fp8_fnuz``: ``"gfx94" in`` the arch name), every other platform e4m3fn
(vllm/platforms/interface.py); ``num_compute_units`` is the device's
multiprocessor count on CUDA and ROCm (vllm/platforms/cuda.py, rocm.py).
"""

import functools

import torch


class _GPUPlatform:
    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cuda(self) -> bool:
        return torch.version.cuda is not None and torch.version.hip is None

    @functools.cache
    def is_fp8_fnuz(self) -> bool:
        if not self.is_rocm():
            return False
        return "gfx94" in torch.cuda.get_device_properties(0).gcnArchName

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.is_fp8_fnuz() else torch.float8_e4m3fn

    def num_compute_units(self, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count


current_platform = _GPUPlatform()
