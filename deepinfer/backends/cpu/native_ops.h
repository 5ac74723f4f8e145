// The extension's native ops (gguf_kernels.cpp, fused_ops.cpp), declared once for the files
// that call them: bindings.cpp binds them, decode_layers.cpp calls them in a layer's order.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype, bool interleaved);
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t k, bool interleaved);
at::Tensor dequantize_bf16(const at::Tensor& w, int64_t qtype, int64_t k,
                           bool interleaved);
at::Tensor gguf_mlp(const at::Tensor& x, const at::Tensor& gate_up, int64_t gate_up_type,
                    bool gate_up_interleaved, const at::Tensor& down, int64_t down_type,
                    bool down_interleaved);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps);
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& new_slots,
                            const at::Tensor& slots, const at::Tensor& lens, double scale);
at::Tensor rotary_decode_attention(at::Tensor q, at::Tensor k, const at::Tensor& v,
                                   const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                                   const at::Tensor& new_slots, const at::Tensor& slots,
                                   const at::Tensor& lens, double scale);
