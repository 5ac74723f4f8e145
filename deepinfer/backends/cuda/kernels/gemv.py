"""One-token projections (GEMV) with the elementwise op before them fused into the load of x.

At batch 1 a projection reads its whole weight to make one row: its time is the weight bytes
over the memory bandwidth. The RMSNorm or SiLU-and-mul before it moves almost no data, yet as a
kernel of its own it costs a launch and a ramp of a few microseconds, 96 times a step for a
32-layer model. Here every program reads BLOCK_N weight rows in BLOCK_K chunks and builds the
matching chunk of the GEMV's input itself:

- PLAIN:   a = x
- NORM:    a = norm_weight * s, s = x (+ residual, rounded to x.dtype as the reference does).
           The RMS scale is one scalar per row, so it is applied to the finished dot products:
           y = rsqrt(mean(s^2) + eps) * (W @ a). Program 0 also writes s (the new residual).
- SILU:    a = silu(x[:K]) * x[K:] (x is the fused gate/up row)

Every program recomputes the (tiny) input chunk, so there is no grid-wide dependency. Products
accumulate in a float32 [BLOCK_N, BLOCK_K] tile reduced once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PLAIN, NORM, NORM_RESIDUAL, SILU = 0, 1, 2, 3


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def config_for(n: int, k: int) -> GemvConfig:
    """Tiles for an [n, k] weight, from the sweep of bench_gemv on an H200."""
    return GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, r_out_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, N, K, eps, sw_n,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if EVEN_K:
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
        if PROLOGUE == 3:
            gate = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            a = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            if PROLOGUE == 2:
                s = (x.to(tl.float32) + tl.load(r_ptr + cols, mask=col_ok, other=0.0)
                     .to(tl.float32)).to(x_ptr.dtype.element_ty)
                # A mask, not a branch: control flow in the loop would stop the pipelining.
                tl.store(r_out_ptr + cols, s, mask=col_ok & (pid == 0))
                x = s
            a = x.to(tl.float32)
            if PROLOGUE != 0:
                sumsq += a * a
                a = a * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sumsq, axis=0) / K + eps))
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            k: int, residual: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0, config: GemvConfig | None = None) -> torch.Tensor:
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] with a contiguous last dim, got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, K], got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    cfg = config or config_for(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    dummy = x  # unused pointer arguments
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, residual if residual is not None else dummy,
        residual_out if residual_out is not None else dummy,
        norm_weight if norm_weight is not None else dummy, weight,
        bias if bias is not None else dummy, y, n, k, eps, weight.stride(0),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N]."""
    return _launch(PLAIN, x, weight, bias, x.shape[-1], config=config)


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(s)), s) with s = x + residual (or x when residual is None); x [1, K].
    The sum goes to a new tensor: programs still read the old residual while program 0 writes."""
    k = x.shape[-1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous [{k}], got {tuple(norm_weight.shape)}")
    if residual is None:
        return _launch(NORM, x, weight, bias, k, norm_weight=norm_weight, eps=eps,
                       config=config), x
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    summed = torch.empty_like(x)
    y = _launch(NORM_RESIDUAL, x, weight, bias, k, residual=residual, residual_out=summed,
                norm_weight=norm_weight, eps=eps, config=config)
    return y, summed


def silu_and_mul_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: GemvConfig | None = None) -> torch.Tensor:
    """linear(silu(x[:, :F]) * x[:, F:]) for one fused gate/up row x [1, 2F]."""
    if x.shape[-1] % 2:
        raise ValueError(f"x must be [1, 2F], got {tuple(x.shape)}")
    return _launch(SILU, x, weight, bias, x.shape[-1] // 2, config=config)
