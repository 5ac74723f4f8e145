// DecodeLayers (decode_layers.cpp): a llama-family stack's decode step in one call.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// A projection's weight: GGUF blocks as the GEMV takes them (qtype >= 0), a float32 [N, K]
// weight for at::linear (qtype kFloatWeight: a tensor the loader dequantized), or row ranges
// of several GGUF types side by side (qtype kParts: `parts`, a GGUFParts' GGUFWeights); and
// its bias, if it has one (Qwen2's q|k|v).
struct Projection {
  static constexpr int64_t kFloatWeight = -1;
  static constexpr int64_t kParts = -2;
  at::Tensor weight;
  int64_t qtype;
  bool interleaved;
  std::optional<at::Tensor> bias;
  std::vector<Projection> parts;
};

class DecodeLayers {
 public:
  DecodeLayers(double eps, int64_t heads, int64_t kv_heads, int64_t head_dim);
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, Projection qkv,
                 Projection o, Projection gate_up, Projection down, const at::Tensor& k_cache,
                 const at::Tensor& v_cache);
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, const at::Tensor& positions,
                                         const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& new_slots, const at::Tensor& slots,
                                         const at::Tensor& lens) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    Projection qkv, o, gate_up, down;
    at::Tensor k_cache, v_cache;
  };
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  std::vector<Layer> layers_;
};
