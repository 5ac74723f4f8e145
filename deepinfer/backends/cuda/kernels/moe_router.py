"""MoE routers in one kernel: logits [T, E] -> (weights [T, k] fp32, ids [T, k] i32).

Why: the reference (deepinfer.models.moe.routing.select_experts) is 6-12 torch kernels per MoE
layer (cast, scores, bias, group scores and mask, topk, gather, sum, divide, scale, id cast),
each a few microseconds at batch 1 decode. Here a program holds BLOCK_T token rows of E logits
(E padded to a power of two) in registers as fp32 and does all of it:

- softmax scoring (Mixtral, Qwen3-MoE): the scores pick the experts and weigh them;
- sigmoid scoring (DeepSeek-V2-Lite/V3 as transformers' DeepseekV3 runs them): the scores plus
  the load-balancing bias pick the experts, the scores weigh them; with expert groups, only the
  best topk_groups of num_groups groups (a group scores the sum of its two best) are eligible.

The top k are k passes of max-with-index (ties: the lowest expert id first; torch.topk on CUDA
orders equal values arbitrarily, e.g. 7,6,4,5,1,0,2,3 for 8 zeros), the weights are divided
by their sum when the spec renormalises (DeepSeek's 1e-20 added for sigmoid) and scaled.
Outputs are in descending order of what picked them, like torch.topk. With counts
(RouteCounts) it also adds each real token's k routes to the per-expert counters with integer
atomics (exact, order-free): the load counter of EPLB and /metrics costs no kernel of its own.
No host sync and a data-independent grid: CUDA-graph safe.

Not fused with the router's projection: a one-token kernel doing both (each program a few rows
of the GEMV, the last one to finish picking the experts) took 4.4 us on an H200 in a CUDA graph
against 3.5 us for the GEMV and this kernel under PDL: its serial tail cost more than a launch.
H200, E=128 k=8 bf16 softmax, us/call vs select_experts: in a CUDA graph T=1 1.9 vs 15.9; eager
(host-bound) T=1 52 vs 92, T=256 65 vs 110.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.models.moe.routing import RouteCounts, RouterSpec

MAX_EXPERTS = 1024  # one row of logits lives in registers
_TILE = 512  # logits per program: E=128 takes 4 token rows a program, E=512 one
_SCORINGS = ("softmax", "sigmoid")  # sqrtsoftplus (DeepSeek-V4) stays on the reference


def takes(spec: RouterSpec, experts: int) -> bool:
    """Whether the kernel computes this router: softmax or sigmoid scoring over at most
    MAX_EXPERTS, and expert groups only where E is a power of two (a row splits into groups
    in registers)."""
    groups_ok = spec.num_groups == 1 or experts & (experts - 1) == 0
    return spec.scoring in _SCORINGS and experts <= MAX_EXPERTS and groups_ok


@triton.jit
def _best_groups(choice, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, GROUPS: tl.constexpr,
                 TOPK_GROUPS: tl.constexpr):
    """choice [BLOCK_T, BLOCK_E] with -inf outside the best TOPK_GROUPS of GROUPS groups of
    each row, a group scored by the sum of its two best (DeepSeek-V3's group-limited routing)."""
    per_group: tl.constexpr = BLOCK_E // GROUPS
    grouped = tl.reshape(choice, (BLOCK_T, GROUPS, per_group))
    inner = tl.arange(0, per_group)[None, None, :]
    first, first_at = tl.max(grouped, axis=2, return_indices=True,
                             return_indices_tie_break_left=True)
    second = tl.max(tl.where(inner == first_at[:, :, None], float("-inf"), grouped), axis=2)
    group_scores = first + second
    group_ids = tl.arange(0, GROUPS)[None, :]
    keep = tl.zeros((BLOCK_T, GROUPS), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        _, best = tl.max(group_scores, axis=1, return_indices=True,
                         return_indices_tie_break_left=True)
        picked = group_ids == best[:, None]
        keep = tl.where(picked, 1, keep)
        group_scores = tl.where(picked, float("-inf"), group_scores)
    grouped = tl.where(keep[:, :, None] != 0, grouped, float("-inf"))
    return tl.reshape(grouped, (BLOCK_T, BLOCK_E))


@triton.jit
def _route_kernel(x_ptr, bias_ptr, w_ptr, id_ptr, counts_ptr, real_ptr, tokens, experts, sx_t,
                  sx_e, scaling, eps, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                  GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, COUNT: tl.constexpr,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_E)[None, :]
    row_ok, col_ok = rows < tokens, cols < experts
    x = tl.load(x_ptr + rows * sx_t + cols * sx_e, mask=row_ok & col_ok,
                other=float("-inf")).to(tl.float32)
    x = tl.where(row_ok, x, 0.0)  # rows past the end: finite, never stored
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        choice = scores
        if BIAS:
            choice += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        choice = tl.where(col_ok, choice, float("-inf"))  # padding experts are never picked
        if GROUPS > 1:
            choice = _best_groups(choice, BLOCK_T, BLOCK_E, GROUPS, TOPK_GROUPS)
    else:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
        choice = tl.where(col_ok, scores, float("-inf"))
    slots = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        _, best_id = tl.max(choice, axis=1, return_indices=True,
                            return_indices_tie_break_left=True)
        picked = cols == best_id[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)
        weights = tl.where(slots == i, weight[:, None], weights)
        ids = tl.where(slots == i, best_id[:, None], ids)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + eps)  # padding slots hold 0
    out_ok = row_ok & (slots < TOP_K)
    tl.store(w_ptr + rows * TOP_K + slots, weights * scaling, mask=out_ok)
    tl.store(id_ptr + rows * TOP_K + slots, ids, mask=out_ok)
    if COUNT:
        real = rows < tl.load(real_ptr)
        tl.atomic_add(counts_ptr + ids, tl.full(ids.shape, 1, tl.int64), mask=out_ok & real,
                      sem="relaxed")


def route_topk(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
               counts: RouteCounts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (any float dtype, any strides) -> (weights [T, k] float32, expert
    ids [T, k] int32) in descending order of the choice. Equals select_experts for the specs
    `takes` accepts (softmax ignores the bias, as the reference does), and RouteCounts.add for
    counts."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be float [T, E], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    tokens, experts = logits.shape
    if experts != spec.num_experts or not takes(spec, experts):
        raise ValueError(f"the router kernel does not take {spec} over {experts} logits")
    if counts is not None and (counts.counts.shape != (experts,) or
                               counts.counts.dtype != torch.int64):
        raise ValueError(f"counts must be int64 [{experts}], got {counts.counts.dtype} "
                         f"{tuple(counts.counts.shape)}")
    sigmoid = spec.scoring == "sigmoid"
    if sigmoid and bias is not None and tuple(bias.shape) != (experts,):
        raise ValueError(f"bias must be [{experts}], got {tuple(bias.shape)}")
    weights = torch.empty((tokens, spec.top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, spec.top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    block_t = min(triton.next_power_of_2(tokens), max(1, _TILE // block_e))
    with_bias = sigmoid and bias is not None
    _route_kernel[(triton.cdiv(tokens, block_t),)](
        logits, bias.contiguous() if with_bias else ids, weights, ids,
        counts.counts if counts else ids, counts.num_real if counts else ids, tokens, experts,
        logits.stride(0), logits.stride(1), float(spec.scaling), 1e-20 if sigmoid else 0.0,
        SIGMOID=sigmoid, BIAS=with_bias, GROUPS=spec.num_groups, TOPK_GROUPS=spec.topk_groups,
        COUNT=counts is not None, TOP_K=spec.top_k, RENORMALIZE=spec.renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(spec.top_k),
        num_warps=max(1, block_t * block_e // 256), **launch_kwargs(logits.device))
    return weights, ids
