"""Projections with DeepSeek-style FP8 block-scaled weights: y [M, N] = x [M, K] @ W.T (+ bias).

The checkpoint stores W as float8_e4m3fn codes q [N, K] and one inverse scale per 128x128
block (`weight_scale_inv`), W = q * scale. The loader expands the block scales to one per row
and 128-column group, w_scale float32 [N, ceil(K/128)], so a fused projection (q|k|v, gate|up)
whose parts start at row offsets that are not multiples of 128 keeps each part's own scales.

Two paths, by M (fp8_linear picks; GEMV_MAX_M):

- decode, M <= GEMV_MAX_M: weight-only, bound by the weight bytes (half of bf16's). Each
  program reads BLOCK_N weight rows in chunks of GROUPS scale groups, converts the codes to
  float32 and multiplies them by x in float32; the sum over each 128-column group is scaled
  by that row's group scale (one multiply per group, not per weight). x is not quantized, so
  this path is as exact as the weights are. Up to GEMV_MAX_M rows of x share every weight
  tile. Nothing is allocated but the output and nothing is read back: CUDA-graph safe.
- prefill, larger M: w8a8. quantize_tokens_fp8 quantizes x per token and 128-column group
  (vLLM's and SGLang's per_token_group_quant_fp8), then a tensor-core GEMM on the fp8
  operands (a gated MLP's down projection quantizes silu(gate) * up straight from the gate/up
  output: one kernel, no 16-bit product written and read back). Where torch's scaled_mm takes
  block scales (cuBLAS 12.9+ on Hopper) and the backend laid the weight's scales out for it
  (cublas_weight_scale, a weight's kernel_scale), cuBLAS runs it: on an H200 at M = 8192,
  1.2-1.27 PFLOP/s with DeepSeek's 128 x 128 weight blocks, 0.87-1.03 with per-row scales,
  against bf16's 0.78-0.80. Else a Triton GEMM takes one 128-wide K step per scale group,
  acc += dot * a_scale * w_scale in float32 (vLLM's _w8a8_triton_block_scaled_mm; one dot
  per 128 of K is also the interval at which DeepGEMM promotes the fp8 accumulator to
  float32): 0.50-0.57 PFLOP/s.

Tiles are fixed per shape class (gemv_config_for, gemm_config_for), not autotuned: the GEMV
tiles follow gemv.py's H200 sweep at equal elements per tile, the GEMM tiles vLLM's tuned H200
tables for fp8 block-scaled GEMMs. bench_fp8.py times both on a GPU.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.settings import interpreted

log = logging.getLogger(__name__)
GROUP = 128  # columns per scale group: DeepSeek's block width
FP8_MAX = 448.0  # largest finite float8_e4m3fn
EPS = 1e-10  # floor of a group's absolute max, so an all-zero group gets a finite scale
_GROUP, _FP8_MAX, _EPS = tl.constexpr(GROUP), tl.constexpr(FP8_MAX), tl.constexpr(EPS)
GEMV_MAX_M = 8  # the largest M the weight-only GEMV takes
# One row of x: the 128-column groups of a row read whole before the wait, at most (4 rows a
# program, 4 warps: 128 weights a thread).
WHOLE_ROW_GROUPS = 32
# The largest M fp8_linear sends to the GEMV by itself: on the H200 the GEMM beats the
# several-row GEMV from M = 2 on (qkv at M = 2: 17 vs 70 us; bench_fp8.json).
GEMV_AUTO_M = 1
CUBLAS_M = 16  # cuBLAS's block-scaled GEMM takes M in multiples of this (_cublas_gemm)
_GROUP_M = tl.constexpr(8)  # GEMM row tiles that sweep the N tiles together (L2 reuse of W)


class Scaled(NamedTuple):
    """An operand in FP8: float8_e4m3fn codes and float32 scales per row and GROUP columns
    of the last dimension (codes [..., K], scales [..., ceil(K/GROUP)])."""
    codes: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int  # weight rows per program
    groups: int  # 128-column groups per chunk (BLOCK_K = 128 * groups), a power of two
    num_warps: int
    scale_each: bool = True  # one row of x: scale every weight (see _gemv_row_kernel)
    # One row of x: 128-column groups read before the wait on the kernel ahead (at least
    # `groups`; 0: `groups`, one step's tile).
    first_groups: int = 0


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int  # BLOCK_K is GROUP: one K step per scale group


def gemv_config_for(n: int, k: int, m: int = 1) -> Fp8GemvConfig:
    """Tiles for an [n, k] weight at m rows of x. gemv.py's H200 choices for bf16 at the same
    elements per tile (the fp8 tile is half the bytes). With more rows of x the K step
    narrows, so the [rows, BLOCK_N, BLOCK_K] products stay in registers, while BLOCK_N stays:
    every program reads its chunk of x, rows * BLOCK_K values, beside BLOCK_N * BLOCK_K weights.
    One row of x (_gemv_row_kernel): from bench_fp8 --sweep on the H200 (qkv 6144 x 4096:
    9.1 us, 2.8 TB/s; gate_up 28672 x 4096: 30.6 us, 3.9 TB/s; down 4096 x 14336: 18.5 us,
    3.2 TB/s at 4 rows a program, 21.5 at 16). Rows of up to 4096 columns are read whole
    before the wait on the kernel ahead, 4 rows a program (bench_fp8 --gemv-sweep, one lease:
    qkv 9.3 -> 8.7 us, o 7.6 -> 6.8, gate_up 33.0 -> 29.2; down's 14336 do not fit)."""
    if m == 1:
        row = triton.next_power_of_2(triton.cdiv(k, GROUP))
        if row <= WHOLE_ROW_GROUPS:
            return Fp8GemvConfig(4, min(2, row), 4, scale_each=False, first_groups=row)
        block_n, groups = (4, 8) if k >= 8192 else (16, 4) if n >= 16384 else (8, 8)
        return Fp8GemvConfig(block_n, min(groups, row), 4, scale_each=False)
    if n * k < 16_000_000:  # small weights: more programs
        block_n, block_k, warps = 4, 1024, 8 if n <= k else 4
    elif k >= 8192:  # down_proj: long rows, few of them
        block_n, block_k, warps = 16, 1024, 8
    elif n >= 16384:  # gate_up, lm_head: many rows
        block_n, block_k, warps = 16, 256, 4
    elif n <= k:  # o_proj
        block_n, block_k, warps = 16, 1024, 8
    else:  # qkv
        block_n, block_k, warps = 8, 512, 4
    groups = min(block_k // GROUP, triton.next_power_of_2(triton.cdiv(k, GROUP)))
    rows = triton.next_power_of_2(max(m, 1))
    groups = max(1, groups // rows)
    return Fp8GemvConfig(block_n, groups, warps)


def _interpreted_rows(cfg: Fp8GemvConfig) -> Fp8GemvConfig:
    """Under the interpreter, whose cost is per program: many rows a program."""
    return dataclasses.replace(cfg, block_n=64) if interpreted() else cfg


def gemm_config_for(m: int, n: int, k: int) -> Fp8GemmConfig:
    """Tiles for the w8a8 GEMM, after vLLM's tuned H200 tables (fp8_w8a8, block [128, 128]):
    BLOCK_M 16 with narrow N tiles while weight reads dominate, 64 x 128 beyond."""
    if m <= 16:
        return Fp8GemmConfig(16, 64, 4, 5)
    if m <= 64:
        return Fp8GemmConfig(64, 128, 4, 4)
    return Fp8GemmConfig(64, 128, 4, 3)


# ---- activation quantization -----------------------------------------------------------------
@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, KG, sx, sq, ss, ssg, ROWS: tl.constexpr,
                     GROUPS: tl.constexpr, SILU: tl.constexpr):
    """Rows [ROWS * program_id(0), + ROWS), groups [GROUPS * program_id(1), + GROUPS):
    scale = max(|x|, EPS) / 448 per row and 128 columns, q = clamp(x / scale, -448, 448) in
    float8_e4m3fn (rounded to nearest even by the cast). SILU: x is silu(gate) * up of a
    [M, 2K] input, each product rounded to the input's dtype as silu_and_mul stores it."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = g[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    ok = (row < M)[:, None, None] & (col < K)[None, :, :]
    offs = row.to(tl.int64)[:, None, None]
    x_ptrs = x_ptr + offs * sx + col[None, :, :]
    x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
    if SILU:  # activation.py's rounding: silu, then the product, to the input's dtype
        up = tl.load(x_ptrs + K, mask=ok, other=0.0).to(tl.float32)
        silu = (x / (1.0 + tl.exp(-x))).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    # IEEE division (div_rn, which broadcasts nothing): `/` lowers to an approximate divide on
    # NVIDIA GPUs, and the scales and codes are meant to be exactly torch's.
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), _EPS)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32))
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, :, None], x.shape))
    q = tl.clamp(q, -_FP8_MAX, _FP8_MAX)
    tl.store(q_ptr + offs * sq + col[None, :, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    s_ok = (row < M)[:, None] & (g < KG)[None, :]
    tl.store(s_ptr + row.to(tl.int64)[:, None] * ss + g[None, :] * ssg, scale, mask=s_ok)


def quantize_tokens_fp8(x: torch.Tensor, group: int = GROUP, column_major: bool = False,
                        rows: int | None = None, silu: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32, contiguous last dim) -> (q float8_e4m3fn [M, K], scales
    float32 [M, ceil(K/group)]) with x ~= q * scale per token and group of columns (the last
    group may be partial). group must be 128. column_major: the scales with strides (1, M),
    as scaled_mm reads them. rows (>= M): q and scales get that many rows, the ones past M
    left unwritten. silu: x is a fused gate/up output [M, 2K] and what is quantized is
    silu_and_mul(x), computed in the same kernel (bit-equal to quantizing silu_and_mul's
    output), so the [M, K] product is never written in 16 bits and read back."""
    if group != GROUP:
        raise ValueError(f"only {GROUP}-column groups are supported, got {group}")
    if x.dim() != 2 or x.stride(1) != 1 or (silu and x.shape[1] % 2):
        raise ValueError(f"x must be [M, {'2F' if silu else 'K'}] with a contiguous last dim, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape[0], x.shape[1] // 2 if silu else x.shape[1]
    kg, rows = triton.cdiv(k, GROUP), rows or m
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        scales = torch.empty((kg, rows), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((rows, kg), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    # 32 groups (4096 values) a program: up to 8 groups of a row, and 4 or more rows.
    groups = min(8, triton.next_power_of_2(kg))
    rows = min(32 // groups, triton.next_power_of_2(m))
    _quantize_kernel[(triton.cdiv(m, rows), triton.cdiv(kg, groups))](
        x, q, scales, m, k, kg, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
        ROWS=rows, GROUPS=groups, SILU=silu, num_warps=4)
    return q, scales


# ---- decode: weight-only GEMV ------------------------------------------------------------------
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sx, sw, ss, sy,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    g = tl.arange(0, GROUPS)
    col = g[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]  # [GROUPS, 128] in a chunk
    n_ok, m_ok = (n < N)[:, None], (m < M)[:, None, None]
    # One chunk: codes [BLOCK_N, GROUPS, 128], scales [BLOCK_N, GROUPS], x [ROWS, GROUPS, 128].
    w_ptrs = w_ptr + n.to(tl.int64)[:, None, None] * sw + col[None, :, :]
    s_ptrs = s_ptr + n.to(tl.int64)[:, None] * ss + g[None, :]
    x_ptrs = x_ptr + m[:, None, None] * sx + col[None, :, :]
    acc = tl.zeros([ROWS, BLOCK_N, GROUPS], dtype=tl.float32)
    for k0 in range(0, K, GROUPS * _GROUP):
        if EVEN_K:  # no column mask: full-width vector loads
            w = tl.load(w_ptrs, mask=n_ok[:, :, None], other=0.0)
            s = tl.load(s_ptrs, mask=n_ok, other=0.0)
        else:
            k_ok = (col < K - k0)[None, :, :]
            w = tl.load(w_ptrs, mask=n_ok[:, :, None] & k_ok, other=0.0)
            s = tl.load(s_ptrs, mask=n_ok & (g < tl.cdiv(K - k0, _GROUP))[None, :], other=0.0)
        if PDL:
            # Weights and scales are written by no kernel: the first chunk is requested before
            # the wait on the kernel ahead, as in gemv.py.
            if k0 == 0:
                gdc_wait()
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
        # Each row of x against each weight row, summed per scale group in float32, then
        # scaled: one multiply per group, not per weight.
        prod = w.to(tl.float32)[None, :, :, :] * x.to(tl.float32)[:, None, :, :]
        acc += tl.sum(prod, axis=3) * s[None, :, :]
        w_ptrs += GROUPS * _GROUP
        s_ptrs += GROUPS
        x_ptrs += GROUPS * _GROUP
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * sy + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, sw, ss,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUPS: tl.constexpr, FIRST_GROUPS: tl.constexpr, SCALE_EACH: tl.constexpr,
                     PDL: tl.constexpr):
    """One row of x (batch-1 decode) in 2-D tiles, as gemv.py: BLOCK_N weight rows a program.
    The first FIRST_GROUPS * 128 columns are requested before the wait on the kernel ahead
    (PDL: no kernel writes the weights), then BLOCK_K = GROUPS * 128 columns a step.
    SCALE_EACH: each weight times its group's scale into a [BLOCK_N, BLOCK_K] accumulator,
    reduced once at the end (gemv.py's loop); else each step's products summed per group,
    then scaled, into [BLOCK_N, GROUPS]."""
    BLOCK_K: tl.constexpr = GROUPS * _GROUP
    FIRST_K: tl.constexpr = FIRST_GROUPS * _GROUP
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (n < N)[:, None]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * sw
    s_rows = s_ptr + n.to(tl.int64)[:, None] * ss
    first, fg = tl.arange(0, FIRST_K), tl.arange(0, FIRST_GROUPS)
    w0 = tl.load(w_rows + first[None, :], mask=n_ok & (first < K)[None, :], other=0.0)
    s0 = tl.load(s_rows + fg[None, :], mask=n_ok & (fg < tl.cdiv(K, _GROUP))[None, :],
                 other=0.0)
    if PDL:
        gdc_wait()
    x0 = tl.load(x_ptr + first, mask=first < K, other=0.0)
    prod0 = w0.to(tl.float32) * x0.to(tl.float32)[None, :]
    y = tl.sum(tl.sum(tl.reshape(prod0, (BLOCK_N, FIRST_GROUPS, _GROUP)), axis=2) * s0, axis=1)
    cols = tl.arange(0, BLOCK_K)
    g = tl.arange(0, GROUPS)
    w_ptrs = w_rows + FIRST_K + cols[None, :]
    s_ptrs = s_rows + FIRST_GROUPS + g[None, :]
    if SCALE_EACH:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    for k0 in range(FIRST_K, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok, other=0.0)
            s = tl.load(s_ptrs, mask=n_ok, other=0.0)
            x = tl.load(x_ptr + k0 + cols)
        else:
            w = tl.load(w_ptrs, mask=n_ok & (cols < K - k0)[None, :], other=0.0)
            s = tl.load(s_ptrs, mask=n_ok & (g < tl.cdiv(K - k0, _GROUP))[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + cols, mask=cols < K - k0, other=0.0)
        prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
        if SCALE_EACH:
            each = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, _GROUP)),
                              (BLOCK_N, BLOCK_K))
            acc += prod * each
        else:
            acc += tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, _GROUP)), axis=2) * s
        w_ptrs += BLOCK_K
        s_ptrs += GROUPS
    y += tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


