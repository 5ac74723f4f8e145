"""The pre-norm residual block every supported family uses: attention, then MLP, each after an
RMSNorm, with the residual stream carried beside the hidden states so each residual add fuses
into the next norm (ops.add_rms_norm)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.models.ops import ModelOps


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
