"""DeepSeekV4Ops: the ops DeepSeek-V4's layers call (mHC, its norms and rope, the compressors
and the compressed decode attention), with reference definitions. A backend that runs V4
inherits it beside ModelOps and MoEOps."""
from __future__ import annotations

from typing import Any

import torch

from deepinfer.models.deepseek_v4.attention import rope as v4_rope
from deepinfer.models.deepseek_v4.attention import v4_rms_norm
from deepinfer.models.deepseek_v4.decode_compress import decode_compress
from deepinfer.models.deepseek_v4.hyper import collapse_gates, update_streams
from deepinfer.models.deepseek_v4.paged_ops import (
    DecodeLens,
    DecodeTarget,
    PagedRows,
    decode_attention_reference,
    indexer_topk_reference,
)


class DeepSeekV4Ops:
    """DeepSeek-V4's ops; the references are the model's own torch code."""

    def hyper_collapse(self, logits: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor,
                       base: torch.Tensor, iters: int, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V4's mHC collapse from its gate logits float32 [T, (2+N)N]: the pre, post
        and comb gates (comb through Sinkhorn's `iters` normalisations) and the block's input
        sum_j pre_j * streams_j -> (input [T, H], post [T, N], comb [T, N, N]) (reference:
        deepseek_v4/hyper.collapse_gates)."""
        return collapse_gates(logits, streams, scale, base, iters, eps)

    def hyper_update(self, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     block_output: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4's mHC update: new streams [T, N, H] = post * block_output + comb^T @
        streams, in the streams' dtype (reference: deepseek_v4/hyper.update_streams)."""
        return update_streams(streams, post, comb, block_output)

    def v4_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
        """DeepSeek-V4's norms over the last dim, in x's dtype: with a float32 weight, weight
        times the float32 normalized x, rounded once; without, x times its reciprocal rms
        rounded to x's dtype (reference: deepseek_v4/attention.py)."""
        return v4_rms_norm(x, weight, eps)

    def interleaved_rope(self, x: torch.Tensor, positions: torch.Tensor,
                         inv_freq: torch.Tensor, scaling: float,
                         inverse: bool = False) -> torch.Tensor:
        """DeepSeek-V4's rope: the trailing 2 * len(inv_freq) channels of x [T, ..., D] rotated
        in interleaved pairs at positions [T], cos/sin rounded to x's dtype (inverse: sin
        negated); a new tensor (reference: deepseek_v4/attention.rope)."""
        return v4_rope(x, positions, inv_freq, scaling, inverse)

    def compressor_decode(self, comp: Any, kv: torch.Tensor, gate: torch.Tensor,
                          positions: torch.Tensor, target: DecodeTarget) -> None:
        """One DeepSeek-V4 compressor (deepseek_v4/compressor.Compressor) at a decode step:
        kv, gate [B, width] projected rows of the tokens at positions [B] advance each
        sequence's state slot; a token that closes its window writes the pooled, normed,
        roped entry, and one that ends a page the carry-over (reference:
        deepseek_v4/decode_compress.py)."""
        decode_compress(comp, kv, gate, positions, target)

    def compressed_decode_attention(self, q: torch.Tensor, window: PagedRows,
                                    entries: PagedRows | None, picks: torch.Tensor | None,
                                    lens: DecodeLens, sinks: torch.Tensor, sliding_window: int,
                                    scale: float) -> torch.Tensor:
        """DeepSeek-V4 decode attention, one query per sequence q [B, H, D] (roped; keys are
        the values): softmax over its last `sliding_window` K=V vectors in `window`, the
        compressed entries it sees in `entries` (picks [B, k] entry numbers, -1 none; None:
        every entry w < seq_len // rate) and one sink logit per head. Returns [B, H, D]."""
        return decode_attention_reference(q, window, entries, picks, lens, sinks,
                                          sliding_window, scale)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: PagedRows,
                     lens: DecodeLens, topk: int, scale: float) -> torch.Tensor:
        """DeepSeek-V4's Lightning indexer for one query per sequence: index queries
        q [B, heads, d], head weights [B, heads] fp32, paged index keys -> the top
        min(topk, most entries) entry numbers [B, k] by sum_h w * ReLU(q_h . key) * scale
        over the entries the query sees, -1 past a sequence's count."""
        return indexer_topk_reference(q, weights, keys, lens, topk, scale)

