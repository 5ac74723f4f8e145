"""DeepSeek-V4's multi-token-prediction (MTP) layer: the draft of speculative decoding.

As DeepSeek's release runs it (its inference code's MTPBlock): at position p the layer reads
the main model's residual streams h_p [N, H] (before the hyper head) and the embedding of the
next token t_{p+1}, and predicts t_{p+2}:

    x = e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(h_p))   (e_proj's row added to each stream)
    x = block(x)                                              (one more V4 decoder layer)
    logits = head(norm(hc_head(x)))                           (its own hyper head and norm)

The embedding and the LM head are the main model's (the release stores no copies). `block`
is a sliding-window layer (the release's compress_ratios gives it 0: no compressor, no
indexer, so no state to rewind) with a learned-routing MoE and its own expert runtime; its
window is one more spec layer, in the model's window group. Fed its own output streams, it
drafts further tokens.

Checkpoint names, `mtp.0.` then: e_proj, h_proj, enorm, hnorm, norm, hc_head_{fn,base,scale}
(ours: `OWN_NAMES`) and the block's own in any spelling a decoder layer loads (the release's
attn.wq_a, hc_attn_fn, ffn.experts.{e}.w1; transformers' self_attn.q_a_proj, attn_hc.fn, ...):
model.py renames `mtp.0.` to the layer index after the decoder's and places them here.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from deepinfer.models.deepseek_v4.attention import SLIDING, RMSNorm, UsesOps
from deepinfer.models.deepseek_v4.block import Placement, V4DecoderLayer
from deepinfer.models.deepseek_v4.hyper import HyperDims, HyperHead
from deepinfer.models.moe.configs import deepseek_v4_moe, moe_runtime
from deepinfer.models.moe.layer import MoEBlock
from deepinfer.models.ops import ModelOps

# checkpoint name inside `mtp.0.` -> our parameter under `mtp.` (the rest is the block's)
OWN_NAMES = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
             "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
             "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


def grown_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config with the MTP layer as layer L: a sliding-window layer, learned MoE."""
    grown = copy.copy(config)
    grown.num_hidden_layers = config.num_hidden_layers + 1
    grown.layer_types = [*config.layer_types, SLIDING]
    grown.mlp_layer_types = [*config.mlp_layer_types, "moe"]
    return grown


class V4MTP(UsesOps, nn.Module):
    def __init__(self, config: PretrainedConfig, ops: ModelOps, window_layer: int) -> None:
        super().__init__()
        if not getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError("this checkpoint has no multi-token-prediction layer "
                             "(num_nextn_predict_layers is 0); speculative decoding needs one")
        grown, index, h = grown_config(config), config.num_hidden_layers, config.hidden_size
        dims = deepseek_v4_moe(grown)[index]
        self.moe = moe_runtime(dims, (True,), ops)
        self.block = V4DecoderLayer(grown, index, ops, MoEBlock(dims, 0, ops, self.moe),
                                    Placement(window_layer, None, 0))
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.hc_head = HyperHead(HyperDims.from_config(config), ops)

    def forward(self, embeds: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                previous: torch.Tensor, paged) -> torch.Tensor:
        """embeds [T, H] of the tokens after each position, previous [T, N, H] the streams
        that predicted them -> the layer's output streams [T, N, H]."""
        if self.moe is not None:
            self.moe.begin_step(token_ids.shape[0], token_ids.shape[0])
        t, n, h = previous.shape
        e = self.linear(self.e_proj, self.enorm(embeds))
        x = self.linear(self.h_proj, self.hnorm(previous.reshape(t * n, h))).view(t, n, h)
        return self.block(x + e[:, None], token_ids, positions, paged)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, N, H] -> what the LM head reads [T, H]."""
        return self.norm(self.hc_head(streams))
