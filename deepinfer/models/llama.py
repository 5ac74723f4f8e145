"""The llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over backend ops.

Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); the loader
maps the checkpoint's separate tensors into their slices. Every projection goes through
ops.linear, so a backend can route the one-token (decode) case to a GEMV kernel.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.models.model_config import ModelConfig
from deepinfer.models.ops import ModelOps
from deepinfer.models.rope import rope_cos_sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: ModelOps) -> None:
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: Any) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        tokens = hidden.shape[0]
        qkv = ops.linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        out = ops.rotary_attention(q, k, v, positions, cos, sin, self.layer, meta)
        return ops.linear(out.reshape(tokens, self.q_size), self.o_proj.weight)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight)),
                          self.down_proj.weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: ModelOps) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.self_attn = LlamaAttention(cfg, layer, ops)
        self.mlp = LlamaMLP(cfg, ops)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, meta: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_layernorm, eps)
        else:
            hidden, residual = self.ops.add_rms_norm(hidden, residual, self.input_layernorm, eps)
        hidden = self.self_attn(positions, hidden, cos, sin, meta)
        hidden, residual = self.ops.add_rms_norm(hidden, residual,
                                                 self.post_attention_layernorm, eps)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelOps, max_model_len: int) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_cos_sin(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, max_model_len)
        # Tables are built in float32; the backend casts them to the activation dtype.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.rope_cos, self.rope_sin, meta)
        hidden, _ = self.ops.add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()
