"""Undoing what rejected drafts did to DeepSeek-V4's state slots.

A verify step runs a sequence's last token and its k drafts through every layer, so each
compressor advances over all k + 1 positions. Most of what a rejected draft writes needs no
undoing: its window key sits at its own position's slot, which the next token there
rewrites before anything reads it; an entry it closes lies past every kept query's causal
limit; a page end it reaches stores carry-over in a page that is not full yet; a tail row it
writes in the kept window lies past the kept tail (a state slot's writers leave rows past the
live tail alone, compressor.store_state).

What does need undoing starts where a rejected position c closes a window (c % rate ==
rate - 1): the positions after it write the next window's rows 0, 1, ... over rows the kept
window still needs, and an overlapping compressor (CSA's compressor and indexer) replaces
its carry-over (the Ca rows of the last closed window). With at most `rate` positions
verified, no kept position closed a window then, and no kept position wrote those rows: the
values from before the step are the right ones. `save` copies them (tail rows 0..k-1 of every
compressor, and the Ca rows: a few KiB per sequence) before the step; `rewind` puts back,
per sequence and rate, the Ca rows and the rows the positions after c wrote.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class _Part:
    """One compressor's rows in a state slot (element offsets in the model's dtype)."""

    rate: int
    width: int
    tail_kv: int  # row r of the open window's kv at tail_kv + r * width
    tail_gate: int
    carry: tuple[int, int] | None  # (start, length) of the Ca kv + gate rows, if overlapping


@dataclass
class DraftRewind:
    parts: tuple[_Part, ...]
    max_drafts: int | None  # None: no compressor, nothing to undo
    _index: dict = field(default_factory=dict)  # (device, rate, rows) -> column positions

    @classmethod
    def of(cls, layers: nn.ModuleList) -> "DraftRewind":
        parts = [part for layer in layers for part in _parts(layer)]
        rates = [p.rate for p in parts]
        return cls(tuple(parts), min(rates) - 1 if rates else None)

    @property
    def rates(self) -> list[int]:
        return sorted({p.rate for p in self.parts})

    def _columns(self, rate: int | None, rows: int) -> list[int]:
        """Saved columns: every part's tail rows [0, rows) and its carry-over (rate None:
        every part, rows = max_drafts), in the order `save` lays them out."""
        out = []
        for p in self.parts:
            if rate is not None and p.rate != rate:
                continue
            for start in (p.tail_kv, p.tail_gate):
                out.extend(range(start, start + rows * p.width))
            if p.carry is not None:
                out.extend(range(p.carry[0], p.carry[0] + p.carry[1]))
        return out

    def _saved_positions(self, rate: int, rows: int, device: torch.device) -> torch.Tensor:
        """Where `rate`'s columns for `rows` tail rows lie in the slot and in `save`'s copy:
        [2, C] (slot columns, saved columns)."""
        key = (device, rate, rows)
        if key not in self._index:
            where = {c: i for i, c in enumerate(self._columns(None, self.max_drafts))}
            mine = self._columns(rate, rows)
            self._index[key] = torch.tensor([mine, [where[c] for c in mine]], dtype=torch.long,
                                           device=device)
        return self._index[key]

    def _saved_columns(self, device: torch.device) -> torch.Tensor:
        key = (device, None, self.max_drafts)
        if key not in self._index:
            self._index[key] = torch.tensor(self._columns(None, self.max_drafts),
                                           dtype=torch.long, device=device)
        return self._index[key]

    def save(self, state: torch.Tensor | None, dtype: torch.dtype, slots: list[int]
             ) -> torch.Tensor | None:
        """[len(slots), C] copies of what a verify step's rejected drafts may overwrite."""
        if self.max_drafts is None or state is None or not slots:
            return None
        view = state.view(dtype)
        rows = torch.tensor(slots, device=view.device)
        return view[rows[:, None], self._saved_columns(view.device)[None, :]]

    def rewind(self, state: torch.Tensor | None, dtype: torch.dtype,
               saved: torch.Tensor | None, slots: list[int], kept: list[int],
               verified: list[int]) -> None:
        """Sequence i kept positions < kept[i] of those < verified[i]: for each rate whose
        window a rejected position closed, put back what the step wrote after it."""
        if saved is None:
            return
        view = state.view(dtype)
        for i, (slot, a, b) in enumerate(zip(slots, kept, verified)):
            for rate in self.rates:
                closes = [p for p in range(a, b) if p % rate == rate - 1]
                if closes:
                    columns, source = self._saved_positions(rate, b - closes[0] - 1,
                                                            view.device)
                    view[slot, columns] = saved[i, source]


def _parts(layer: nn.Module) -> list[_Part]:
    """A decoder layer's compressors (CSA: the compressor, then its indexer) as slot parts,
    laid out from the layer's state offset as compressor.pack_state lays them."""
    comp = layer.compressor
    compressors = [] if comp is None else [comp, *filter(None, [getattr(comp, "indexer", None)])]
    out, offset = [], layer.place.state_offset
    for c in compressors:
        tail = (c.rate - 1) * c.width
        carry = (offset + 2 * tail, c.page_state_numel) if c.overlap else None
        out.append(_Part(c.rate, c.width, offset, offset + tail, carry))
        offset += c.state_numel
    return out
