// Python binding for the benchmark baseline: vLLM's CUDA merge_attn_states
// (csrc/attention/merge_attn_states.cu of the pinned tree, compiled at
// benchmark time by benchmarks/eager_ops.py), the merge upstream's AITER FA
// extend path runs on CDNA3 and newer.  The kernel file takes stable-ABI
// tensors; this wraps ATen tensors into owning stable handles and forwards.
#include <torch/extension.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>

// Defined in the pinned csrc/attention/merge_attn_states.cu.
void merge_attn_states(
    torch::stable::Tensor& output,
    std::optional<torch::stable::Tensor> output_lse,
    const torch::stable::Tensor& prefix_output,
    const torch::stable::Tensor& prefix_lse,
    const torch::stable::Tensor& suffix_output,
    const torch::stable::Tensor& suffix_lse,
    const std::optional<int64_t> prefill_tokens_with_context,
    const std::optional<torch::stable::Tensor>& output_scale);

namespace {

torch::stable::Tensor to_stable(const at::Tensor& t) {
  // A new owning handle to the same storage; released with the stable Tensor.
  return torch::stable::Tensor(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
}

void merge(const at::Tensor& output, const std::optional<at::Tensor>& output_lse,
           const at::Tensor& prefix_output, const at::Tensor& prefix_lse,
           const at::Tensor& suffix_output, const at::Tensor& suffix_lse) {
  auto o = to_stable(output), po = to_stable(prefix_output),
       pl = to_stable(prefix_lse), so = to_stable(suffix_output),
       sl = to_stable(suffix_lse);
  std::optional<torch::stable::Tensor> ol;
  if (output_lse.has_value()) ol = to_stable(*output_lse);
  merge_attn_states(o, ol, po, pl, so, sl, std::nullopt, std::nullopt);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("merge_attn_states", &merge, "vLLM's CUDA merge_attn_states (benchmark baseline)",
        pybind11::arg("output"), pybind11::arg("output_lse"), pybind11::arg("prefix_output"),
        pybind11::arg("prefix_lse"), pybind11::arg("suffix_output"),
        pybind11::arg("suffix_lse"));
}