def fp8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: Fp8GemvConfig | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The decode path of fp8_linear for M <= GEMV_MAX_M (see fp8_linear); x is not
    quantized. No host sync, no allocation but the output (none with out): graph-safe."""
    m, n, k = _check(x, wq, w_scale, bias)
    if m > GEMV_MAX_M:
        raise ValueError(f"the fp8 GEMV takes at most {GEMV_MAX_M} rows, got {m}")
    out = _output(x, n, out)
    if m == 0:
        return out
    cfg = config or _interpreted_rows(gemv_config_for(n, k, m))
    if m == 1 and x.stride(1) == 1 and out.stride(1) == 1:
        first = max(cfg.first_groups, cfg.groups)
        _gemv_row_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, wq, w_scale, bias if bias is not None else w_scale, out, n, k, wq.stride(0),
            w_scale.stride(0), HAS_BIAS=bias is not None,
            EVEN_K=(k - first * GROUP) % (cfg.groups * GROUP) == 0, BLOCK_N=cfg.block_n,
            GROUPS=cfg.groups, FIRST_GROUPS=first, SCALE_EACH=cfg.scale_each,
            num_warps=cfg.num_warps, num_stages=1, **launch_kwargs(x.device))
        return out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, wq, w_scale, bias if bias is not None else w_scale, out, m, n, k, x.stride(0),
        wq.stride(0), w_scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % (cfg.groups * GROUP) == 0, ROWS=triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n, GROUPS=cfg.groups, num_warps=cfg.num_warps, num_stages=1,
        **launch_kwargs(x.device))
    return out


# ---- prefill: w8a8 block-scaled GEMM -----------------------------------------------------------
@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row tile, column tile) of this program; GROUP_M row tiles go through the column tiles
    together, so each weight tile is read by them close in time (from L2 after the first)."""
    pid = tl.program_id(0)
    per_group = _GROUP_M * tl.cdiv(N, BLOCK_N)
    first = pid // per_group * _GROUP_M
    group = tl.minimum(tl.cdiv(M, BLOCK_M) - first, _GROUP_M)
    return first + pid % per_group % group, pid % per_group // group


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, sa, sas, sw, sws, sy,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M and columns past N wrap around instead of being masked: the loads stay
    # unmasked and the extra rows and columns are dropped at the store.
    r = (rows % M).to(tl.int64)
    c = (cols % N).to(tl.int64)
    ks = tl.arange(0, _GROUP)
    a_ptrs = a_ptr + r[:, None] * sa + ks[None, :]
    w_ptrs = w_ptr + c[None, :] * sw + ks[:, None]  # [128, BLOCK_N]: W.T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, _GROUP)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = ks < K - g * _GROUP
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + r * sas + g)
        w_s = tl.load(ws_ptr + c * sws + g)
        # A fresh dot per scale group: its float32 result is scaled before it is summed.
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += _GROUP
        w_ptrs += _GROUP
    if HAS_BIAS:
        acc += tl.load(b_ptr + c).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * sy + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def fp8_gemm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None,
             out: torch.Tensor | None = None, kernel_scale: torch.Tensor | None = None,
             silu: bool = False) -> torch.Tensor:
    """The prefill path of fp8_linear (see there): x quantized by quantize_tokens_fp8, then a
    w8a8 tensor-core GEMM with float32 accumulation per scale group: cuBLAS where kernel_scale
    (cublas_weight_scale) is given and x is 16-bit, else the Triton kernel (config: its
    tiles). silu: x is a fused gate/up output [M, 2K] and the product is silu_and_mul(x) @ W.T,
    the SiLU fused into the quantization (a gated MLP's down projection)."""
    m, n, k = _check(x, wq, w_scale, bias, silu)
    if kernel_scale is not None and x.dtype != torch.float32 and config is None and m > 0:
        return _cublas_gemm(x, wq, kernel_scale, bias, out, silu)
    out = _output(x, n, out)
    if m == 0:
        return out
    cfg = config or gemm_config_for(m, n, k)
    xq, xs = quantize_tokens_fp8(x, silu=silu)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_kernel[grid](
        xq, xs, wq, w_scale, bias if bias is not None else w_scale, out, m, n, k, xq.stride(0),
        xs.stride(0), wq.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % GROUP == 0, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ---- prefill on cuBLAS: torch's scaled_mm with block scales -------------------------------------
def cublas_weight_scale(w_scale: torch.Tensor, k: int) -> torch.Tensor | None:
    """A weight's per-row scales [N, ceil(K/128)] in the layout scaled_mm reads: DeepSeek's
    128 x 128 blocks ([L4, N/128] with strides (1, L4), L4 = K/128 rounded up to 4) where every
    128-row block from row 0 shares its scales, else one per row ([N, K/128], strides (1, N)).
    None where scaled_mm takes no such weight (K not a multiple of 128, N of 16)."""
    n, kg = w_scale.shape
    if k % GROUP or n % 16:
        return None
    if n % GROUP == 0:
        blocks = w_scale.view(n // GROUP, GROUP, kg)
        if torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
            grid = torch.ones(n // GROUP, -(-kg // 4) * 4, dtype=torch.float32,
                              device=w_scale.device)  # the padding scales no column
            grid[:, :kg] = blocks[:, 0]
            return grid.t()
    return w_scale.t().contiguous().t()


def _cublas_gemm(x: torch.Tensor, wq: torch.Tensor, kernel_scale: torch.Tensor,
                 bias: torch.Tensor | None, out: torch.Tensor | None,
                 silu: bool = False) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    (m, _), (n, k) = x.shape, wq.shape
    per_row = kernel_scale.shape == (n, k // GROUP)
    # cuBLAS finds no block-scaled algorithm for an M that is not a multiple of 16 (CUDA 13.0,
    # H200): the rows past M are computed from unwritten codes and dropped.
    xq, xs = quantize_tokens_fp8(x, column_major=True, rows=-(-m // CUBLAS_M) * CUBLAS_M,
                                 silu=silu)
    y = scaled_mm(xq, wq.t(), xs, ScalingType.BlockWise1x128, kernel_scale,
                  ScalingType.BlockWise1x128 if per_row else ScalingType.BlockWise128x128,
                  output_dtype=x.dtype)[:m]
    if bias is not None:
        y += bias
    if out is None:
        return y
    _output(x, n, out).copy_(y)
    return out


def cublas_block_scaled(device: torch.device) -> bool:
    """Whether torch's scaled_mm runs block-scaled FP8 on this device (it needs cuBLAS 12.9+
    and a Hopper GPU): one small product of each weight layout, tried."""
    if torch.device(device).type != "cuda" or not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    x = torch.ones(16, 256, device=device, dtype=torch.bfloat16)
    wq = torch.ones(256, 256, device=device).to(torch.float8_e4m3fn)
    try:
        for scale in (torch.ones(256, 2, device=device), torch.ones(256, 2, device=device)[:16]):
            kernel_scale = cublas_weight_scale(scale, 256)
            if not torch.equal(_cublas_gemm(x, wq[:scale.shape[0]], kernel_scale, None, None),
                               torch.full((16, scale.shape[0]), 256.0, device=device,
                                          dtype=torch.bfloat16)):
                return _refused("a wrong product")
    except (RuntimeError, NotImplementedError) as exc:  # what torch raises for no such GEMM
        return _refused(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return True


def _refused(why: str) -> bool:
    log.info("FP8 GEMMs on the Triton kernel: scaled_mm with block scales refused (%s)", why)
    return False


# ---- entry points ------------------------------------------------------------------------------
def _check(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None, silu: bool = False) -> tuple[int, int, int]:
    if wq.dim() != 2 or wq.dtype != torch.float8_e4m3fn or wq.stride(1) != 1:
        raise ValueError(f"wq must be float8_e4m3fn [N, K] with a contiguous last dim, got "
                         f"{wq.dtype} {tuple(wq.shape)} strides {wq.stride()}")
    n, k = wq.shape
    width = 2 * k if silu else k  # silu: a gate/up output, [gate | up]
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {width}] with a contiguous last dim, got "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    kg = triton.cdiv(k, GROUP)
    if (w_scale.shape != (n, kg) or w_scale.dtype != torch.float32
            or (kg > 1 and w_scale.stride(1) != 1)):
        raise ValueError(f"w_scale must be float32 [{n}, {kg}] (one per row and {GROUP} "
                         f"columns), got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    return x.shape[0], n, k


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with a contiguous last dim, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, path: str | None = None,
               out: torch.Tensor | None = None, kernel_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ (wq * w_scale).T (+ bias [N]) -> [M, N] in x's dtype.
    wq: float8_e4m3fn [N, K]; w_scale: float32 [N, ceil(K/128)], row n's scale for columns
    [128 j, 128 (j + 1)) at [n, j]; kernel_scale: the same scales for cuBLAS
    (cublas_weight_scale), or None for the Triton GEMM. path: "gemv" (weight-only,
    M <= GEMV_MAX_M, graph-safe) or "gemm" (w8a8); by default the GEMV up to GEMV_AUTO_M
    rows, the GEMM above."""
    if path is None:
        path = "gemv" if x.shape[0] <= GEMV_AUTO_M else "gemm"
    if path == "gemv":
        return fp8_gemv(x, wq, w_scale, bias, out=out)
    if path == "gemm":
        return fp8_gemm(x, wq, w_scale, bias, out=out, kernel_scale=kernel_scale)
    raise ValueError(f"path must be 'gemv', 'gemm' or None, got {path!r}")


def dequantize_weight(wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """wq * w_scale in float32 [N, K], each scale spread over its 128 columns."""
    k = wq.shape[1]
    return wq.float() * w_scale.repeat_interleave(GROUP, dim=1)[:, :k]


def fp8_linear_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear in torch: the dequantized weight times x in float32 (x not quantized), the
    result in x's dtype. For tests, and for callers without Triton."""
    y = x.float() @ dequantize_weight(wq, w_scale).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
