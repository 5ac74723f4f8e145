"""DeepSeek-V4's Lightning indexer at decode: score every compressed index key a query sees,
then keep the top k.

score(b, s) = sum_h w[b, h] * ReLU(q[b, h] . key_s) * scale over the sequence's index keys
s < seq_len // rate (the query sits at seq_len - 1), -inf past them. One program scores
BLOCK_N keys of one sequence for all index heads at once (the heads are the rows of one
matrix), so each key is read once: the kernel streams the sequence's index keys, the part of
the selection that grows with the context. The selection itself is torch.topk over the
[B, max entries] scores, and nothing at all where no sequence can have more than k entries.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda.kernels.compressed_decode import _entry_rows
from deepinfer.backends.cuda.settings import interpreted

_MIN_DOT = 16


@triton.jit
def _index_scores_kernel(
    Q, W, Keys, Tables, SeqLens, Out,
    stride_qb, stride_qh, stride_wb, stride_kt, stride_tb, stride_ob, width, scale,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, RATE: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = idx < tl.load(SeqLens + b) // RATE
    rows = _entry_rows(Tables + b.to(tl.int64) * stride_tb, idx, valid, BLOCK_SIZE, RATE)
    offs_d = tl.arange(0, DIM)
    keys = tl.load(Keys + rows[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None],
                   other=0.0)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    w = tl.load(W + b * stride_wb + heads, mask=head_ok, other=0.0)
    s = tl.dot(q, tl.trans(keys).to(q.dtype), input_precision=PRECISION)
    scores = tl.sum(tl.maximum(s, 0.0) * scale * w[:, None], 0)
    tl.store(Out + b * stride_ob + idx, tl.where(valid, scores, float("-inf")),
             mask=idx < width)


def _block_n() -> int:
    return 16 if interpreted() else 64


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, width: int, rate: int,
                 block_size: int, scale: float) -> torch.Tensor:
    """q [B, heads, d] roped index queries, weights [B, heads] fp32, keys [rows, d] paged
    index keys with tables [B, W], seq_lens int32 [B] -> fp32 scores [B, width]."""
    batch, heads, dim = q.shape
    if dim < _MIN_DOT or dim & (dim - 1):
        raise ValueError(f"index_head_dim must be a power of two >= 16, got {dim}")
    out = torch.empty((batch, width), dtype=torch.float32, device=q.device)
    if batch == 0 or width == 0:
        return out
    block_n = _block_n()
    weights = weights.float().contiguous()
    _index_scores_kernel[(batch, triton.cdiv(width, block_n))](
        q, weights, keys, tables, seq_lens, out,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), tables.stride(0),
        out.stride(0), width, scale,
        HEADS=heads, BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(heads)), DIM=dim,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, RATE=rate,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, rate: int,
                 block_size: int, topk: int, scale: float) -> torch.Tensor:
    """The top min(topk, max entries) entry numbers [B, k] (long) by index_scores, -1 for
    picks past a sequence's own entry count (it has fewer than k)."""
    width = max_seq_len // rate
    k = min(topk, width)
    if k == 0:
        return torch.zeros(q.shape[0], 0, dtype=torch.long, device=q.device)
    counts = torch.div(seq_lens, rate, rounding_mode="floor").to(torch.long)
    if k == width:
        # Every entry a sequence has is among its top k: no score decides anything. Picks in
        # entry order (the order transformers' masked attention sums them in).
        picks = torch.arange(width, device=q.device).expand(q.shape[0], width)
        return picks.masked_fill(picks >= counts[:, None], -1)
    scores = index_scores(q, weights, keys, tables, seq_lens, width, rate, block_size, scale)
    picks = scores.topk(k, dim=-1).indices
    return picks.masked_fill(picks >= counts[:, None], -1)
