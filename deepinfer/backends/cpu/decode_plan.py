"""A decode step of a llama-family stack as one C++ call (decode_layers.cpp).

At batch 1 the embedded default's 30 layers cost ~1.3 ms of Python a token around ~5 ms of
kernels on two cores. A stack of plain llama layers (Qwen2's biases too) runs instead as the
same native ops, in the same order, called from C++: the same bits, without a Python frame per
op. Its projections may be GGUF blocks (of one type, or a fused q|k|v of several: GGUFParts)
or float32 weights (a float32 model). CPUOps.decoder_layers
builds the plan on a stack's first such step and uses it for decode steps of up to 16
sequences in float32; anything else (q/k norms, sliding windows, bfloat16, FP8, MoE, prefill)
runs layer by layer.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.models.decoder import DecoderLayer, GatedMLP
from deepinfer.models.llama import LlamaAttention
from deepinfer.models.quant.packed import GGUFParts, GGUFWeight


def build(kernels: Any, layers: Sequence[nn.Module], cache: PagedCache) -> Any | None:
    """The stack's kernels.DecodeLayers, or None where a layer is not one it runs."""
    if not layers or not all(_runs(layer, layers[0]) for layer in layers) \
            or len(cache.spec.groups) != 1 or cache.layer(0)[0].dtype != torch.float32:
        return None
    dims = layers[0].self_attn.dims
    plan = kernels.DecodeLayers(layers[0].eps, dims.num_heads, dims.num_kv_heads, dims.head_dim)
    for layer in layers:
        linears = [_projection(kernels, p.weight, p.bias) for p in _projections(layer)]
        plan.add_layer(layer.input_layernorm, layer.post_attention_layernorm, *linears,
                       *cache.layer(layer.self_attn.layer))
    return plan


def _projection(kernels: Any, weight: nn.Module | torch.Tensor,
                bias: torch.Tensor | None) -> Any:
    if isinstance(weight, GGUFParts):
        return kernels.Projection.of_parts([_projection(kernels, p, None) for p in weight.parts],
                                           bias)
    if isinstance(weight, GGUFWeight):
        return kernels.Projection(weight.blocks, weight.qtype, bool(weight.interleaved), bias)
    return kernels.Projection(weight, kernels.Projection.FLOAT_WEIGHT, False, bias)


def _projections(layer: DecoderLayer) -> list[nn.Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _runs(layer: nn.Module, first: nn.Module) -> bool:
    """A llama layer as LlamaAttention and GatedMLP run it (biases or not) with no q/k norm,
    full attention, GGUF or float32 projections and float32 norms, shaped as the stack's
    first."""
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not LlamaAttention or \
            type(layer.mlp) is not GatedMLP:
        return False
    attn, dims = layer.self_attn, layer.self_attn.dims
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return dims == first.self_attn.dims and layer.eps == first.eps and not dims.qk_norm and \
        dims.windows[attn.layer] is None and all(_projectable(p) for p in _projections(layer)) \
        and all(_float32(n) for n in norms)


def _projectable(proj: nn.Linear) -> bool:
    weight = proj.weight
    return (isinstance(weight, (GGUFWeight, GGUFParts)) or
            _float32(weight) and weight.dim() == 2) and \
        (proj.bias is None or _float32(proj.bias))


def _float32(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous()
