"""Fused MoE experts: every route (token, choice) through its expert's gated MLP, weighted and
summed over the k choices, as MoEOps.fused_experts defines it.

    fused_experts(x [T, H], w13 [S, 2F, H], w2 [S, H, F], weights [T, k], slots [T, k]) -> [T, H]

The design is vLLM's and SGLang's fused_moe, written smaller:

1. align (one or two small kernels): sort the T*k routes by expert slot, pad each slot's run to
   a multiple of BLOCK_M and give every BLOCK_M rows their slot. Routes with slot -1 (served by
   another rank) are dropped. Nothing is read back to the host and every size depends on the
   shapes only (the padded length is at most T*k + min(S, T*k) * (BLOCK_M - 1)), so a step
   that calls this can be captured in a CUDA graph; blocks past the used ones have slot -1 and
   their programs return at once.
2. gate-up: a grouped GEMM over those blocks. Each program gathers its rows of x, multiplies
   them by one N tile of the gate and the matching tile of up (two accumulators, same A tile),
   and writes silu(gate) * up: the [routes, 2F] product never reaches memory. DeepSeek-V4's
   swiglu_limit clamps gate and up first (a constexpr: models without it compile unchanged).
3. down: a grouped GEMM of that intermediate (rows already in block order, read contiguously)
   with w2, scaled by each route's weight, each row written to its route's row of [T*k, H].
4. a sum over the k rows of each token in float32, skipping the routes not served here. It is
   a separate pass rather than atomics in the down GEMM so the result is deterministic.

FP8 experts (w13 and w2 given as Scaled: float8 codes and one scale per row and 128 columns,
DeepSeek's format) run the same kernels in w8a8: x and the intermediate are quantized per
token and 128 columns (fp8_gemm.quantize_tokens_fp8), the K step is one scale group, and each
step's dot is scaled by both operands' scales before it is added (vLLM's block-scaled fused
MoE). Their tiles are FP8_MOE_CONFIGS. On the H200 (bench_moe_fp8.py) that is 1.2-1.6x the
bf16 layer while weights dominate and 0.7-0.8x where FLOPs do.

A batch of a few tokens (moe_gemv.takes) goes to moe_gemv.py instead: GEMVs over each route's
expert with no align and no separate sum, two launches where this path takes four.

Small batches (decode) are weight-bandwidth bound: each expert's GEMM is a GEMV over its
weights with BLOCK_M = 16, and N tiles of 32-64 columns spread one expert over hundreds of
programs so the whole chip streams weights. Tiles come from a table keyed by routes per expert
slot (the M of each expert's GEMM), tuned on an H200; see MOE_CONFIGS.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda.kernels import moe_gemv
from deepinfer.backends.cuda.kernels.fp8_gemm import GROUP, Scaled, quantize_tokens_fp8
from deepinfer.backends.cuda.kernels.moe_gemv import limit_constexpr as _limit
from deepinfer.backends.cuda.kernels.moe_gemv import swiglu
from deepinfer.backends.cuda.kernels.tiles import rows_per_program

_ALIGN_CHUNK = 1024  # routes one align program sorts in registers
_ALIGN_BLOCKS = 32  # blocks one align program labels per iteration
_GROUP_M = tl.constexpr(8)  # row blocks that sweep the N tiles together, so their A rows stay in L2
_SUM_BLOCK = 1024
# Route and block counts change every step: the kernels do not specialise on them (== 1,
# multiple of 16), so each config compiles once.


@dataclass(frozen=True)
class Tiles:
    """One GEMM's tiles: N (output columns) and K (reduction) per step, warps, pipeline depth."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # routes per block; shared by both GEMMs (the align step pads to it)
    gate_up: Tiles  # N over F (gate and up tiles of block_n each), K over H
    down: Tiles  # N over H, K over F


# (most routes per expert slot, config): the first row whose bound is >= T*k/S applies. Routes
# per slot is the M of each expert's GEMM, so one table fits MoEs of any expert count (vLLM's
# tuned H200 tables for these two shapes switch BLOCK_M at the same M per expert too).
# From the H200 sweep of moe_bench.py --sweep (results/cuda/fused_moe_sweep.json); each row is
# within a few percent of the sweep's best at every T measured (docs/benchmarks.md, "Tuned
# constants", has the table's time per layer against the roofline). The last row's down GEMM
# pipelines 4 stages: the H100 sweep at mixed-step sizes (fused_moe_sweep_mixed.json, T = 1K-8K)
# had it fastest at every T.
MOE_CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (16, MoeConfig(16, Tiles(64, 128, 4, 4), Tiles(32, 256, 4, 3))),
    (64, MoeConfig(64, Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3))),
    (float("inf"), MoeConfig(128, Tiles(128, 64, 8, 4), Tiles(256, 64, 8, 4))),
)


