"""Softmax top-k MoE router in one kernel: logits [T, E] -> (weights [T, k] fp32, ids [T, k] i32).

Why: the reference (deepinfer.models.moe.routing.select_experts) is ~6 torch kernels per MoE
layer (cast, softmax, topk, sum, divide, scale, id cast), each a few microseconds at batch 1
decode. Here a program holds BLOCK_T token rows of E logits (E padded to a power of two) in
registers as fp32, takes the softmax, then the top k by k passes of max-with-index (ties: the
lowest expert id first; torch.topk on CUDA orders equal values arbitrarily, e.g. 7,6,4,5,1,0,2,3
for 8 zeros), renormalises by the sum of the k and scales. Outputs are in descending weight
order, like torch.topk. With counts (RouteCounts) it also adds each real token's k routes to
the per-expert counters with integer atomics (exact, order-free): the load counter of EPLB and
/metrics costs no kernel of its own. No host sync and a data-independent grid: CUDA-graph safe.

Not fused with the router's projection: a one-token kernel doing both (each program a few rows
of the GEMV, the last one to finish picking the experts) took 4.4 us on an H200 in a CUDA graph
against 3.5 us for the GEMV and this kernel under PDL: its serial tail cost more than a launch.
H200, E=128 k=8 bf16, us/call vs select_experts: in a CUDA graph T=1 1.9 vs 15.9; eager
(host-bound) T=1 52 vs 92, T=256 65 vs 110.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.models.moe.routing import RouteCounts

MAX_EXPERTS = 1024  # one row of logits lives in registers
_TILE = 512  # logits per program: E=128 takes 4 token rows a program, E=512 one


@triton.jit
def _topk_store(x, rows, row_ok, cols, col_ok, w_ptr, id_ptr, counts_ptr, real_ptr, scaling,
                COUNT: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 logits x [BLOCK_T, BLOCK_E] (-inf past the experts) -> the k best experts of each
    row by softmax, stored with their weights; and counted, if COUNT."""
    x = tl.where(row_ok, x, 0.0)  # rows past the end: finite, never stored
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    probs = tl.where(col_ok, probs, -1.0)  # padding experts are never picked
    slots = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best, best_id = tl.max(probs, axis=1, return_indices=True,
                               return_indices_tie_break_left=True)
        weights = tl.where(slots == i, best[:, None], weights)
        ids = tl.where(slots == i, best_id[:, None], ids)
        probs = tl.where(cols == best_id[:, None], -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # padding slots hold 0
    out_ok = row_ok & (slots < TOP_K)
    tl.store(w_ptr + rows * TOP_K + slots, weights * scaling, mask=out_ok)
    tl.store(id_ptr + rows * TOP_K + slots, ids, mask=out_ok)
    if COUNT:
        real = rows < tl.load(real_ptr)
        tl.atomic_add(counts_ptr + ids, tl.full(ids.shape, 1, tl.int64), mask=out_ok & real,
                      sem="relaxed")


@triton.jit
def _softmax_topk_kernel(x_ptr, w_ptr, id_ptr, counts_ptr, real_ptr, tokens, experts, sx_t,
                         sx_e, scaling, COUNT: tl.constexpr, TOP_K: tl.constexpr,
                         RENORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_E)[None, :]
    row_ok, col_ok = rows < tokens, cols < experts
    x = tl.load(x_ptr + rows * sx_t + cols * sx_e, mask=row_ok & col_ok,
                other=float("-inf")).to(tl.float32)
    _topk_store(x, rows, row_ok, cols, col_ok, w_ptr, id_ptr, counts_ptr, real_ptr, scaling,
                COUNT, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_K)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, scaling: float = 1.0,
                 counts: RouteCounts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (any float dtype, any strides) -> (weights [T, k] float32 in
    descending order, expert ids [T, k] int32): topk(softmax(logits)), divided by the sum of the
    k when renormalize, times scaling. Equals select_experts for softmax scoring (and
    RouteCounts.add for counts)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be float [T, E], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    tokens, experts = logits.shape
    if not 0 < top_k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"need 0 < top_k={top_k} <= E={experts} <= {MAX_EXPERTS}")
    if counts is not None and (counts.counts.shape != (experts,) or
                               counts.counts.dtype != torch.int64):
        raise ValueError(f"counts must be int64 [{experts}], got {counts.counts.dtype} "
                         f"{tuple(counts.counts.shape)}")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    block_t = min(triton.next_power_of_2(tokens), max(1, _TILE // block_e))
    _softmax_topk_kernel[(triton.cdiv(tokens, block_t),)](
        logits, weights, ids, counts.counts if counts else ids,
        counts.num_real if counts else ids, tokens, experts, logits.stride(0), logits.stride(1),
        float(scaling), COUNT=counts is not None, TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=max(1, block_t * block_e // 256),
        **launch_kwargs(logits.device))
    return weights, ids

