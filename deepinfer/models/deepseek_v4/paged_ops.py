"""DeepSeek-V4's decode-step ops over paged storage, and their references.

A decode step has one query per sequence, so its attention and its indexer's selection batch
over sequences: `DeepSeekV4Ops.compressed_decode_attention` and `DeepSeekV4Ops.indexer_topk`
(ops.py) take the paged tensors plus each sequence's block table, and a backend with kernels
(CUDA) reads the pages itself. The references here gather each sequence's rows and run the
model's own torch math (attention.attend, compressor.select_topk), so every backend computes
what transformers does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v4.attention import attend, entries_visible
from deepinfer.models.deepseek_v4.compressor import select_topk


@dataclass(frozen=True)
class PagedRows:
    """A layer's paged tensor and where each sequence's items live in it. Item i (a token at
    rate 1, a compressed entry at rate r) of sequence b is row
    tables[b, i*r // block_size] * (block_size // r) + (i*r % block_size) // r: the token slot
    of its first source position, divided by r."""

    cache: torch.Tensor  # [num_blocks * block_size // rate, D]
    tables: torch.Tensor  # [B, W] integer block ids (0: the null block)
    block_size: int
    rate: int = 1

    def rows(self, b: int, items: torch.Tensor) -> torch.Tensor:
        """Row indices of items [n] (long) of sequence b."""
        first = items * self.rate
        return self._row(self.tables[b][self._column(first)], first)

    def rows_of_each(self, items: torch.Tensor) -> torch.Tensor:
        """Row indices [B] of item items[b] (long) of each sequence b."""
        return self.rows_at(items[:, None])[:, 0]

    def rows_at(self, items: torch.Tensor) -> torch.Tensor:
        """Row indices [B, n] of items items[b, j] (long) of each sequence b."""
        first = items * self.rate
        return self._row(self.tables.gather(1, self._column(first)), first)

    def _column(self, first: torch.Tensor) -> torch.Tensor:
        return torch.div(first, self.block_size, rounding_mode="floor")

    def _row(self, blocks: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The row of the item whose first source position `first` lies in `blocks`."""
        return blocks.to(torch.long) * (self.block_size // self.rate) + torch.div(
            first % self.block_size, self.rate, rounding_mode="floor")

    def gather(self, b: int, items: torch.Tensor) -> torch.Tensor:
        return self.cache.index_select(0, self.rows(b, items))

    def select(self, rows: slice) -> "PagedRows":
        """The same tensor for the sequences `rows` of the tables (contiguous, as kernels
        read them)."""
        if rows == slice(None):
            return self
        return PagedRows(self.cache, self.tables[rows].contiguous(), self.block_size, self.rate)


@dataclass(frozen=True)
class DecodeTarget:
    """Where one compressor reads and writes at a decode step (DeepSeekV4Ops.compressor_decode):
    the state slots, the entry tensor it fills and, on CSA layers, the page-end carry-over."""

    states: torch.Tensor  # [num_slots, numel] every slot's state, in the model's dtype
    slots: torch.Tensor  # [B] int64: each sequence's slot
    offset: int  # this compressor's first element in a slot
    entries: PagedRows  # its entries (compressed or index_key) at its rate
    page_state: PagedRows | None  # CSA: page_state rows (rate PAGE_TOKENS); None otherwise
    page_offset: int  # its carry-over's first column in a page_state row


@dataclass(frozen=True)
class DecodeLens:
    """Each sequence's length once this step's token is in (the query's position + 1)."""

    device: torch.Tensor  # [B] int32 on the cache's device (what kernels read)
    host: list[int] | None  # None inside a CUDA graph: kernels then read only `device`
    # A bound on them that sizes the kernels' grids and outputs: the longest, or inside a
    # graph (whose shapes are fixed at capture) the bound of its context class.
    max: int


def decode_attention_reference(q: torch.Tensor, window: PagedRows, entries: PagedRows | None,
                               picks: torch.Tensor | None, lens: DecodeLens,
                               sinks: torch.Tensor, sliding_window: int,
                               scale: float) -> torch.Tensor:
    """q [B, heads, D], one query per sequence at position lens.host[b] - 1: attention.attend
    over its window keys and its visible entries (picks [B, k] entry numbers, -1 none: CSA;
    None: every entry the query may see, HCA). Returns [B, heads, D]."""
    out = torch.empty_like(q)
    for b, seq_len in enumerate(lens.host):
        position = torch.tensor([seq_len - 1], device=q.device)
        keys = torch.arange(max(0, seq_len - sliding_window), seq_len, device=q.device)
        seen = _visible_entries(b, seq_len, entries, picks, position)
        out[b:b + 1] = attend(q[b:b + 1], position, window.gather(b, keys), keys,
                              sinks=sinks, window=sliding_window, scale=scale, **seen)
    return out


def _visible_entries(b: int, seq_len: int, entries: PagedRows | None,
                     picks: torch.Tensor | None, position: torch.Tensor) -> dict:
    """attend's compressed arguments for sequence b."""
    if entries is None:
        return {"compressed_kv": None, "compressed_visible": None}
    count = seq_len // entries.rate
    kv = entries.gather(b, torch.arange(count, device=position.device))
    if picks is None:
        return {"compressed_kv": kv, "compressed_visible":
                entries_visible(position, count, entries.rate)}
    return {"compressed_kv": kv, "compressed_visible": None, "picks": picks[b:b + 1]}


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, keys: PagedRows,
                           lens: DecodeLens, topk: int, scale: float) -> torch.Tensor:
    """The indexer's picks for one query per sequence: compressor.select_topk over the
    sequence's index keys, padded with -1 to [B, min(topk, most entries of any sequence)]."""
    width = min(topk, lens.max // keys.rate)
    out = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    for b, seq_len in enumerate(lens.host):
        count = seq_len // keys.rate
        own = keys.gather(b, torch.arange(count, device=q.device))
        position = torch.tensor([seq_len - 1], device=q.device)
        picks = select_topk(q[b:b + 1], weights[b:b + 1], position, own, keys.rate, topk, scale)
        out[b, :picks.shape[1]] = picks[0]
    return out
