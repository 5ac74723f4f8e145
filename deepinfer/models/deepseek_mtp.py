"""DeepSeek-V3's multi-token-prediction (MTP) layer: the draft of speculative decoding.

At position p it reads the main model's final hidden state h_p and the embedding of the next
token t_{p+1}, and predicts t_{p+2}:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]);  x = block(x);  logits = head(norm(x))

`block` is one more decoder layer of the same kind (MLA, MoE past first_k_dense_replace) with
its own KV layer, declared after the decoder's in the model's KV spec. Fed its own output (the
hidden state before the norm, and its argmax token) it drafts further tokens, as vLLM applies
one MTP layer again when asked for more drafts than the checkpoint has layers.

Checkpoint names: `model.layers.{num_hidden_layers}.` + `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, `embed_tokens` and the block's usual names. Only the
first MTP layer is served (DeepSeek-V3 and R1 have one).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.models.decoder import DecoderLayer
from deepinfer.models.moe.runtime import ExpertRuntime
from deepinfer.models.ops import ModelOps
from deepinfer.models.weights import Embedding

# checkpoint name inside the MTP layer -> our parameter (the rest belongs to the block)
MTP_NAMES = {"enorm.weight": "enorm", "hnorm.weight": "hnorm",
             "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "head_norm",
             "shared_head.head.weight": "head.weight",
             "embed_tokens.weight": "embed_tokens.weight"}


class DeepseekMTP(nn.Module):
    def __init__(self, block: DecoderLayer, vocab_size: int, hidden_size: int, eps: float,
                 ops: ModelOps, moe: ExpertRuntime | None) -> None:
        super().__init__()
        self.ops, self.eps, self.moe = ops, eps, moe
        self.embed_tokens = Embedding(vocab_size, hidden_size)
        self.enorm = nn.Parameter(torch.ones(hidden_size))
        self.hnorm = nn.Parameter(torch.ones(hidden_size))
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.head_norm = nn.Parameter(torch.ones(hidden_size))
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                previous: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """input_ids [T]: the token after each position; previous [T, H]: the hidden state
        that predicted it. Returns the hidden state before the head's norm."""
        if self.moe is not None:
            self.moe.begin_step(input_ids.shape[0], input_ids.shape[0])
        ops = self.ops
        embeds = self.embed_tokens(input_ids)
        # vLLM zeroes the embedding at position 0; done alike so drafts match its proposals.
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        joined = torch.cat((ops.rms_norm(embeds, self.enorm, self.eps),
                            ops.rms_norm(previous, self.hnorm, self.eps)), dim=-1)
        hidden = ops.linear(joined, self.eh_proj.weight)
        hidden, residual = self.block(positions, hidden, None, cos, sin, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.ops.rms_norm(hidden, self.head_norm, self.eps)
        return self.ops.linear(normed, self.head.weight).float()
