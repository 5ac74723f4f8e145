"""Fused MoE experts for a few tokens (decode): each route's expert as GEMVs, no sorting.

    moe_gemv(x [T, H], w13 [S, 2F, H], w2 [S, H, F], weights [T, k], slots [T, k]) -> [T, H]

Equal to fused_moe.fused_experts (same contract), for T of a few tokens. There the grouped GEMM
path costs four launches (align, gate-up, down, sum) for two weight streams, and at batch 1 the
align and the sum are pure latency. Here:

1. gate-up: one program per (route, BLOCK_N rows of F) reads its slot, then BLOCK_N gate rows
   and the matching up rows of that expert, dotted with the token's x in float32 as the
   batch-1 GEMV does (kernels/gemv.py), and writes silu(gate) * up for the route.
2. down + combine: one program per (token, BLOCK_N rows of H) reads the k routes' rows of w2
   together, one [k, BLOCK_N, BLOCK_K] tile a step (k expert streams in flight at once), and
   sums weight * dot over the k routes in float32 before the one store: no [T*k, H]
   intermediate, no atomics, the same sum order every run.

FP8 experts (Scaled codes and scales) are read as they are: each code times its row's scale
for its 128 columns, in float32, and x is not quantized (weight-only, as fp8_gemm's GEMV).

DeepSeek-V4's swiglu_limit clamps gate and up before the product (a constexpr, None for the
other models). Routes with slot -1 (served by another rank) or out of range are skipped. Both
kernels launch with PDL (pdl.py). The gate-up kernel reads no weight before its wait: its slot
ids come from the kernel ahead. It lets the down kernel launch only after that wait, so when
the down kernel runs, every kernel before the gate-up one has completed: it reads the slots,
the routing weights and its first weight tile before its own wait, while the gate-up kernel
finishes (H200, Qwen3-30B-A3B decode: see bench_gemv --moe-chain).
Grid sizes depend on T, k and the shapes only: CUDA-graph safe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.fp8_gemm import GROUP, Scaled
from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.settings import interpreted

_GROUP = tl.constexpr(GROUP)


@dataclass(frozen=True)
class GemvTiles:
    block_n: int  # output rows per program
    block_k: int  # reduction step
    num_warps: int


@dataclass(frozen=True)
class MoeGemvConfig:
    gate_up: GemvTiles  # rows of F (each with its gate and up row), K over H
    down: GemvTiles  # rows of H (for all k routes at once), K over F


# When fused_moe.fused_experts takes this path, and its tiles: from the H200 sweep of
# moe_bench.py --gemv-sweep (results/cuda/moe_gemv_sweep.json; 27 gate-up and 18 down tiles
# at each T), us per MoE layer at each T's best tiles against the grouped GEMM path:
#   T                          1      2      4      8
#   Qwen3-30B-A3B   here      23     40     70    123
#                   grouped   33     53     85    138
#   Mixtral-8x7B    here     162    300    519    818
#                   grouped  175    314    519    616
# This path wins while the routes per expert slot (T*k/S) are at most half: each route reads
# its expert's weights alone, so experts shared by several tokens are read several times.
# CONFIG is within 1% (Qwen) and 2% (Mixtral) of each T's best tiles on average.
MAX_TOKENS = 8
MAX_ROUTES_PER_SLOT = 0.5
CONFIG = MoeGemvConfig(GemvTiles(1, 512, 2), GemvTiles(8, 256, 4))
# Under the interpreter, whose cost is per program: many rows a program.
INTERPRETED_CONFIG = MoeGemvConfig(GemvTiles(64, 512, 4), GemvTiles(64, 256, 4))


def default_config() -> MoeGemvConfig:
    return INTERPRETED_CONFIG if interpreted() else CONFIG


def takes(tokens: int, top_k: int, slots: int) -> bool:
    """Whether a batch of T tokens routed k ways over S slots goes to this path."""
    return tokens <= MAX_TOKENS and tokens * top_k <= MAX_ROUTES_PER_SLOT * slots


def limit_constexpr(swiglu_limit: float | None) -> float | None:
    """The LIMIT constexpr of a swiglu_limit: a float (one compile per value), None for none."""
    return None if swiglu_limit is None else float(swiglu_limit)


@triton.jit
def swiglu(gate, up, LIMIT: tl.constexpr):
    """silu(gate) * up in float32; under a LIMIT, silu(min(gate, LIMIT)) * clamp(up, +-LIMIT)
    (transformers' DeepseekV4Experts._apply_gate)."""
    if LIMIT is not None:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _slot_of(slots_ptr, route, S):
    """The route's slot, or -1 when it is not served here."""
    slot = tl.load(slots_ptr + route)
    return tl.where((slot >= 0) & (slot < S), slot, -1)


@triton.jit
def _group_scales(s_rows, k0, K, ok, BLOCK_K: tl.constexpr):
    """Each column's scale in a [R, BLOCK_K] FP8 weight tile at columns k0: the rows' scales
    per 128 columns (s_rows: [R, 1] pointers to each row's first), each spread over its 128
    columns. BLOCK_K is a multiple of 128."""
    GROUPS: tl.constexpr = BLOCK_K // _GROUP
    g = k0 // _GROUP + tl.arange(0, GROUPS)[None, :]
    s = tl.load(s_rows + g, mask=ok & (g < tl.cdiv(K, _GROUP)), other=0.0)
    spread = tl.broadcast_to(s[:, :, None], (s.shape[0], GROUPS, _GROUP))
    return tl.reshape(spread, (s.shape[0], BLOCK_K))


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, slots_ptr, h_ptr, ws_ptr, F, H, S, sx, sw_e, sw_n, sh,
                         sws_e, sws_n, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                         FP8: tl.constexpr, LIMIT: tl.constexpr = None):
    """h[route, rows] = silu(x[t] . gate rows) * (x[t] . up rows) of the route's expert
    (gate and up clamped first under a LIMIT). FP8: the weights are float8 codes, each
    times its row's scale for its 128 columns (ws [S, 2F, groups]); x is not quantized."""
    if PDL:  # wait for the one ahead (see pdl.py), then let the down kernel launch
        gdc_wait()
        gdc_launch_dependents()
    route = tl.program_id(0)
    slot = _slot_of(slots_ptr, route, S)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows[:, None] < F
    cols = tl.arange(0, BLOCK_K)[None, :]
    g_rows = w_ptr + slot.to(tl.int64) * sw_e + rows.to(tl.int64)[:, None] * sw_n
    u_rows = g_rows + F * sw_n
    gs_rows = ws_ptr + slot.to(tl.int64) * sws_e + rows.to(tl.int64)[:, None] * sws_n
    us_rows = gs_rows + F * sws_n
    x_row = x_ptr + (route // TOP_K).to(tl.int64) * sx
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        c = k0 + cols
        mask = row_ok if EVEN_K else row_ok & (c < H)
        x = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
        g = tl.load(g_rows + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_rows + c, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            g *= _group_scales(gs_rows, k0, H, row_ok, BLOCK_K)
            u *= _group_scales(us_rows, k0, H, row_ok, BLOCK_K)
        gate += g * x
        up += u * x
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    h = swiglu(g, u, LIMIT)
    tl.store(h_ptr + route.to(tl.int64) * sh + rows, h.to(h_ptr.dtype.element_ty), mask=rows < F)


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, slots_ptr, weights_ptr, y_ptr, ws_ptr, H, F, S, sh, sw_e,
                      sw_n, sy, sws_e, sws_n, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      PDL: tl.constexpr, FP8: tl.constexpr):
    """y[t, rows] = sum over the token's routes j of weight_j * (h[t*k + j] . w2[slot_j] rows).
    FP8: as in _gate_up_gemv_kernel (ws [S, H, groups])."""
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_R)  # the token's routes, padded to a power of two
    route = t * TOP_K + j
    # Before the wait: slots and weights come from kernels ahead of the gate-up kernel, which
    # let this one launch only once it had passed its own wait (see the module docstring);
    # so the first tile of every route's rows is in flight while the gate-up kernel finishes.
    slot = tl.load(slots_ptr + route, mask=j < TOP_K, other=-1)
    here = (slot >= 0) & (slot < S)
    weight = tl.load(weights_ptr + route, mask=here, other=0.0)
    slot64 = tl.where(here, slot, 0).to(tl.int64)[:, None, None]
    w_rows = w_ptr + slot64 * sw_e + rows.to(tl.int64)[None, :, None] * sw_n
    s_rows = ws_ptr + slot64 * sws_e + rows.to(tl.int64)[None, :, None] * sws_n
    h_rows = h_ptr + route[:, None, None] * sh
    row_ok = here[:, None, None] & (rows[None, :, None] < H)
    cols = tl.arange(0, BLOCK_K)[None, None, :]
    w0 = tl.load(w_rows + cols, mask=row_ok & (cols < F), other=0.0)
    if PDL:
        gdc_wait()
    h0 = tl.load(h_rows + cols, mask=here[:, None, None] & (cols < F), other=0.0)
    w0 = w0.to(tl.float32)
    if FP8:
        w0 *= _group_scales_3d(s_rows, 0, F, row_ok, BLOCK_K)
    acc = w0 * h0.to(tl.float32)
    for k0 in range(BLOCK_K, F, BLOCK_K):
        c = k0 + cols
        mask = row_ok if EVEN_K else row_ok & (c < F)
        h = tl.load(h_rows + c, mask=here[:, None, None] & (c < F), other=0.0).to(tl.float32)
        w = tl.load(w_rows + c, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            w *= _group_scales_3d(s_rows, k0, F, row_ok, BLOCK_K)
        acc += w * h
    y = tl.sum(tl.sum(acc, axis=2) * weight[:, None], axis=0)
    tl.store(y_ptr + t * sy + rows, y.to(y_ptr.dtype.element_ty), mask=rows < H)


@triton.jit
def _group_scales_3d(s_rows, k0, K, ok, BLOCK_K: tl.constexpr):
    """_group_scales for a [R, N, BLOCK_K] tile (s_rows and ok [R, N, 1])."""
    GROUPS: tl.constexpr = BLOCK_K // _GROUP
    g = k0 // _GROUP + tl.arange(0, GROUPS)[None, None, :]
    s = tl.load(s_rows + g, mask=ok & (g < tl.cdiv(K, _GROUP)), other=0.0)
    spread = tl.broadcast_to(s[:, :, :, None], (s.shape[0], s.shape[1], GROUPS, _GROUP))
    return tl.reshape(spread, (s.shape[0], s.shape[1], BLOCK_K))


def moe_gemv(x: torch.Tensor, w13: torch.Tensor | Scaled, w2: torch.Tensor | Scaled,
             weights: torch.Tensor, slots: torch.Tensor, config: MoeGemvConfig | None = None,
             swiglu_limit: float | None = None) -> torch.Tensor:
    """fused_experts for small T (checked by the caller): x [T, H]; w13 [S, 2F, H];
    w2 [S, H, F]; weights [T, k] float32 and slots [T, k] int32, both contiguous. w13 and
    w2 Scaled (FP8): the config's BLOCK_Ks must be multiples of 128."""
    fp8 = isinstance(w13, Scaled)
    (w13, s13), (w2, s2) = (_with_scales(w) for w in (w13, w2))
    tokens, top_k = slots.shape
    num_slots, f2, h = w13.shape
    f = f2 // 2
    inter = torch.empty((tokens * top_k, f), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    config = config or default_config()
    up, down, pdl = config.gate_up, config.down, launch_kwargs(x.device)
    if fp8 and (up.block_k % GROUP or down.block_k % GROUP):
        raise ValueError(f"FP8 experts need BLOCK_Ks in multiples of {GROUP}, got {config}")
    _gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(f, up.block_n))](
        x, w13, slots, inter, s13, f, h, num_slots, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), s13.stride(0), s13.stride(1), TOP_K=top_k, BLOCK_N=up.block_n,
        BLOCK_K=up.block_k, EVEN_K=h % up.block_k == 0, FP8=fp8,
        LIMIT=limit_constexpr(swiglu_limit), num_warps=up.num_warps, **pdl)
    _down_gemv_kernel[(tokens, triton.cdiv(h, down.block_n))](
        inter, w2, slots, weights, out, s2, h, f, num_slots, inter.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), s2.stride(0), s2.stride(1), TOP_K=top_k,
        BLOCK_R=triton.next_power_of_2(top_k), BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        EVEN_K=f % down.block_k == 0, FP8=fp8, num_warps=down.num_warps, **pdl)
    return out


def _with_scales(w: torch.Tensor | Scaled) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of an FP8 weight; a float weight and itself in place of scales the
    kernels never read."""
    return (w.codes, w.scales) if isinstance(w, Scaled) else (w, w)
