"""One-token projections (GEMV): y [1, N] = x [1, K] @ W[N, K].T (+ bias).

At batch 1 a projection reads its whole weight to make one row, so its time is the weight bytes
over the memory bandwidth. cuBLAS's GEMV-shaped kernels reach 2.5-4.2 TB/s on an H200 at the
Llama-3-8B shapes, lowest on the small square ones; this kernel reaches 3.3-4.4 TB/s (see
bench_gemv). Each program reads BLOCK_N weight rows in BLOCK_K chunks, multiplies them by the
matching chunk of x and accumulates a float32 [BLOCK_N, BLOCK_K] tile, reduced once at the
end. Launched with PDL (pdl.py) it starts reading weights before the kernel ahead finishes:
the first FIRST_K columns of its rows (the whole row where it fits in 64 values a thread), so
at rows of up to 4096 columns a program has its weights in flight before its input exists.

Fusing the RMSNorm or SiLU-and-mul before a projection into this loop was measured too: it
saved their ~2 us launches but slowed the GEMV by as much, so they stay separate kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.settings import cuda_settings, interpreted


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1  # loads feeding no dot are not pipelined: 1 and 3 time the same
    first_k: int = 0  # columns read before the wait on the kernel ahead; 0: preload_cols()


# Weight values a thread may hold while it waits for the kernel ahead (registers: 32 of them
# as packed bf16, then 64 as float32 for the first product).
PRELOAD_PER_THREAD = 64


def preload_cols(cfg: GemvConfig, k: int) -> int:
    """FIRST_K: a power of two of at least block_k columns, at most the (padded) row, within
    PRELOAD_PER_THREAD values a thread. DEEPINFER_CUDA_GEMV_PRELOAD=0: block_k (one tile)."""
    if cfg.first_k:
        return cfg.first_k
    if not cuda_settings().gemv_preload:
        return cfg.block_k
    budget = PRELOAD_PER_THREAD * 32 * cfg.num_warps // cfg.block_n
    return max(cfg.block_k, min(triton.next_power_of_2(k), triton.next_power_of_2(budget + 1) // 2))


# Rows up to this wide are read whole before the wait by two-row, four-warp programs (64
# values a thread): not the fastest tiles alone, but the fastest behind the kernels that let
# them launch early, as in a decode step (docs/benchmarks.md, "Tuned constants").
WHOLE_ROW_COLS = 4096


def config_for(n: int, k: int) -> GemvConfig:
    """Tiles for an [n, k] weight, from the H200 sweeps at the Llama-3-8B shapes and at
    Qwen3-30B-A3B's (bench_gemv, --moe-shapes, --chain-tiles)."""
    if n * k < 16_000_000:  # small weights (2048-wide models, MoE routers): more programs
        return GemvConfig(4, 1024, 8 if n <= k else 4)
    if k <= WHOLE_ROW_COLS:  # qkv, o, gate_up, lm_head of 4096-wide models: whole rows
        return GemvConfig(2, 1024, 4)
    # down_proj [4096 x 14336]: long rows, few of them; two rows of eight warps read their
    # first 8192 columns before the wait.
    return GemvConfig(2, 1024, 8)


# Under the interpreter, whose cost is per program: many rows a program.
INTERPRETED_CONFIG = GemvConfig(64, 1024, 4)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, sw_n, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FIRST_K: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows[:, None] < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * sw_n
    # The weights are written by no kernel: the first FIRST_K columns are requested before the
    # wait on the kernel ahead (PDL), so the stream of weight bytes starts while it finishes.
    first = tl.arange(0, FIRST_K)
    w0 = tl.load(w_rows + first[None, :], mask=row_ok & (first[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
    x0 = tl.load(x_ptr + first, mask=first < K, other=0.0)
    y = tl.sum(w0.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)
    # Then one tile in flight per program; many programs per SM keep the memory busy. (Double
    # buffering here cost registers, hence programs, and ran 3-12% slower on an H200.)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(FIRST_K, K, BLOCK_K):
        c = k0 + cols
        if EVEN_K:  # no column mask: full-width vector loads
            w = tl.load(w_rows + c[None, :], mask=row_ok, other=0.0)
            x = tl.load(x_ptr + c)
        else:
            w = tl.load(w_rows + c[None, :], mask=row_ok & (c[None, :] < K), other=0.0)
            x = tl.load(x_ptr + c, mask=c < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y += tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] (contiguous) @ weight[N, K].T (+ bias [N]) -> [1, N] in x's dtype (into out,
    a contiguous [1, N] tensor, if given)."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, K] with a contiguous last dim, got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k) or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, {k}], got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    cfg = config or (INTERPRETED_CONFIG if interpreted() else config_for(n, k))
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [1, {n}], got {tuple(out.shape)}")
    y = out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, FIRST_K=preload_cols(cfg, k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(x.device))
    return y
