// Python binding for the benchmark baseline: vLLM's CUDA
// concat_and_cache_mla_rope_fused, compiled from the pinned tree at benchmark
// time (benchmarks/bench_mla_rope_cache.py).  The kernel file takes stable-ABI
// tensors; this wraps ATen tensors into owning stable handles and forwards.
#include <torch/extension.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/stable/tensor.h>

#include <string>

// Defined in the pinned csrc/cache_kernels_fused.cu.
void concat_and_cache_mla_rope_fused(
    torch::stable::Tensor& positions, torch::stable::Tensor& q_pe,
    torch::stable::Tensor& k_pe, torch::stable::Tensor& kv_c,
    torch::stable::Tensor& rope_cos_sin_cache, bool rope_is_neox,
    torch::stable::Tensor& slot_mapping, torch::stable::Tensor& kv_cache,
    const std::string& kv_cache_dtype,
    torch::stable::Tensor& kv_cache_quant_scale);

namespace {

torch::stable::Tensor to_stable(const at::Tensor& t) {
  // A new owning handle to the same storage; released with the stable Tensor.
  return torch::stable::Tensor(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
}

void rope_fused(const at::Tensor& positions, const at::Tensor& q_pe,
                const at::Tensor& k_pe, const at::Tensor& kv_c,
                const at::Tensor& cos_sin_cache, bool is_neox,
                const at::Tensor& slot_mapping, const at::Tensor& kv_cache,
                const std::string& kv_cache_dtype, const at::Tensor& scale) {
  auto p = to_stable(positions), q = to_stable(q_pe), k = to_stable(k_pe),
       c = to_stable(kv_c), cs = to_stable(cos_sin_cache),
       s = to_stable(slot_mapping), kc = to_stable(kv_cache),
       sc = to_stable(scale);
  concat_and_cache_mla_rope_fused(p, q, k, c, cs, is_neox, s, kc,
                                  kv_cache_dtype, sc);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("concat_and_cache_mla_rope_fused", &rope_fused,
        "vLLM's CUDA fused MLA RoPE + KV-cache write (benchmark baseline)");
}
