"""DeepSeek-V4's hyper-connections (mHC) in two kernels: the collapse before each block and
the update after it (ModelOps.hyper_collapse / hyper_update; the references are in
models/deepseek_v4/hyper.py).

Collapse, per token: the pre / post / comb gates from their float32 logits (sigmoid of
logit * scale + base), comb through Sinkhorn (a softmax over each row (+eps), then `iters`
column normalisations with a row normalisation before each but the first; N x N = 4 x 4 in
V4, in registers for all the iterations), and the block's input sum_j pre_j * streams_j. In
torch that is ~2 + 3 * (2 * iters - 1) launches for Sinkhorn alone plus ~12 for the gates and
the sum, twice a layer: at batch 1 most of a V4 decode step's launches
(benchmarks/cuda/profile_v4.py). Update: post_k * out + sum_j comb[j, k] * streams_j, five
launches in torch. Math in the reference's order and roundings.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 512  # hidden channels a program (or a loop step) handles


@triton.jit
def _collapse_kernel(Logits, Scale, Base, Streams, X, Post, Comb, hidden, iters, eps,
                     stride_l, stride_st, stride_sn, stride_x, N: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token: its pre / post / comb gates (comb through Sinkhorn) and the pre-weighted
    sum of its streams."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    row = Logits + t * stride_l
    ok = j < N
    pre = tl.load(row + j, mask=ok, other=0.0) * tl.load(Scale) + tl.load(Base + j, mask=ok)
    pre = tl.sigmoid(pre) + eps
    post = tl.load(row + N + j, mask=ok, other=0.0) * tl.load(Scale + 1) + \
        tl.load(Base + N + j, mask=ok)
    tl.store(Post + t * N + j, 2 * tl.sigmoid(post), mask=ok)
    r, c = j[:, None], j[None, :]
    cell = (r < N) & (c < N)
    x = tl.load(row + 2 * N + r * N + c, mask=cell, other=0.0) * tl.load(Scale + 2) + \
        tl.load(Base + 2 * N + r * N + c, mask=cell)
    x = tl.where(cell, x, float("-inf"))
    e = tl.where(cell, tl.exp(x - tl.max(x, 1)[:, None]), 0.0)
    comb = tl.where(cell, e / tl.sum(e, 1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, 1)[:, None] + eps)
        comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    tl.store(Comb + t * N * N + r * N + c, comb, mask=cell)
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + h[None, :]
        streams = tl.load(Streams + t * stride_st + r * stride_sn + cols,
                          mask=(r < N) & (cols < hidden), other=0.0).to(tl.float32)
        x_out = tl.sum(tl.where(ok, pre, 0.0)[:, None] * streams, 0)
        tl.store(X + t * stride_x + h0 + h, x_out.to(X.dtype.element_ty),
                 mask=h0 + h < hidden)


def hyper_collapse(logits: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor,
                   base: torch.Tensor, iters: int, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOps.hyper_collapse in one launch: logits float32 [T, (2+N)N], streams [T, N, H]
    -> (input [T, H] in the streams' dtype, post [T, N], comb [T, N, N] float32)."""
    tokens, n, hidden = streams.shape
    if logits.shape != (tokens, (2 + n) * n) or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [{tokens}, {(2 + n) * n}], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if streams.stride(-1) != 1 or logits.stride(-1) != 1:
        raise ValueError("streams and logits need a contiguous last dim")
    x = torch.empty((tokens, hidden), dtype=streams.dtype, device=streams.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=streams.device)
    if tokens:
        _collapse_kernel[(tokens,)](
            logits, scale, base, streams, x, post, comb, hidden, iters, float(eps),
            logits.stride(0), streams.stride(0), streams.stride(1), x.stride(0),
            N=n, BLOCK=triton.next_power_of_2(n), BLOCK_H=_BLOCK_H, num_warps=4)
    return x, post, comb


@triton.jit
def _update_kernel(Streams, Post, Comb, Out, New, hidden, stride_st, stride_sn, stride_o,
                   N: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's channels [h0, h0 + BLOCK_H) of every new stream k: post_k * out +
    sum_j comb[j, k] * streams_j, the gates rounded to the streams' dtype, each product and
    the sum rounded as the reference's dtype ops round them (the mix accumulates in float32,
    as the matmul does)."""
    t = tl.program_id(0).to(tl.int64)
    dtype = New.dtype.element_ty
    j = tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = j < N
    keep = cols < hidden
    comb = tl.load(Comb + t * N * N + j[:, None] * N + j[None, :],
                   mask=ok[:, None] & ok[None, :], other=0.0).to(dtype).to(tl.float32)
    streams = tl.load(Streams + t * stride_st + j[:, None] * stride_sn + cols[None, :],
                      mask=ok[:, None] & keep[None, :], other=0.0).to(tl.float32)
    # mixed[k, h] = sum_j comb[j, k] * streams[j, h]
    mixed = tl.sum(comb[:, :, None] * streams[:, None, :], 0).to(dtype).to(tl.float32)
    post = tl.load(Post + t * N + j, mask=ok, other=0.0).to(dtype).to(tl.float32)
    out = tl.load(Out + t * stride_o + cols, mask=keep, other=0.0).to(tl.float32)
    new = (post[:, None] * out[None, :]).to(dtype).to(tl.float32) + mixed
    tl.store(New + t * N * hidden + j[:, None] * hidden + cols[None, :], new.to(dtype),
             mask=ok[:, None] & keep[None, :])


def hyper_update(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 block_output: torch.Tensor) -> torch.Tensor:
    """ModelOps.hyper_update in one launch: a new [T, N, H] tensor of streams."""
    tokens, n, hidden = streams.shape
    if block_output.shape != (tokens, hidden) or block_output.dtype != streams.dtype:
        raise ValueError(f"block_output must be [{tokens}, {hidden}] {streams.dtype}, got "
                         f"{tuple(block_output.shape)} {block_output.dtype}")
    if streams.stride(-1) != 1 or block_output.stride(-1) != 1:
        raise ValueError("streams and block_output need a contiguous last dim")
    new = torch.empty((tokens, n, hidden), dtype=streams.dtype, device=streams.device)
    if tokens:
        _update_kernel[(tokens, triton.cdiv(hidden, _BLOCK_H))](
            streams, post.contiguous(), comb.contiguous(), block_output, new, hidden,
            streams.stride(0), streams.stride(1), block_output.stride(0),
            N=n, BLOCK=triton.next_power_of_2(n), BLOCK_H=_BLOCK_H, num_warps=4)
    return new
