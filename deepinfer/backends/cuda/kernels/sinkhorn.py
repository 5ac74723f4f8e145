"""mHC's Sinkhorn normalisation (DeepSeek-V4's hyper-connections) in one kernel.

Per token an N x N matrix (N = hc_mult, 4 in V4): a softmax over each row (+eps), then `iters`
column normalisations with a row normalisation before each but the first. In torch that is
~2 + 3 * (2 * iters - 1) launches of a few hundred bytes each, twice per layer: at batch 1
about half of an eager V4 decode step's launches (benchmarks/cuda/profile_v4.py). Here the
matrices stay in registers for all the iterations. Math is float32, in the reference's order
(models/deepseek_v4/hyper.py `sinkhorn`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program: enough work per program at prefill, one program at batch 1.
_TOKENS = 32


@triton.jit
def _sinkhorn_kernel(X, Y, tokens, iters, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                     TOKENS: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None, None]
    r = tl.arange(0, BLOCK)[None, :, None]
    c = tl.arange(0, BLOCK)[None, None, :]
    mask = (t < tokens) & (r < N) & (c < N)
    offs = t.to(tl.int64) * N * N + r * N + c
    x = tl.load(X + offs, mask=mask, other=float("-inf"))
    e = tl.where(mask, tl.exp(x - tl.max(x, 2)[:, :, None]), 0.0)
    comb = tl.where(mask, e / tl.sum(e, 2)[:, :, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, 2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    tl.store(Y + offs, comb, mask=mask)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits float32 [T, N, N] -> the normalised matrices, float32 [T, N, N]."""
    if logits.dim() != 3 or logits.shape[1] != logits.shape[2] or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [T, N, N], got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    x = logits.contiguous()
    out = torch.empty_like(x)
    tokens, n = x.shape[0], x.shape[1]
    if tokens:
        _sinkhorn_kernel[(triton.cdiv(tokens, _TOKENS),)](
            x, out, tokens, iters, float(eps), N=n, BLOCK=triton.next_power_of_2(n),
            TOKENS=_TOKENS, num_warps=4)
    return out
