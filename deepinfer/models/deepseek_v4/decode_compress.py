"""DeepSeek-V4's compressors at a decode step: every sequence of the batch at once.

A decode step adds one token per sequence at position p. Each compressor (compressor.py)
either appends the token's kv/gate rows to its open window, row p % rate of the state slot's
tail, or, when the token closes the window (p % rate == rate - 1), pools the window into
entry number p // rate and, when its windows overlap, keeps the window's Ca half as the next
window's carry-over. On CSA layers a token that ends a 128-token page also stores that
carry-over in the page (`page_state`).

Here every sequence runs both branches' arithmetic and `closes` picks what is kept: no host
list and no shape that depends on the data, so a CUDA graph can hold the step, and a few
launches serve the whole batch instead of a few per sequence. The pooling is the chunk
step's own (`Compressor.pool_slots`) on [B, ...] tensors.

`decode_compress` is the reference of DeepSeekV4Ops.compressor_decode: it reads and writes the
paged storage (`DecodeTarget`). Rows that do not close a window (or end no page) write their
entry (carry-over) to row 0, in the null block, which no sequence reads. State slot rows past
the live tail are left as they were (the chunk step zeroes them): no reader looks past
`num_tokens % rate` rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v4.compressor import PAGE_TOKENS, Compressor
from deepinfer.models.deepseek_v4.paged_ops import DecodeTarget


@dataclass(frozen=True)
class SlotRows:
    """One compressor's part of B state slots, as compressor.pack_state lays it out."""

    tail_kv: torch.Tensor  # [B, rate - 1, width] the open window's kv rows
    tail_gate: torch.Tensor  # [B, rate - 1, width]
    prev_kv: torch.Tensor | None  # overlapping: [B, rate, head_dim] Ca of the last window
    prev_gate: torch.Tensor | None

    @classmethod
    def unpack(cls, comp: Compressor, region: torch.Tensor) -> "SlotRows":
        """region [B, comp.state_numel] -> views of its parts."""
        parts, offset = [], 0
        for rows, cols in comp.slot_shapes():
            parts.append(region[:, offset:offset + rows * cols].view(-1, rows, cols))
            offset += rows * cols
        return cls(*parts) if comp.overlap else cls(*parts, None, None)

    def pack(self) -> torch.Tensor:
        parts = [self.tail_kv, self.tail_gate]
        if self.prev_kv is not None:
            parts += [self.prev_kv, self.prev_gate]
        return torch.cat([p.flatten(1) for p in parts], dim=1)

    def carry_over(self) -> torch.Tensor:
        """[B, comp.page_state_numel]: Ca kv then gate, as compressor.page_end_rows packs."""
        return torch.cat((self.prev_kv.flatten(1), self.prev_gate.flatten(1)), dim=1)


def closes_window(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """[B] bool: the token at each position is the last of its window."""
    return positions % rate == rate - 1


def decode_step(comp: Compressor, kv: torch.Tensor, gate: torch.Tensor,
                positions: torch.Tensor, slots: SlotRows) -> tuple[torch.Tensor, SlotRows]:
    """kv, gate [B, width] projected rows of tokens at positions [B] (long) -> (the entry each
    row's window pools [B, head_dim], roped, meaningful where closes_window; the new slots)."""
    r = comp.rate
    win_kv_raw = torch.cat((slots.tail_kv, kv[:, None]), dim=1)  # [B, r, width]
    win_gate_raw = torch.cat((slots.tail_gate, gate[:, None]), dim=1)
    win_kv, win_gate = win_kv_raw, win_gate_raw + comp.position_bias
    if comp.overlap:
        win_kv, win_gate = _overlap_slots(comp, win_kv, win_gate, positions, slots)
    first = torch.div(positions, r, rounding_mode="floor") * r  # the window's first position
    entries = comp.rope(comp.pool_slots(win_kv, win_gate), first)
    return entries, _advance(comp, kv, gate, positions, slots, win_kv_raw, win_gate_raw)


def _overlap_slots(comp: Compressor, win_kv: torch.Tensor, win_gate: torch.Tensor,
                   positions: torch.Tensor, slots: SlotRows
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 2 * rate, head_dim] slots: Ca of the previous window (none for entry 0: zero kv,
    -inf gate, as Compressor._overlap_slots pads), then Cb of this one."""
    d = comp.head_dim
    has_prev = (positions >= comp.rate)[:, None, None]
    prev_kv = torch.where(has_prev, slots.prev_kv.to(win_kv.dtype), 0)
    prev_gate = (slots.prev_gate + comp.position_bias[:, :d]).to(win_gate.dtype)
    prev_gate = torch.where(has_prev, prev_gate, float("-inf"))
    return (torch.cat((prev_kv, win_kv[..., d:]), dim=1),
            torch.cat((prev_gate, win_gate[..., d:]), dim=1))


def _advance(comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
             slots: SlotRows, win_kv_raw: torch.Tensor, win_gate_raw: torch.Tensor) -> SlotRows:
    """The slots after the token: its rows at tail row p % rate, or (a closing token, windows
    overlapping) the window's Ca rows as the carry-over."""
    r = comp.rate
    rows = torch.arange(r - 1, device=kv.device)
    put = (rows[None, :] == (positions % r)[:, None])[..., None]  # no row for closing tokens
    tail_kv = torch.where(put, kv[:, None], slots.tail_kv)
    tail_gate = torch.where(put, gate[:, None], slots.tail_gate)
    if not comp.overlap:
        return SlotRows(tail_kv, tail_gate, None, None)
    closes = closes_window(positions, r)[:, None, None]
    d = comp.head_dim
    return SlotRows(tail_kv, tail_gate,
                    torch.where(closes, win_kv_raw[..., :d], slots.prev_kv),
                    torch.where(closes, win_gate_raw[..., :d], slots.prev_gate))


def decode_compress(comp: Compressor, kv: torch.Tensor, gate: torch.Tensor,
                    positions: torch.Tensor, target: DecodeTarget) -> None:
    """One compressor's decode step over paged storage: the state slots advanced, each
    closing window's entry written, and (CSA) the carry-over stored where a page ends."""
    region = target.states[target.slots, target.offset:target.offset + comp.state_numel]
    entries, slots = decode_step(comp, kv, gate, positions, SlotRows.unpack(comp, region))
    target.states[target.slots, target.offset:target.offset + comp.state_numel] = slots.pack()
    items = torch.div(positions, comp.rate, rounding_mode="floor")
    rows = torch.where(closes_window(positions, comp.rate),
                       target.entries.rows_of_each(items), 0)
    target.entries.cache.index_copy_(0, rows, entries.to(target.entries.cache.dtype))
    if target.page_state is None:
        return
    ends = (positions + 1) % PAGE_TOKENS == 0
    page = torch.div(positions, PAGE_TOKENS, rounding_mode="floor")
    rows = torch.where(ends, target.page_state.rows_of_each(page), 0)
    carry = slots.carry_over()
    columns = slice(target.page_offset, target.page_offset + carry.shape[1])
    target.page_state.cache[rows, columns] = carry.to(target.page_state.cache.dtype)
