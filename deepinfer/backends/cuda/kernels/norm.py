"""RMSNorm and fused residual-add + RMSNorm.

One program normalizes every row of one token (of several under the interpreter): x is [T, H] (one
row a token) or [T, heads, D] (Qwen3's per-head q/k norm, one row a head; x is then a strided view
of a fused qkv output). The rows of a token form a [BLOCK_H, BLOCK_D] tile held in registers, so
each element is read and written once. Numerics follow deepinfer.backends.torch.ops: the residual
sum is rounded to x.dtype before the norm reads it, statistics are fp32, and the normalized value
is rounded to x.dtype before the weight multiplies it. DeepSeek-V4's norms (`v4_rms_norm`,
models/deepseek_v4/attention.py) round differently: the float32 weight multiplies the float32
normalized value and the product is rounded once; its unweighted q norm multiplies x by the
reciprocal rms rounded to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.kernels.tiles import rows_per_program

# Elements per program tile: beyond this the heads of one token spread over several programs.
_TILE = 8192


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, n_tokens, n_heads, d, eps,
                     sx_t, sx_h, sr_t, sr_h, sy_t, sy_h,
                     HAS_RESIDUAL: tl.constexpr, TOKENS: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr, MODE: tl.constexpr = 0):
    cols = tl.arange(0, BLOCK_D)[None, None, :]
    if MODE != 2:  # the weight is written by no kernel: requested before the wait
        w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    # int64: token * stride can pass 2**31 in large batches
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None, None]
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
    mask = (t < n_tokens) & (heads < n_heads) & (cols < d)
    x_ptrs = x_ptr + t * sx_t + heads * sx_h + cols
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = r_ptr + t * sr_t + heads * sr_h + cols
        summed = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32))
        summed = summed.to(x_ptr.dtype.element_ty)
        tl.store(r_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)  # the norm reads the sum as rounded to the activation dtype
    var = tl.sum(x * x, axis=2) / d
    # Correctly rounded 1/sqrt (one per row, so free) to match torch.rsqrt bit for bit.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))[:, :, None]
    if MODE == 2:  # V4 unweighted: x times the reciprocal rounded to x's dtype
        y = x * rstd.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        normed = x * rstd
        if MODE == 0:  # rounded before the weight (the CPU backend's order)
            normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = normed * w
    tl.store(y_ptr + t * sy_t + heads * sy_h + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must be [T, H] or [T, heads, D], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, strides {x.stride()}")
    return x.unsqueeze(1) if x.dim() == 2 else x


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
            out: torch.Tensor, eps: float, mode: int = 0) -> None:
    x3, y3 = _as_3d(x, "x"), _as_3d(out, "out")
    r3 = _as_3d(residual, "residual") if residual is not None else x3
    tokens, heads, d = x3.shape
    if weight is None:  # unweighted (mode 2): the pointer is never read
        weight = x3
    elif weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{d}], got {tuple(weight.shape)}")
    if tokens == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(heads), max(1, _TILE // block_d))
    # ~4 16-byte vectors per thread: on an H200 4 warps for 4096 elements ran at ~3 TB/s at
    # T=4096, and 16 warps were slower at every width tried (2048 to 8192).
    warps = max(1, min(8, block_h * block_d // 1024))
    per = rows_per_program(tokens, block_h * block_d)
    grid = (triton.cdiv(tokens, per), triton.cdiv(heads, block_h))
    _rms_norm_kernel[grid](x3, r3, weight, y3, tokens, heads, d, eps,
                           x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
                           y3.stride(0), y3.stride(1), HAS_RESIDUAL=residual is not None,
                           TOKENS=per, BLOCK_H=block_h, BLOCK_D=block_d, MODE=mode,
                           num_warps=warps, **launch_kwargs(x3.device))


def _new_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The reference returns weight * normed, so the result takes the promoted dtype.
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim. x is [T, H] or [T, heads, D]
    (any token/head strides, contiguous last dim); out, if given, has x's shape (it may be x)."""
    if out is None:
        out = _new_out(x, weight)
    elif out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    _launch(x, None, weight, out, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). The sum is written IN PLACE into residual,
    which is returned as the second value; the normalized rows go to a new tensor."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    out = _new_out(x, weight)
    _launch(x, residual, weight, out, eps)
    return out, residual


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """DeepSeek-V4's norm in x's dtype: weight (float32) times the float32 normalized x, one
    rounding; without a weight, x times its reciprocal rms rounded to x's dtype. x is [T, H]
    or [T, heads, D] (one row a head)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, eps, mode=1 if weight is not None else 2)
    return out
