"""Greedy token ids inside a decode graph: argmax over each row of the logits, in two launches.

At batch 1 the argmax ran after the graph as torch's max, argmax, gather, multiply and add
(core/sampler.argmax_rows), five launches the host queued one by one behind the 2.5 ms graph.
Here the graph itself ends with the ids, so a greedy step needs no kernel outside its graph:
the first launch splits each row into BLOCK-wide parts (many programs, as a 150K-entry row read
by one program is slow) and keeps each part's maximum and its first index; the second picks,
per row, the largest of those maxima and, among equal ones, the smallest index. Ties therefore
go to the first maximal index, as torch.argmax's do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs

BLOCK = 2048  # entries a program of the first launch reads: 4 warps x 16 float32 a thread


@triton.jit
def _part_max_kernel(x_ptr, vals_ptr, idx_ptr, V, sx, parts, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # let the merge launch now; wait for the logits (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * sx + cols, mask=cols < V, other=-float("inf"))
    best = tl.max(x, axis=0)
    first = tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(vals_ptr + row * parts + part, best)
    tl.store(idx_ptr + row * parts + part, part * BLOCK + first)


@triton.jit
def _merge_kernel(vals_ptr, idx_ptr, out_ptr, parts, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    vals = tl.load(vals_ptr + row * parts + p, mask=p < parts, other=-float("inf"))
    idx = tl.load(idx_ptr + row * parts + p, mask=p < parts, other=2**31 - 1)
    best = tl.max(vals, axis=0)
    # Parts are in column order and each index is its part's first maximum, so the smallest
    # index among the parts holding the row's maximum is the row's first maximum.
    first = tl.min(tl.where(vals == best, idx, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def greedy_ids(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (float, contiguous last dim) -> int64 [B]: each row's first maximal index
    (into out, a contiguous int64 [B], if given)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with a contiguous last dim, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    rows, vocab = logits.shape
    if vocab >= 2**31:
        raise ValueError(f"a vocabulary of {vocab} entries does not fit int32 indices")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [{rows}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(vocab))
    parts = triton.cdiv(vocab, block)
    vals = torch.empty((rows, parts), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, parts), dtype=torch.int32, device=logits.device)
    pdl = launch_kwargs(logits.device)
    _part_max_kernel[(rows, parts)](logits, vals, idx, vocab, logits.stride(0), parts,
                                    BLOCK=block, num_warps=4, **pdl)
    _merge_kernel[(rows,)](vals, idx, out, parts, BLOCK_P=triton.next_power_of_2(parts),
                           num_warps=4, **pdl)
    return out