# FP8 experts (w8a8, BLOCK_K 128 = one scale group a step): each step's dot is scaled before
# it is added, so a program holds its accumulators and as many dot results; the tiles are
# smaller than bf16's (vLLM's tuned H200 tables for fp8_w8a8 with 128 x 128 blocks: BLOCK_M 16
# with 128-wide N tiles while weight reads dominate, 64 x 128 beyond).
FP8_MOE_CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (16, MoeConfig(16, Tiles(64, 128, 4, 4), Tiles(128, 128, 4, 4))),
    (float("inf"), MoeConfig(64, Tiles(64, 128, 4, 3), Tiles(128, 128, 4, 3))),
)


# Shared memory a block's pipelined tiles may take: under the H200's 227 KB, with room for what
# the compiler adds. The table above is tuned in bf16; float32 doubles every tile.
SHARED_MEMORY_BYTES = 200 * 1024


def fit_tiles(tiles: Tiles, block_m: int, element_bytes: int, b_tiles: int) -> Tiles:
    """The tiles with fewer pipeline stages, then a narrower K step, until the A tile
    [block_m, K] and b_tiles weight tiles [N, K] of every stage fit in shared memory."""
    def need(t: Tiles) -> int:
        return t.num_stages * (block_m + b_tiles * t.block_n) * t.block_k * element_bytes

    while need(tiles) > SHARED_MEMORY_BYTES and tiles.num_stages > 1:
        tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    while need(tiles) > SHARED_MEMORY_BYTES and tiles.block_k > 16:
        tiles = dataclasses.replace(tiles, block_k=tiles.block_k // 2)
    return tiles


def config_for(tokens: int, top_k: int, slots: int, fp8: bool = False) -> MoeConfig:
    """Tiles for T tokens routed k ways over S expert slots, from MOE_CONFIGS (FP8 experts:
    FP8_MOE_CONFIGS)."""
    per_slot = tokens * top_k / max(slots, 1)
    return next(cfg for bound, cfg in (FP8_MOE_CONFIGS if fp8 else MOE_CONFIGS)
                if per_slot <= bound)


class Alignment(NamedTuple):
    """Routes sorted by slot, in blocks of block_m rows that each belong to one slot."""
    routes: torch.Tensor  # int32 [num_blocks * block_m]: route id t*k + j, or T*k for padding
    block_slots: torch.Tensor  # int32 [num_blocks]: the slot of each block, -1 if unused
    block_m: int


# ---- align ---------------------------------------------------------------------------------
@triton.jit
def _bin_of(slots_ptr, idx, n, S):
    """A route's bin: its slot, or S for routes served elsewhere (-1, or out of range) and for
    the lanes past the last route."""
    slot = tl.load(slots_ptr + idx, mask=idx < n, other=-1)
    return tl.where((slot < 0) | (slot >= S), S, slot)


@triton.jit(do_not_specialize=["n"])
def _count_kernel(slots_ptr, counts_ptr, n, S, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Routes per bin in each chunk of CHUNK routes: counts [chunks, BINS]."""
    c = tl.program_id(0)
    key = _bin_of(slots_ptr, c * CHUNK + tl.arange(0, CHUNK), n, S)
    tl.store(counts_ptr + c * BINS + tl.arange(0, BINS), tl.histogram(key, BINS))


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _align_kernel(slots_ptr, counts_ptr, routes_ptr, block_slots_ptr, n, S, num_blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                  NB: tl.constexpr, MULTI: tl.constexpr):
    """Program c places chunk c's routes (stable: in route order within a slot) and labels
    every num_programs-th group of NB blocks. MULTI: several chunks, whose per-chunk counts
    _count_kernel wrote; otherwise this one program sees every route."""
    c = tl.program_id(0)
    chunks = tl.num_programs(0)
    lane = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    key = _bin_of(slots_ptr, c * CHUNK + lane, n, S)
    local = tl.histogram(key, BINS)
    total = local
    ahead = tl.zeros([BINS], dtype=tl.int32)  # routes of each bin in the chunks before c
    if MULTI:
        total = tl.zeros([BINS], dtype=tl.int32)
        for r in range(chunks):
            row = tl.load(counts_ptr + r * BINS + bins)
            total += row
            ahead += tl.where(r < c, row, 0)
    real = bins < S
    padded = tl.where(real, tl.cdiv(total, BLOCK_M) * BLOCK_M, 0)
    end = tl.cumsum(padded, 0)
    start = end - padded
    # Sorting (bin, lane) pairs groups the chunk's routes by bin in route order; a route's
    # place is its bin's start, plus the routes of its bin in earlier chunks, plus its rank.
    base = start + ahead - (tl.cumsum(local, 0) - local)
    order = tl.sort(key * CHUNK + lane)
    sorted_key = order // CHUNK
    dest = tl.gather(base, sorted_key, 0) + lane
    tl.store(routes_ptr + dest, c * CHUNK + order % CHUNK, mask=sorted_key < S)
    # Blocks: a block's slot is the first bin ending after its first row; the rows past its
    # slot's routes are padding, marked with the route id n.
    filled = tl.where(real, start + total, 0)
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(c * NB, num_blocks, chunks * NB):
        blocks = b0 + tl.arange(0, NB)
        first = blocks * BLOCK_M
        slot = tl.sum(((end[None, :] <= first[:, None]) & real[None, :]).to(tl.int32), 1)
        fill_end = tl.sum(tl.where(bins[None, :] == slot[:, None], filled[None, :], 0), 1)
        in_range = blocks < num_blocks
        tl.store(block_slots_ptr + blocks, tl.where(slot < S, slot, -1), mask=in_range)
        pos = first[:, None] + rows[None, :]
        tl.store(routes_ptr + pos, n, mask=in_range[:, None] & (pos >= fill_end[:, None]))


def max_blocks(routes: int, slots: int, block_m: int) -> int:
    """Blocks enough for any routing: each slot that has routes wastes < block_m rows."""
    return triton.cdiv(routes + min(slots, routes) * (block_m - 1), block_m)


def align_routes(slots: torch.Tensor, num_slots: int, block_m: int,
                 max_chunk: int = _ALIGN_CHUNK) -> Alignment:
    """slots [T, k] int32 (-1: not here) -> routes sorted by slot in single-slot blocks.
    max_chunk (a power of two) bounds the routes per align program (tests make it small)."""
    flat = slots.reshape(-1)
    n, device = flat.numel(), slots.device
    blocks = max_blocks(n, num_slots, block_m)
    routes = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_slots = torch.empty(blocks, dtype=torch.int32, device=device)
    chunk = min(max_chunk, max(16, triton.next_power_of_2(n)))
    chunks = triton.cdiv(n, chunk)
    bins = triton.next_power_of_2(num_slots + 1)  # + the bin of the routes not here
    counts = routes  # unused unless several chunks
    if chunks > 1:
        counts = torch.empty((chunks, bins), dtype=torch.int32, device=device)
        _count_kernel[(chunks,)](flat, counts, n, num_slots, CHUNK=chunk, BINS=bins)
    _align_kernel[(chunks,)](flat, counts, routes, block_slots, n, num_slots, blocks,
                             BLOCK_M=block_m, CHUNK=chunk, BINS=bins, NB=_ALIGN_BLOCKS,
                             MULTI=chunks > 1, num_warps=4)
    return Alignment(routes, block_slots, block_m)


# ---- grouped GEMMs -------------------------------------------------------------------------
@triton.jit
def _tile(num_blocks, n_cols, BLOCK_N: tl.constexpr):
    """(row block, column tile) of this program; GROUP_M row blocks go through the column
    tiles together, so each expert's weight tile is read by its row blocks close in time."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_cols, BLOCK_N)
    per_group = _GROUP_M * n_tiles
    first = pid // per_group * _GROUP_M
    group = tl.minimum(num_blocks - first, _GROUP_M)
    return first + pid % per_group % group, pid % per_group // group


@triton.jit(do_not_specialize=["n_routes", "top_k", "num_blocks"])
def _gate_up_kernel(x_ptr, w_ptr, routes_ptr, block_slots_ptr, h_ptr, xs_ptr, ws_ptr, n_routes,
                    top_k, F, H, num_blocks, sx, sw_e, sw_n, sh, sxs, sws_e, sws_n,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                    LIMIT: tl.constexpr = None):
    """h[row] = silu(x[t] @ gate.T) * (x[t] @ up.T) for the route in each sorted row; with a
    LIMIT, silu(min(gate, LIMIT)) * clamp(up, -LIMIT, LIMIT). FP8: x and the weights are
    float8 codes with one scale per row and 128 columns (xs [T, groups], ws [S, 2F, groups])
    and BLOCK_K is 128: each step's product is scaled in float32 as it is added (vLLM's
    block-scaled fused MoE)."""
    pid_m, pid_n = _tile(num_blocks, F, BLOCK_N)
    slot = tl.load(block_slots_ptr + pid_m)
    if slot < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(routes_ptr + rows)
    live = route < n_routes
    token = tl.where(live, route // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * sx + ks[None, :]
    # Columns past F wrap around instead of being masked: the loads stay unmasked and the
    # extra columns are dropped at the store.
    g_ptrs = w_ptr + slot.to(tl.int64) * sw_e + (cols % F)[None, :] * sw_n + ks[:, None]
    u_ptrs = g_ptrs + F * sw_n
    xs_ptrs = xs_ptr + token * sxs  # FP8 only, as the two below
    gs_ptrs = ws_ptr + slot.to(tl.int64) * sws_e + (cols % F) * sws_n
    us_ptrs = gs_ptrs + F * sws_n
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = ks < H - k0
            a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8:
            # The scales first and both dots in flight before either is scaled: a scale
            # loaded after its dot's wait adds a memory round trip to every K step.
            a_scale = tl.load(xs_ptrs + k0 // BLOCK_K)[:, None]
            g_scale = a_scale * tl.load(gs_ptrs + k0 // BLOCK_K)[None, :]
            u_scale = a_scale * tl.load(us_ptrs + k0 // BLOCK_K)[None, :]
            g_dot = tl.dot(a, g)
            u_dot = tl.dot(a, u)
            gate += g_dot * g_scale
            up += u_dot * u_scale
        else:
            gate = tl.dot(a, g, gate, input_precision=PRECISION)
            up = tl.dot(a, u, up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = swiglu(gate, up, LIMIT)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * sh + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=cols[None, :] < F)


@triton.jit(do_not_specialize=["n_routes", "num_blocks"])
def _down_kernel(h_ptr, w_ptr, routes_ptr, block_slots_ptr, weights_ptr, y_ptr, hs_ptr, ws_ptr,
                 n_routes, H, F, num_blocks, sh, sw_e, sw_n, sy, shs, sws_e, sws_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
    """y[route] = weight[route] * (h[row] @ w2[slot].T) for the route in each sorted row. FP8:
    as in _gate_up_kernel, h's scales hs [rows, groups] and w2's ws [S, H, groups]."""
    pid_m, pid_n = _tile(num_blocks, H, BLOCK_N)
    slot = tl.load(block_slots_ptr + pid_m)
    if slot < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(routes_ptr + rows)
    live = route < n_routes
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # The gate-up kernel wrote every row of a used block (zeros for padding): no row mask.
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * sh + ks[None, :]
    b_ptrs = w_ptr + slot.to(tl.int64) * sw_e + (cols % H)[None, :] * sw_n + ks[:, None]
    hs_ptrs = hs_ptr + rows.to(tl.int64) * shs  # FP8 only, as the one below
    bs_ptrs = ws_ptr + slot.to(tl.int64) * sws_e + (cols % H) * sws_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < F - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8:
            scale = tl.load(hs_ptrs + k0 // BLOCK_K)[:, None] * tl.load(bs_ptrs + k0 // BLOCK_K)
            acc += tl.dot(a, b) * scale
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc *= tl.load(weights_ptr + route, mask=live, other=0.0)[:, None]
    y_ptrs = y_ptr + route.to(tl.int64)[:, None] * sy + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < H))


@triton.jit
def _sum_routes_kernel(y_ptr, slots_ptr, out_ptr, T, H, S, sy, so, TOP_K: tl.constexpr,
                       TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum over j of y[t*k + j], in float32, over the routes served here only (the
    rows of the others were never written)."""
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    live = (t < T) & (cols < H)
    acc = tl.zeros([TOKENS, BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + t * TOP_K + j, mask=t < T, other=-1)
        here = live & (slot >= 0) & (slot < S)
        row = tl.load(y_ptr + (t * TOP_K + j) * sy + cols, mask=here, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + t * so + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


# ---- launchers -----------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> str:
    # float32 inputs are for checking, not speed: exact products rather than tf32's.
    return "ieee" if dtype == torch.float32 else "tf32"


def _codes(t: torch.Tensor | Scaled) -> torch.Tensor:
    return t.codes if isinstance(t, Scaled) else t


def _scale_args(a: torch.Tensor | Scaled, w: torch.Tensor | Scaled) -> tuple[list, list]:
    """The FP8 scale pointers (a's, w's) and strides (a's rows, w's slots and rows) of a
    GEMM; for a float GEMM, placeholders the FP8 constexpr never reads."""
    if isinstance(w, Scaled) != isinstance(a, Scaled):
        raise ValueError("the grouped GEMMs run FP8 weights with FP8 activations (w8a8) only")
    if not isinstance(w, Scaled):
        return [w, w], [0, 0, 0]
    return ([a.scales, w.scales],
            [a.scales.stride(0), w.scales.stride(0), w.scales.stride(1)])


def fp8_tiles(tiles: Tiles, block_m: int, b_tiles: int) -> Tiles:
    """The tiles of an FP8 GEMM: one K step per scale group, fitted in shared memory."""
    fitted = fit_tiles(dataclasses.replace(tiles, block_k=GROUP), block_m, 1, b_tiles)
    if fitted.block_k != GROUP:
        raise ValueError(f"FP8 tiles {tiles} with BLOCK_M {block_m} do not fit in shared memory")
    return fitted


def moe_gate_up(x: torch.Tensor | Scaled, w13: torch.Tensor | Scaled, al: Alignment,
                top_k: int, tiles: Tiles, swiglu_limit: float | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first GEMM: silu(gate) * up of each aligned row's route, [rows, F] in x's dtype
    or out_dtype (gate and up clamped first under a swiglu_limit). x and w13 Scaled: the FP8
    GEMM, whose tiles must have BLOCK_K 128 (fp8_tiles)."""
    xq, wq = _codes(x), _codes(w13)
    f, h = wq.shape[1] // 2, wq.shape[2]
    blocks = al.block_slots.numel()
    scales, strides = _scale_args(x, w13)
    out = torch.empty((al.routes.numel(), f), dtype=out_dtype or xq.dtype, device=xq.device)
    grid = (blocks * triton.cdiv(f, tiles.block_n),)
    _gate_up_kernel[grid](
        xq, wq, al.routes, al.block_slots, out, *scales, top_k * xq.shape[0], top_k, f, h,
        blocks, xq.stride(0), wq.stride(0), wq.stride(1), out.stride(0), *strides,
        BLOCK_M=al.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=h % tiles.block_k == 0, PRECISION=_precision(xq.dtype),
        FP8=isinstance(w13, Scaled), LIMIT=_limit(swiglu_limit), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out


def moe_down(inter: torch.Tensor | Scaled, w2: torch.Tensor | Scaled, al: Alignment,
             weights: torch.Tensor, tiles: Tiles, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """The second GEMM: weight * (row @ w2[slot].T) into row t*k + j of [T*k, H] (weights
    flat [T*k]), in inter's dtype or out_dtype; rows of routes not served here are left
    unwritten. inter and w2 Scaled: the FP8 GEMM (tiles from fp8_tiles)."""
    iq, wq = _codes(inter), _codes(w2)
    h, f = wq.shape[1], wq.shape[2]
    blocks = al.block_slots.numel()
    scales, strides = _scale_args(inter, w2)
    out = torch.empty((weights.numel(), h), dtype=out_dtype or iq.dtype, device=iq.device)
    grid = (blocks * triton.cdiv(h, tiles.block_n),)
    _down_kernel[grid](
        iq, wq, al.routes, al.block_slots, weights, out, *scales, weights.numel(), h, f,
        blocks, iq.stride(0), wq.stride(0), wq.stride(1), out.stride(0), *strides,
        BLOCK_M=al.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=f % tiles.block_k == 0, PRECISION=_precision(iq.dtype),
        FP8=isinstance(w2, Scaled), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def _sum_routes(y: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    tokens, top_k = slots.shape
    h = y.shape[1]
    out = torch.empty((tokens, h), dtype=y.dtype, device=y.device)
    block = min(_SUM_BLOCK, triton.next_power_of_2(h))
    per = rows_per_program(tokens, block)
    _sum_routes_kernel[(triton.cdiv(tokens, per), triton.cdiv(h, block))](
        y, slots, out, tokens, h, num_slots, y.stride(0), out.stride(0), TOP_K=top_k,
        TOKENS=per, BLOCK=block, num_warps=max(1, block // 256))
    return out


def _check(x: torch.Tensor, w13: torch.Tensor | Scaled, w2: torch.Tensor | Scaled,
           weights: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}")
    fp8 = isinstance(w13, Scaled)
    if fp8 != isinstance(w2, Scaled):
        raise ValueError("w13 and w2 must both be FP8 (Scaled) or neither")
    if fp8:
        _check_scaled(w13, "w13")
        _check_scaled(w2, "w2")
    w13, w2 = _codes(w13), _codes(w2)
    s, f2, h = w13.shape
    if h != x.shape[1] or f2 % 2 or w2.shape != (s, h, f2 // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [S, 2F, H] "
                         f"and [S, H, F] with H = {x.shape[1]}")
    dtype = torch.float8_e4m3fn if fp8 else x.dtype
    if w13.stride(2) != 1 or w2.stride(2) != 1 or w13.dtype != dtype or w2.dtype != dtype:
        raise ValueError("w13 and w2 must have a contiguous last dim and x's dtype (FP8: "
                         "float8_e4m3fn codes)")
    if slots.shape != weights.shape or slots.shape[0] != x.shape[0]:
        raise ValueError(f"slots {tuple(slots.shape)} and weights {tuple(weights.shape)} must "
                         f"both be [T, k] with T = {x.shape[0]}")
    if slots.dtype != torch.int32 or weights.dtype != torch.float32:
        raise ValueError("slots must be int32 and weights float32")


def _check_scaled(w: Scaled, name: str) -> None:
    groups = triton.cdiv(w.codes.shape[-1], GROUP)
    if w.scales.shape != (*w.codes.shape[:-1], groups) or w.scales.dtype != torch.float32 \
            or w.scales.stride(-1) != 1:
        raise ValueError(f"{name}'s scales must be float32 {(*w.codes.shape[:-1], groups)} "
                         f"with a contiguous last dim, got {tuple(w.scales.shape)}")


def fused_experts(x: torch.Tensor, w13: torch.Tensor | Scaled, w2: torch.Tensor | Scaled,
                  weights: torch.Tensor, slots: torch.Tensor, config: MoeConfig | None = None,
                  swiglu_limit: float | None = None) -> torch.Tensor:
    """sum over j of weights[t, j] * w2[s] @ (silu(w13[s, :F] @ x[t]) * (w13[s, F:] @ x[t])),
    s = slots[t, j], routes with s = -1 skipped. x [T, H]; w13 [S, 2F, H]; w2 [S, H, F];
    weights [T, k] float32; slots [T, k] int32. Returns [T, H] in x's dtype. No host sync.
    swiglu_limit: silu(min(gate, limit)) * clamp(up, -limit, limit) instead (DeepSeek-V4).
    w13 and w2 Scaled (FP8 codes and scales per row and 128 columns): x and the intermediate
    are quantized per token and 128 columns, and both GEMMs run in FP8 (w8a8); a few tokens
    (moe_gemv) read the FP8 weights with x as it is."""
    _check(x, w13, w2, weights, slots)
    tokens, top_k = slots.shape
    num_slots = _codes(w13).shape[0]
    if tokens == 0 or top_k == 0 or num_slots == 0:
        return torch.zeros_like(x)
    slots, weights = slots.contiguous(), weights.contiguous()
    if config is None and moe_gemv.takes(tokens, top_k, num_slots):
        return moe_gemv.moe_gemv(x, w13, w2, weights, slots, swiglu_limit=swiglu_limit)
    cfg = config or config_for(tokens, top_k, num_slots, fp8=isinstance(w13, Scaled))
    al = align_routes(slots, num_slots, cfg.block_m)
    if not isinstance(w13, Scaled):
        size = x.element_size()
        inter = moe_gate_up(x, w13, al, top_k, fit_tiles(cfg.gate_up, cfg.block_m, size, 2),
                            swiglu_limit)
        y = moe_down(inter, w2, al, weights.reshape(-1),
                     fit_tiles(cfg.down, cfg.block_m, size, 1))
        return _sum_routes(y, slots, num_slots)
    inter = moe_gate_up(Scaled(*quantize_tokens_fp8(x)), w13, al, top_k,
                        fp8_tiles(cfg.gate_up, cfg.block_m, 2), swiglu_limit, x.dtype)
    y = moe_down(Scaled(*quantize_tokens_fp8(inter)), w2, al, weights.reshape(-1),
                 fp8_tiles(cfg.down, cfg.block_m, 1), x.dtype)
    return _sum_routes(y, slots, num_slots)
