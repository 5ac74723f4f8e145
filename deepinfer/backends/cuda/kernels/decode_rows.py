"""A decode graph's first kernel: its packed int64 input rows (step_inputs' row layout) into
the tensors the model reads, each token id taken from the step in flight where the row says so.

Slicing the columns with torch cost five copy launches at the head of every replay, and under
async scheduling the ids sampled by the step in flight were written into the rows by three
more launches (an index copy, a gather, a scatter) the host queued before the replay. One
program per row does all of it: ids (from `last[src]` where src >= 0), positions and KV slots
as int64, the sequence length and block table as int32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_W = 256  # block-table entries a program copies per iteration


@triton.jit
def _unpack_kernel(rows_ptr, last_ptr, ids_ptr, pos_ptr, slot_ptr, len_ptr, table_ptr, width,
                   s_row, s_table, COLS: tl.constexpr, SRC: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = rows_ptr + r * s_row
    src = tl.load(row + SRC)
    token = tl.load(row)
    if src >= 0:
        token = tl.load(last_ptr + src)
    tl.store(ids_ptr + r, token)
    tl.store(pos_ptr + r, tl.load(row + 1))
    tl.store(slot_ptr + r, tl.load(row + 2))
    tl.store(len_ptr + r, tl.load(row + 3).to(tl.int32))
    for c0 in range(0, width, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)
        block = tl.load(row + COLS + c, mask=c < width, other=0)
        tl.store(table_ptr + r * s_table + c, block.to(tl.int32), mask=c < width)


def unpack_decode_rows(rows: torch.Tensor, last_tokens: torch.Tensor, cols: int, src_col: int
                       ) -> tuple[torch.Tensor, ...]:
    """rows int64 [B, cols + W] (id, position, slot, length, ..., the row's index into
    last_tokens or -1 at src_col, ..., then W block-table entries) ->
    (ids int64 [B], positions int64 [B], slots int64 [B], seq_lens int32 [B],
    block_tables int32 [B, W])."""
    if rows.dim() != 2 or rows.dtype != torch.int64 or rows.stride(1) != 1 \
            or rows.shape[1] <= cols:
        raise ValueError(f"rows must be int64 [B, > {cols}] with a contiguous last "
                         f"dim, got {rows.dtype} {tuple(rows.shape)}")
    if last_tokens.dtype != torch.int64 or not last_tokens.is_contiguous():
        raise ValueError("last_tokens must be a contiguous int64 tensor")
    batch, width = rows.shape[0], rows.shape[1] - cols
    long = dict(dtype=torch.int64, device=rows.device)
    ids, positions, slots = (torch.empty(batch, **long) for _ in range(3))
    seq_lens = torch.empty(batch, dtype=torch.int32, device=rows.device)
    tables = torch.empty((batch, width), dtype=torch.int32, device=rows.device)
    if batch:
        block_w = min(_BLOCK_W, triton.next_power_of_2(width))
        _unpack_kernel[(batch,)](rows, last_tokens, ids, positions, slots, seq_lens, tables,
                                 width, rows.stride(0), tables.stride(0), COLS=cols, SRC=src_col,
                                 BLOCK_W=block_w, num_warps=1)
    return ids, positions, slots, seq_lens, tables
