"""FP8 block-scaled projections of a few rows (decode batches): y [M, N] = x [M, K] @ W.T.

Between the one-row GEMV (fp8_gemm.fp8_gemv) and the prefill GEMM, a decode batch of 2-32
sequences reads every weight byte once and does little arithmetic on it, so a projection's time
should be its FP8 weight bytes over the memory bandwidth. cuBLAS's block-scaled GEMM has a floor
of ~17 us a projection there on an H200 (128 x 128 output tiles: Llama-3-8B's qkv at M = 32
reads its 25 MB in the time bf16 reads 50 MB).

Here the product is computed transposed ("swap AB", as CUTLASS's and vLLM's small-M FP8
kernels do): y.T = W @ x.T, so the weight is the MMA's M side (BLOCK_W = 64 rows, one Hopper
warpgroup MMA) and the few tokens its N side (BLOCK_T = 16-64), and no MMA row is spent on a
token that is not there. A program streams its BLOCK_W weight rows over one K range, one
128-column scale group a step: acc += dot(W tile, x tile.T) * w_scale * x_scale, the float32
scaling per group of the prefill GEMM, x quantized per token and 128 columns as there
(quantize_tokens_fp8; a gated MLP's down projection quantizes silu(gate) * up from the gate/up
output in the same kernel). Each program reads its rows' and tokens' scales for its whole K
range before the loop: read inside it, each step waits on a synchronous load (1.5-2.0 TB/s
before, on the H200). Weight-only (the FP8 codes widened to bf16 in registers, x as it
is) was measured too and was slower at every shape and M on the H200, as the MoE's w8a16 was;
so was x quantized inside this kernel, each program over its own K range (2-4x slower at M 32
and 64: those loads and their arithmetic stall the loop's staged weight loads).

Programs over the weight rows alone are too few for the GPU at the square projections (4096
rows: 64 programs for 132 SMs), so the K range is split (SPLIT programs a row tile) and the
splits meet the way rotary_decode.py's do: each writes its float32 partial, takes a ticket, and
the last to finish sums the partials in split order (deterministic), adds the bias, writes y
and puts the ticket counter back to 0. Graph-safe: nothing is allocated but the partials and
the output, and nothing is read back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda.kernels.fp8_gemm import GROUP, _check, _output, quantize_tokens_fp8
from deepinfer.backends.cuda.kernels.rotary_decode import SplitCounters

_GROUP = tl.constexpr(GROUP)
MAX_ROWS = 64  # the most rows the kernel takes: BLOCK_T's largest tile
# The most rows the backend sends it: up to here it beats cuBLAS on each of a layer's four
# projections (docs/benchmarks.md, "Tuned constants").
SKINNY_MAX_M = 32


@dataclass(frozen=True)
class SkinnyConfig:
    block_w: int  # weight rows (output columns) a program: the MMA's M side
    split: int  # programs over K per row tile
    num_warps: int = 4
    num_stages: int = 5


def skinny_config_for(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """K split until there are 3 programs for every 2 SMs, each over at least 4 scale groups;
    5 stages in flight a split program, 3 in an unsplit one (its K loop is long). From the H200
    sweep at the Llama-3-8B shapes, M 2-64 (bench_fp8_skinny.py, fp8_skinny.json): qkv and o
    split 4, down 4, gate_up 1, all 64-row tiles of 4 warps."""
    block_w = 64
    tiles = triton.cdiv(n, block_w)
    groups = triton.cdiv(k, GROUP)
    split = 1
    while 2 * tiles * split < 3 * num_sms and groups // (split * 2) >= 4:
        split *= 2
    return SkinnyConfig(block_w, split, num_stages=5 if split > 1 else 3)


@triton.jit
def _group_scales(s_ptr, rows, stride, g_lo, g_hi, GROUPS: tl.constexpr):
    """Scales [len(rows), GROUPS] of groups g_lo.. (past g_hi: 1) of each row, read before the
    K loop: a scale read inside it is a synchronous global load each step, which the loop's
    pipeline (it stages the loads that feed the dot) would wait on."""
    g = g_lo + tl.arange(0, GROUPS)
    return tl.load(s_ptr + rows[:, None] * stride + g[None, :], mask=(g < g_hi)[None, :],
                   other=1.0)


@triton.jit
def _column(scales, j, GROUPS: tl.constexpr):
    """Column j of a register tile (a select and a row sum: registers cannot be indexed)."""
    return tl.sum(tl.where(tl.arange(0, GROUPS)[None, :] == j, scales, 0.0), axis=1)


@triton.jit
def _load_k(ptrs, ks, k_left, EVEN_K: tl.constexpr):
    """A [rows, 128] tile of one scale group; columns past K (k_left of them remain) read 0."""
    if EVEN_K:  # no column mask: full-width vector loads
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(ks < k_left)[None, :], other=0.0)


@triton.jit
def _skinny_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
                   M, N, K, sx, sxs, sw, sws, sy,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_T: tl.constexpr, SPLIT: tl.constexpr, GROUPS: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BLOCK_W + tl.arange(0, BLOCK_W)
    r = (rows % N).to(tl.int64)  # wrapped, not masked: dropped at the store
    t = tl.arange(0, BLOCK_T)
    tw = (t % M).to(tl.int64)
    ks = tl.arange(0, _GROUP)
    g_lo = split * GROUPS  # this split's scale groups: [g_lo, g_hi)
    g_hi = tl.minimum(g_lo + GROUPS, tl.cdiv(K, _GROUP))
    w_scales = _group_scales(ws_ptr, r, sws, g_lo, g_hi, GROUPS)
    x_scales = _group_scales(xs_ptr, tw, sxs, g_lo, g_hi, GROUPS)
    w_ptrs = w_ptr + r[:, None] * sw + (g_lo * _GROUP + ks)[None, :]
    x_ptrs = x_ptr + tw[:, None] * sx + (g_lo * _GROUP + ks)[None, :]
    acc = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
    for j in range(0, g_hi - g_lo):
        k_left = K - (g_lo + j) * _GROUP
        w = _load_k(w_ptrs, ks, k_left, EVEN_K)
        x = _load_k(x_ptrs, ks, k_left, EVEN_K)
        # A fresh dot per scale group: its float32 result is scaled before it is summed.
        acc += tl.dot(w, tl.trans(x)) * _column(w_scales, j, GROUPS)[:, None] \
            * _column(x_scales, j, GROUPS)[None, :]
        w_ptrs += _GROUP
        x_ptrs += _GROUP
    y_ptrs = y_ptr + t[None, :].to(tl.int64) * sy + rows[:, None]
    y_ok = (rows < N)[:, None] & (t < M)[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + r).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        _meet(acc, part_ptr, cnt_ptr, b_ptr, r, y_ptrs, y_ok, tile, split,
              tl.num_programs(0), HAS_BIAS, BLOCK_W, BLOCK_T, SPLIT)


@triton.jit
def _meet(acc, part_ptr, cnt_ptr, b_ptr, r, y_ptrs, y_ok, tile, split, tiles,
          HAS_BIAS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
          SPLIT: tl.constexpr):
    """Partials [SPLIT, tiles, BLOCK_W, BLOCK_T]: this split's into its slot; the last split of
    the row tile to arrive sums them all in split order and writes y."""
    tile_elems = BLOCK_W * BLOCK_T
    offs = tl.arange(0, BLOCK_W)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    tl.store(part_ptr + (split * tiles + tile).to(tl.int64) * tile_elems + offs, acc)
    # Every thread's stores are issued before the ticket; acq_rel at GPU scope publishes them
    # to, and acquires the others' for, the program that sums.
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT - 1:
        total = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(part_ptr + (s * tiles + tile).to(tl.int64) * tile_elems + offs,
                             cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + r).to(tl.float32)[:, None]
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=y_ok)
        tl.atomic_xchg(cnt_ptr + tile, 0)


def fp8_skinny(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, counters: SplitCounters, num_sms: int,
               config: SkinnyConfig | None = None, out: torch.Tensor | None = None,
               silu: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16, fp16 or fp32) @ (wq * w_scale).T (+ bias) -> [M, N]
    in x's dtype, wq float8_e4m3fn [N, K] and w_scale float32 [N, ceil(K/128)] as fp8_linear
    takes them. counters: the split tickets (allocated outside a CUDA graph capture; a
    capture that finds too few runs unsplit). num_sms sizes the split (skinny_config_for).
    silu: x is a fused gate/up output [M, 2K] and the product is silu_and_mul(x) @ W.T."""
    m, n, k = _check(x, wq, w_scale, bias, silu)
    if m > MAX_ROWS:
        raise ValueError(f"the FP8 skinny GEMM takes at most {MAX_ROWS} rows, got {m}")
    out = _output(x, n, out)
    if m == 0:
        return out
    cfg = config or skinny_config_for(m, n, k, num_sms)
    block_t = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, cfg.block_w)
    counts = counters.get(tiles, x.device) if cfg.split > 1 else None
    split, per_split = _splits(k, cfg.split if counts is not None else 1)
    xs, x_scales = quantize_tokens_fp8(x, silu=silu)
    partials = (torch.empty((split, tiles, cfg.block_w, block_t), dtype=torch.float32,
                            device=x.device) if split > 1 else out)
    _skinny_kernel[(tiles, split)](
        xs, x_scales, wq, w_scale, bias if bias is not None else w_scale, out, partials,
        counts if counts is not None else w_scale, m, n, k, xs.stride(0),
        x_scales.stride(0), wq.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % GROUP == 0, BLOCK_W=cfg.block_w,
        BLOCK_T=block_t, SPLIT=split, GROUPS=per_split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def _splits(k: int, wanted: int) -> tuple[int, int]:
    """(programs over K, scale groups each): the groups a program holds scales for are a power
    of two, and no split is left without a group."""
    groups = triton.cdiv(k, GROUP)
    per_split = triton.next_power_of_2(triton.cdiv(groups, wanted))
    return triton.cdiv(groups, per_split), per_split
