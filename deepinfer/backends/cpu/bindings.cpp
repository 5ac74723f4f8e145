// The CPU backend's extension: GGUF matmuls (gguf_kernels.cpp) and fused decode ops
// (fused_ops.cpp).
#include <torch/extension.h>

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype);
torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, int64_t k);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& w, double eps);
void rotary(torch::Tensor q, torch::Tensor k, const torch::Tensor& positions,
            const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& slots,
                               const torch::Tensor& lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x [M<=16, K] float32 @ GGUF weight.T");
  m.def("dequantize", &dequantize, "GGUF weight -> float32 [N, K]");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("rotary", &rotary, "NeoX rotary of q and k in place");
  m.def("decode_attention", &decode_attention, "one query per sequence over paged K/V");
}
