// Stand-in for the pinned vLLM tree's csrc/torch_utils.h, used only to build
// vLLM's concat_and_cache_mla_rope_fused (csrc/cache_kernels_fused.cu) as a
// benchmark baseline with torch.utils.cpp_extension.  The pinned header also
// wraps a cuBLAS-handle shim that the benchmark machine's torch lacks; the
// fused kernel only needs the stable Tensor / DeviceGuard types and the
// current CUDA stream, which this header provides.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cuda_runtime.h>

#include <string>

#ifndef STD_TORCH_CHECK_NOT_IMPLEMENTED
  #define STD_TORCH_CHECK_NOT_IMPLEMENTED(cond, ...) \
    STD_TORCH_CHECK(cond, "NotImplementedError: ", __VA_ARGS__)
#endif

// The stream torch has current for device_index (-1: the current device);
// inside CUDA-graph capture this is the capturing stream.
inline cudaStream_t get_current_cuda_stream(int32_t device_index = -1) {
  void* stream = nullptr;
  const AOTITorchError err =
      aoti_torch_get_current_cuda_stream(device_index, &stream);
  STD_TORCH_CHECK(err == AOTI_TORCH_SUCCESS,
                  "aoti_torch_get_current_cuda_stream failed");
  return reinterpret_cast<cudaStream_t>(stream);
}
