"""DeepSeek-V4's hyper-connections (mHC) in two kernels: the collapse before each block and
the update after it (DeepSeekV4Ops.hyper_collapse / hyper_update; the references are in
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

from deepinfer.backends.cuda.kernels.tiles import rows_per_program

_BLOCK_H = 512  # hidden channels a program (or a loop step) handles


def _tokens_per_program(tokens: int, n: int) -> int:
    """One token a program on a GPU (the gates' reductions stay inside a warp); under the
    interpreter as many as fill its tile of [streams, _BLOCK_H] rows."""
    return rows_per_program(tokens, triton.next_power_of_2(n) * _BLOCK_H)


@triton.jit
def _collapse_kernel(Logits, Scale, Base, Streams, X, Post, Comb, tokens, hidden, iters, eps,
                     stride_l, stride_st, stride_sn, stride_x, N: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, TOKENS: tl.constexpr):
    """TOKENS tokens: their pre / post / comb gates (comb through Sinkhorn) and the
    pre-weighted sums of their streams."""
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None, None]
    r = tl.arange(0, BLOCK)[None, :, None]
    c = tl.arange(0, BLOCK)[None, None, :]
    live = t < tokens
    row = Logits + t * stride_l
    gate = live & (c < N)  # [TOKENS, 1, BLOCK]: the pre and post gates lie along c
    pre = tl.load(row + c, mask=gate, other=0.0) * tl.load(Scale) + \
        tl.load(Base + c, mask=c < N, other=0.0)
    pre = tl.where(gate, tl.sigmoid(pre) + eps, 0.0)
    post = tl.load(row + N + c, mask=gate, other=0.0) * tl.load(Scale + 1) + \
        tl.load(Base + N + c, mask=c < N, other=0.0)
    tl.store(Post + t * N + c, 2 * tl.sigmoid(post), mask=gate)
    cell = live & (r < N) & (c < N)
    x = tl.load(row + 2 * N + r * N + c, mask=cell, other=0.0) * tl.load(Scale + 2) + \
        tl.load(Base + 2 * N + r * N + c, mask=(r < N) & (c < N), other=0.0)
    x = tl.where(cell, x, float("-inf"))
    e = tl.where(cell, tl.exp(x - tl.max(x, 2)[:, :, None]), 0.0)
    comb = tl.where(cell, e / tl.sum(e, 2)[:, :, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, 2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    tl.store(Comb + t * N * N + r * N + c, comb, mask=cell)
    # The block's input: sum_j pre_j * streams_j; streams [TOKENS, j (along c), BLOCK_H].
    h = tl.arange(0, BLOCK_H)[None, :]
    pre2 = tl.reshape(pre, (TOKENS, BLOCK))  # [TOKENS, j]
    t2 = tl.reshape(t, (TOKENS, 1))
    for h0 in range(0, hidden, BLOCK_H):
        cols = (h0 + h)[:, None, :]  # [1, 1, BLOCK_H]
        j = tl.arange(0, BLOCK)[None, :, None]
        streams = tl.load(Streams + t * stride_st + j * stride_sn + cols,
                          mask=live & (j < N) & (cols < hidden), other=0.0).to(tl.float32)
        x_out = tl.sum(pre2[:, :, None] * streams, 1)  # [TOKENS, BLOCK_H]
        tl.store(X + t2 * stride_x + h0 + h, x_out.to(X.dtype.element_ty),
                 mask=(t2 < tokens) & (h0 + h < hidden))


def hyper_collapse(logits: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor,
                   base: torch.Tensor, iters: int, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeekV4Ops.hyper_collapse in one launch: logits float32 [T, (2+N)N], streams [T, N, H]
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
    per = _tokens_per_program(tokens, n)
    if tokens:
        _collapse_kernel[(triton.cdiv(tokens, per),)](
            logits, scale, base, streams, x, post, comb, tokens, hidden, iters, float(eps),
            logits.stride(0), streams.stride(0), streams.stride(1), x.stride(0),
            N=n, BLOCK=triton.next_power_of_2(n), BLOCK_H=_BLOCK_H, TOKENS=per, num_warps=4)
    return x, post, comb


@triton.jit
def _update_kernel(Streams, Post, Comb, Out, New, tokens, hidden, stride_st, stride_sn,
                   stride_o, N: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                   TOKENS: tl.constexpr):
    """TOKENS tokens' channels [h0, h0 + BLOCK_H) of every new stream k: post_k * out +
    sum_j comb[j, k] * streams_j, the gates rounded to the streams' dtype, each product and
    the sum rounded as the reference's dtype ops round them (the mix accumulates in float32
    over j in order, as the matmul does)."""
    dtype = New.dtype.element_ty
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None, None]
    k = tl.arange(0, BLOCK)[None, :, None]
    cols = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, None, :]
    live = t < tokens
    keep = live & (cols < hidden)
    mixed = tl.zeros([TOKENS, BLOCK, BLOCK_H], tl.float32)
    for j in tl.static_range(N):
        comb = tl.load(Comb + t * N * N + j * N + k, mask=live & (k < N), other=0.0)
        stream = tl.load(Streams + t * stride_st + j * stride_sn + cols, mask=keep, other=0.0)
        mixed += comb.to(dtype).to(tl.float32) * stream.to(tl.float32)
    post = tl.load(Post + t * N + k, mask=live & (k < N), other=0.0).to(dtype).to(tl.float32)
    out = tl.load(Out + t * stride_o + cols, mask=keep, other=0.0).to(tl.float32)
    new = (post * out).to(dtype).to(tl.float32) + mixed.to(dtype).to(tl.float32)
    tl.store(New + t * N * hidden + k * hidden + cols, new.to(dtype), mask=keep & (k < N))


def hyper_update(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 block_output: torch.Tensor) -> torch.Tensor:
    """DeepSeekV4Ops.hyper_update in one launch: a new [T, N, H] tensor of streams."""
    tokens, n, hidden = streams.shape
    if block_output.shape != (tokens, hidden) or block_output.dtype != streams.dtype:
        raise ValueError(f"block_output must be [{tokens}, {hidden}] {streams.dtype}, got "
                         f"{tuple(block_output.shape)} {block_output.dtype}")
    if streams.stride(-1) != 1 or block_output.stride(-1) != 1:
        raise ValueError("streams and block_output need a contiguous last dim")
    new = torch.empty((tokens, n, hidden), dtype=streams.dtype, device=streams.device)
    per = _tokens_per_program(tokens, n)
    if tokens:
        _update_kernel[(triton.cdiv(tokens, per), triton.cdiv(hidden, _BLOCK_H))](
            streams, post.contiguous(), comb.contiguous(), block_output, new, tokens, hidden,
            streams.stride(0), streams.stride(1), block_output.stride(0),
            N=n, BLOCK=triton.next_power_of_2(n), BLOCK_H=_BLOCK_H, TOKENS=per, num_warps=4)
    return new
