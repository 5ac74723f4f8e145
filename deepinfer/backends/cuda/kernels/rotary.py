"""NeoX-style rotary embedding applied in place to q and k.

One program per token: it reads the token's cos/sin row once and rotates all of its q heads,
then all of its k heads, as [BLOCK_H, BLOCK_HALF] tiles of the two halves of the first `rot`
dims (dims >= rot are left alone). Math is fp32; the reference rounds cos/sin to the activation
dtype first, so bf16 results agree within bf16 rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one half-tile: a token's heads are rotated in (unrolled) chunks of this many.
_TILE = 4096


@triton.jit
def _rotate_heads(base, stride_h, n_heads, cos1, cos2, sin1, sin2, cols, half,
                  BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr):
    col_mask = cols < half
    for chunk in tl.static_range(CHUNKS):
        heads = chunk * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < n_heads) & col_mask
        p1 = base + heads * stride_h + cols
        p2 = p1 + half
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        # out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        tl.store(p1, (x1 * cos1 - x2 * sin1).to(base.dtype.element_ty), mask=mask)
        tl.store(p2, (x2 * cos2 + x1 * sin2).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, n_q, n_k, half,
                   sq_t, sq_h, sk_t, sk_h, s_cos, s_sin,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   CHUNKS_Q: tl.constexpr, CHUNKS_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_mask = cols < half
    cos_row = cos_ptr + pos * s_cos + cols
    sin_row = sin_ptr + pos * s_sin + cols
    cos1 = tl.load(cos_row, mask=col_mask, other=0.0)
    cos2 = tl.load(cos_row + half, mask=col_mask, other=0.0)
    sin1 = tl.load(sin_row, mask=col_mask, other=0.0)
    sin2 = tl.load(sin_row + half, mask=col_mask, other=0.0)
    _rotate_heads(q_ptr + t * sq_t, sq_h, n_q, cos1, cos2, sin1, sin2, cols, half,
                  BLOCK_HQ, CHUNKS_Q)
    _rotate_heads(k_ptr + t * sk_t, sk_h, n_k, cos1, cos2, sin1, sin2, cols, half,
                  BLOCK_HK, CHUNKS_K)


def _check(name: str, x: torch.Tensor, tokens: int, rot: int) -> None:
    if x.dim() != 3 or x.shape[0] != tokens or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T={tokens}, heads, D] with a contiguous last dim, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if rot > x.shape[-1]:
        raise ValueError(f"rotary dims {rot} exceed {name}'s head dim {x.shape[-1]}")


def _heads_block(heads: int, block_half: int) -> int:
    return max(1, min(triton.next_power_of_2(heads), _TILE // block_half))


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (strided views are fine) by the rows
    cos[positions], sin[positions] of float32 tables [max_positions, rot], rot <= D even."""
    if positions.dim() != 1 or (positions.numel() > 1 and positions.stride(0) != 1):
        raise ValueError("positions must be a contiguous 1-D tensor (the kernel reads it as a "
                         "flat array)")
    tokens = positions.shape[0]
    rot = cos.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or rot % 2:
        raise ValueError(f"cos/sin must be [max_positions, even rot], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin must have a contiguous last dim")
    _check("q", q, tokens, rot)
    _check("k", k, tokens, rot)
    if tokens == 0:
        return
    half = rot // 2
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = _heads_block(q.shape[1], block_half), _heads_block(k.shape[1], block_half)
    # 4 warps for 32 heads of 64-dim halves: on an H200, 2-4 warps beat 8 by ~10%.
    warps = max(1, min(8, block_hq * block_half // 512))
    _rotary_kernel[(tokens,)](q, k, positions, cos, sin, q.shape[1], k.shape[1], half,
                              q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), sin.stride(0),
                              BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
                              CHUNKS_Q=triton.cdiv(q.shape[1], block_hq),
                              CHUNKS_K=triton.cdiv(k.shape[1], block_hk), num_warps=warps)
