"""The llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) and its MoE members
(Mixtral, Qwen3-MoE) over backend ops.

Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); the model
maps the checkpoint's separate tensors into their slices. Every projection goes through
ops.linear, so a backend can route the one-token (decode) case to a GEMV kernel. Layers with a
sliding window (Mistral's `sliding_window`, `layer_types`) declare it in the KV spec, and the
backend's attention honours it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from deepinfer.core.kv.spec import KVSpec, kv_heads_layer
from deepinfer.models.decoder import DecoderLayer, DecoderStack, GatedMLP
from deepinfer.models.moe.configs import llama_family_moe, moe_runtime
from deepinfer.models.moe.layer import MoEBlock, moe_checkpoint_target
from deepinfer.models.ops import ModelOps, QKNorm
from deepinfer.models.weight_targets import Target
from deepinfer.models.weights import load_mapped

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class LlamaDims:
    """The config fields the model reads, normalised across the family's configs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "LlamaDims":
        heads = config.num_attention_heads
        model_type = getattr(config, "model_type", "llama")
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without a config field saying so.
            attention_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"), windows=layer_windows(config))


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Per layer, its sliding window: `layer_types` where the config has them, else one window
    for every layer (Mistral), else none."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return (None,) * layers
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (int(window),) * layers


class LlamaAttention(nn.Module):
    def __init__(self, dims: LlamaDims, layer: int, ops: ModelOps) -> None:
        super().__init__()
        self.dims, self.layer, self.ops = dims, layer, ops
        self.q_size = dims.num_heads * dims.head_dim
        self.kv_size = dims.num_kv_heads * dims.head_dim
        self.qkv_proj = nn.Linear(dims.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=dims.attention_bias)
        self.o_proj = nn.Linear(self.q_size, dims.hidden_size, bias=False)
        if dims.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(dims.head_dim))
            self.k_norm = nn.Parameter(torch.ones(dims.head_dim))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: Any) -> torch.Tensor:
        d, ops = self.dims, self.ops
        tokens = hidden.shape[0]
        qkv = ops.linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, d.num_heads, d.head_dim)
        k = k.view(tokens, d.num_kv_heads, d.head_dim)
        v = v.view(tokens, d.num_kv_heads, d.head_dim)
        qk_norm = QKNorm(self.q_norm, self.k_norm, d.rms_norm_eps) if d.qk_norm else None
        out = ops.rotary_attention(q, k, v, positions, cos, sin, self.layer, meta, qk_norm)
        return ops.linear(out.reshape(tokens, self.q_size), self.o_proj.weight)

    def fused_rows(self, shard: int) -> tuple[int, int]:
        q, kv = self.q_size, self.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]


class LlamaForCausalLM(DecoderStack):
    def __init__(self, config: PretrainedConfig, ops: ModelOps, max_model_len: int) -> None:
        self.dims = d = LlamaDims.from_config(config)
        moe, sparse = llama_family_moe(config)
        runtime = moe_runtime(moe, sparse, ops)
        mlps = [MoEBlock(moe, sum(sparse[:i]), ops, runtime) if sparse[i]
                else GatedMLP(d.hidden_size, d.intermediate_size, ops) for i in range(d.num_layers)]
        layers = [DecoderLayer(LlamaAttention(d, i, ops), mlps[i], d.hidden_size, d.rms_norm_eps,
                               ops) for i in range(d.num_layers)]
        super().__init__(config, ops, max_model_len, d.vocab_size, d.hidden_size, d.rms_norm_eps,
                         d.tie_word_embeddings, layers)
        self.moe = runtime
        self.traits = self._moe_traits(runtime)

    def kv_spec(self) -> KVSpec:
        d = self.dims
        return KVSpec(tuple(kv_heads_layer(d.num_kv_heads, d.head_dim, w) for w in d.windows))

    def init_buffers(self, device: torch.device | str) -> None:
        self.init_rope(int(self.dims.head_dim * _partial_rotary(self.config)), device)
        if self.moe is not None:
            self.moe.to(device)

    # ---- checkpoint names ----------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped(self, weights, self.checkpoint_target)

    def checkpoint_target(self, name: str) -> Target | list[Target] | None:
        """HF checkpoint name -> (our parameter, rows of a fused one); None to skip."""
        name = name.removeprefix("model.")
        if name.startswith("lm_head."):
            return None if self.lm_head is None else (name, None)
        if name == "norm.weight":
            return "norm", None
        moe = moe_checkpoint_target(self.layers, name)
        if moe is not None:
            return moe
        match = re.match(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$", name)
        if match is None:
            return _layer_norm_target(name)
        layer, block, proj, kind = match.groups()
        if proj in ("q_norm", "k_norm"):
            return f"layers.{layer}.self_attn.{proj}", None
        if proj not in _FUSED:
            return f"layers.{layer}.{block}.{proj}.{kind}", None
        fused, shard = _FUSED[proj]
        module = getattr(self.layers[int(layer)], block)
        return f"layers.{layer}.{block}.{fused}.{kind}", module.fused_rows(shard)


def _layer_norm_target(name: str) -> Target | None:
    if "rotary_emb" in name:
        return None
    match = re.match(r"(layers\.\d+\.(?:input|post_attention)_layernorm)\.weight$", name)
    return (match.group(1), None) if match else (name, None)


def _partial_rotary(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor",
                            getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
