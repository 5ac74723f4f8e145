"""DeepSeek-V4's rope in one kernel: the trailing rope channels of every head rotated in
interleaved pairs, the leading channels copied, cos/sin computed from the position in the
kernel.

The reference (models/deepseek_v4/attention.rope) builds the cos/sin table in float32, rounds
it to the activations' dtype, rotates in float32 and rounds once; as torch ops that is ~20
launches an application, and a V4 layer applies it up to six times a step (q, the K=V vector,
the output's inverse rotation, each compressor's entries, the index queries). Here one program
rotates BLOCK_H heads of one token (of several under the interpreter) with the same roundings.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.kernels.tiles import rows_per_program

_TILE = 8192  # elements a program holds (heads x head_dim)


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, y_ptr, n_tokens, n_heads, sx_t, sx_h, sy_t, sy_h,
                 scaling, NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, TOKENS: tl.constexpr, BLOCK_H: tl.constexpr,
                 INVERSE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see pdl.py
        gdc_launch_dependents()
        gdc_wait()
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None, None]
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
    rows = (t < n_tokens) & (heads < n_heads)
    x_row = x_ptr + t * sx_t + heads * sx_h
    y_row = y_ptr + t * sy_t + heads * sy_h
    if NOPE > 0:
        cols = tl.arange(0, BLOCK_NOPE)[None, None, :]
        keep = rows & (cols < NOPE)
        tl.store(y_row + cols, tl.load(x_row + cols, mask=keep), mask=keep)
    pair = tl.arange(0, BLOCK_HALF)[None, None, :]
    ok = rows & (pair < HALF)
    position = tl.load(pos_ptr + t, mask=t < n_tokens, other=0).to(tl.float32)
    angle = position * tl.load(freq_ptr + pair, mask=pair < HALF)
    dtype = y_ptr.dtype.element_ty
    cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
    if INVERSE:
        sin = -sin
    even = tl.load(x_row + NOPE + 2 * pair, mask=ok).to(tl.float32)
    odd = tl.load(x_row + NOPE + 2 * pair + 1, mask=ok).to(tl.float32)
    tl.store(y_row + NOPE + 2 * pair, (even * cos - odd * sin).to(dtype), mask=ok)
    tl.store(y_row + NOPE + 2 * pair + 1, (odd * cos + even * sin).to(dtype), mask=ok)


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     scaling: float, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, heads, D] (contiguous last dim), positions [T] int, inv_freq float32
    [R/2] -> a new tensor with the trailing R channels of every head rotated."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    if x3.dim() != 3 or x3.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] or [T, heads, D] with a contiguous last dim, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    tokens, heads, d = x3.shape
    half = inv_freq.shape[0]
    if 2 * half > d:
        raise ValueError(f"{2 * half} rope channels do not fit in head_dim {d}")
    out = torch.empty_like(x3, memory_format=torch.contiguous_format)
    if tokens and heads:
        nope = d - 2 * half
        block_d = triton.next_power_of_2(d)
        block_h = min(triton.next_power_of_2(heads), max(1, _TILE // block_d))
        per = rows_per_program(tokens, block_h * block_d)
        _rope_kernel[(triton.cdiv(tokens, per), triton.cdiv(heads, block_h))](
            x3, positions, inv_freq.float().contiguous(), out, tokens, heads, x3.stride(0),
            x3.stride(1), out.stride(0), out.stride(1), float(scaling),
            NOPE=nope, HALF=half, BLOCK_NOPE=triton.next_power_of_2(max(nope, 1)),
            BLOCK_HALF=triton.next_power_of_2(half), TOKENS=per, BLOCK_H=block_h,
            INVERSE=inverse, num_warps=4, **launch_kwargs(x3.device))
    return out.view(x.shape)
