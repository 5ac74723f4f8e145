// The CPU backend's extension: GGUF matmuls (gguf_kernels.cpp) and fused decode ops
// (fused_ops.cpp).
// pybind11 and torch's tensor casters only, not <torch/extension.h> (all of libtorch's C++ API):
// the build's time is mostly headers.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_layers.h"
#include "native_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x [M<=16, K] float32 @ GGUF weight.T (rows interleaved by 8 or not)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("interleaved") = false);
  m.def("dequantize", &dequantize, "GGUF weight -> float32 [N, K]", py::arg("w"),
        py::arg("qtype"), py::arg("k"), py::arg("interleaved") = false);
  m.def("dequantize_bf16", &dequantize_bf16, "GGUF weight -> bfloat16 [N, K]", py::arg("w"),
        py::arg("qtype"), py::arg("k"), py::arg("interleaved") = false);
  m.def("gguf_mlp", &gguf_mlp, "down(silu(gate) * up) over GGUF weights, x [M<=16, K]");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("rotary", &rotary, "NeoX rotary of q and k in place");
  m.def("decode_attention", &decode_attention,
        "the step's K/V into the cache, then one query per sequence over it");
  m.def("rotary_decode_attention", &rotary_decode_attention,
        "rotary of q and k in place, then decode_attention");
  py::class_<Projection>(m, "Projection")
      .def(py::init<at::Tensor, int64_t, bool, std::optional<at::Tensor>>(), py::arg("weight"),
           py::arg("qtype"), py::arg("interleaved"), py::arg("bias") = py::none())
      .def_static("of_parts",
                  [](std::vector<Projection> parts, std::optional<at::Tensor> bias) {
                    return Projection{at::Tensor(), Projection::kParts, false, std::move(bias),
                                      std::move(parts)};
                  },
                  "row ranges of several GGUF types side by side", py::arg("parts"),
                  py::arg("bias") = py::none())
      .def_readonly_static("FLOAT_WEIGHT", &Projection::kFloatWeight);
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<double, int64_t, int64_t, int64_t>(), py::arg("eps"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"))
      .def("add_layer", &DecodeLayers::add_layer)
      .def("run", &DecodeLayers::run,
           "(hidden, residual) after every layer's decode step (decode_layers.cpp)")
      .def_property_readonly("num_layers", &DecodeLayers::num_layers);
}
