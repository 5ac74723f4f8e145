"""What every supported family shares: the causal LM body (DecoderStack), the gated MLP,
and the pre-norm residual block: attention, then MLP, each after an
RMSNorm, with the residual stream carried beside the hidden states so each residual add fuses
into the next norm (ops.add_rms_norm)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.moe.runtime import ExpertRuntime
from deepinfer.models.ops import ModelOps
from deepinfer.models.rope import rope_cos_sin
from deepinfer.models.traits import ModelTraits
from deepinfer.models.weights import Embedding


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 ops: ModelOps) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = nn.Parameter(torch.ones(hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden_size))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, meta: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = self.ops.add_rms_norm(hidden, residual, self.input_layernorm,
                                                     self.eps)
        hidden = self.self_attn(positions, hidden, cos, sin, meta)
        hidden, residual = self.ops.add_rms_norm(hidden, residual,
                                                 self.post_attention_layernorm, self.eps)
        return self.mlp(hidden), residual


class GatedMLP(nn.Module):
    """silu(gate) * up -> down, gate and up fused into one matmul (llama's and DeepSeek's dense
    MLP); the checkpoint's separate gate/up tensors load into fused_rows(0) / fused_rows(1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: ModelOps,
                 bias: bool = False) -> None:
        super().__init__()
        self.ops, self.intermediate_size = ops, intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        return self.ops.gated_mlp(x, gate_up.weight, down.weight, gate_up.bias, down.bias)

    def fused_rows(self, shard: int) -> tuple[int, int]:
        f = self.intermediate_size
        return (shard * f, (shard + 1) * f)


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm and LM head: the causal LM body every family
    shares. A family builds its layers and declares its KV spec, checkpoint names and traits."""

    traits = ModelTraits()

    def __init__(self, config: Any, ops: ModelOps, max_model_len: int, vocab_size: int,
                 hidden_size: int, eps: float, tie_word_embeddings: bool,
                 layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.config, self.ops, self.max_model_len, self.eps = config, ops, max_model_len, eps
        self.embed_tokens = Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(torch.ones(hidden_size))
        self.lm_head = None if tie_word_embeddings else nn.Linear(hidden_size, vocab_size,
                                                                  bias=False)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.moe: ExpertRuntime | None = None  # a family with MoE layers sets its runtime

    def _moe_traits(self, runtime: ExpertRuntime | None, *ops: type) -> ModelTraits:
        """The class's traits, with MoEOps among the needed ops when the config has experts."""
        needed = ops + ((MoEOps,) if runtime is not None else ())
        return dataclasses.replace(type(self).traits, ops=needed)

    @property
    def needs_collectives(self) -> bool:
        """MoE layers exchange tokens with the other ranks in every forward."""
        return self.moe is not None and self.moe.exchange is not None

    def init_rope(self, rotary_dim: int, device: torch.device | str) -> None:
        """Rotary tables, computed (not loaded) in float32; the backend casts them."""
        cos, sin = rope_cos_sin(self.config, rotary_dim, self.max_model_len)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        fused = self.ops.decoder_layers(self.layers, positions, hidden, self.rope_cos,
                                        self.rope_sin, meta)
        if fused is not None:
            hidden, residual = fused
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, self.rope_cos,
                                         self.rope_sin, meta)
        hidden, _ = self.ops.add_rms_norm(hidden, residual, self.norm, self.eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()
