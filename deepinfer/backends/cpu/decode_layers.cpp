// A llama-family decoder stack's decode step as one call: each layer's native ops (the
// norms, the GGUF GEMVs, rotary + paged decode attention, the gated MLP) in the order and
// with the arguments the model's Python gives them one by one, so the results are the same
// to the bit. At batch 1 a small model's layer costs ~45 us of Python around ~150 us of
// kernels (SmolLM2-135M on two cores); here the Python runs once a step, not once a layer.
// The CPU backend builds a DecodeLayers for a stack it recognises (decode_plan.py): llama
// layers without q/k norms, projections of GGUF blocks (of one type, or row ranges of
// several: a Q4_K_M file's q|k|v) or float32 weights, one full-attention KV group. Anything
// else takes the Python path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <tuple>
#include <vector>

#include "decode_layers.h"
#include "native_ops.h"

namespace {

// ops.linear's paths: a float weight through F.linear (its bias inside), GGUF blocks through
// the GEMV, parts of several types through one GEMV each, concatenated; then + bias
// (CPUOps.packed_linear).
at::Tensor project(const at::Tensor& x, const Projection& w) {
  if (w.qtype == Projection::kFloatWeight) return at::linear(x, w.weight, w.bias);
  at::Tensor y;
  if (w.qtype == Projection::kParts) {
    std::vector<at::Tensor> rows;
    for (const Projection& part : w.parts) rows.push_back(project(x, part));
    y = at::cat(rows, -1);
  } else {
    y = gemv(x, w.weight, w.qtype, w.interleaved);
  }
  return w.bias ? at::add(y, *w.bias) : y;
}

// ops.gated_mlp: one call where both weights are GGUF blocks of one type each without biases
// (CPUOps.gated_mlp), else the reference's linear, silu(gate) * up, linear.
at::Tensor gated_mlp(const at::Tensor& x, const Projection& gate_up, const Projection& down) {
  if (gate_up.qtype >= 0 && down.qtype >= 0 && !gate_up.bias && !down.bias) {
    return gguf_mlp(x, gate_up.weight, gate_up.qtype, gate_up.interleaved, down.weight,
                    down.qtype, down.interleaved);
  }
  const at::Tensor h = project(x, gate_up);
  const int64_t f = h.size(-1) / 2;
  return project(at::mul(at::silu(h.narrow(-1, 0, f)), h.narrow(-1, f, f)), down);
}

}  // namespace

DecodeLayers::DecodeLayers(double eps, int64_t heads, int64_t kv_heads, int64_t head_dim)
    : eps_(eps), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {}

void DecodeLayers::add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm,
                             Projection qkv, Projection o, Projection gate_up, Projection down,
                             const at::Tensor& k_cache, const at::Tensor& v_cache) {
  layers_.push_back({input_norm, post_norm, std::move(qkv), std::move(o), std::move(gate_up),
                     std::move(down), k_cache, v_cache});
}

// DecoderLayer.forward, LlamaAttention.forward and GatedMLP.forward for every layer: hidden
// [T, H] from the embedding; returns (hidden, residual) for the final norm.
std::tuple<at::Tensor, at::Tensor> DecodeLayers::run(
    at::Tensor hidden, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& new_slots, const at::Tensor& slots, const at::Tensor& lens) const {
  const int64_t tokens = hidden.size(0), q_size = heads_ * head_dim_;
  const int64_t kv_size = kv_heads_ * head_dim_;
  const double scale = std::pow(static_cast<double>(head_dim_), -0.5);  // as Python's
  at::Tensor residual;
  for (const Layer& layer : layers_) {
    at::Tensor h;
    if (!residual.defined()) {
      residual = hidden;
      h = rms_norm(hidden, layer.input_norm, eps_);
    } else {
      std::tie(h, residual) = add_rms_norm(hidden, residual, layer.input_norm, eps_);
    }
    const at::Tensor qkv = project(h, layer.qkv);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads_, head_dim_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                             .view({tokens, kv_heads_, head_dim_});
    const at::Tensor out = rotary_decode_attention(q, k, v, positions, cos, sin, layer.k_cache,
                                                   layer.v_cache, new_slots, slots, lens, scale);
    std::tie(h, residual) = add_rms_norm(project(out.reshape({tokens, q_size}), layer.o),
                                         residual, layer.post_norm, eps_);
    hidden = gated_mlp(h, layer.gate_up, layer.down);
  }
  return {hidden, residual};
}
