"""DeepSeek-V4's paged storage, as its model reads and writes it over the torch backends'
`PagedCache`: the one place that knows where a sequence's window keys, compressed entries and
compressor state live. The attention math (models/deepseek_v4/attention.py, compressor.py)
never sees a slot id.

The KV spec (model.py) gives every model layer a windowed spec layer with one K=V vector per
token, and every CSA / HCA layer one more, full-attention spec layer with its compressed
entries (CSA: `compressed` and `index_key`, one per 4 tokens; HCA: `compressed`, one per
`rate` tokens). Entry w of a sequence lives in its block table's page w * rate // block_size at
offset w % (block_size // rate). That is the token slot of position w * rate divided by rate,
so a sequence's block table in the entries' group locates them without new metadata.

A CSA layer's spec layer has a third entry, `page_state` (one per 128 tokens: the compressors'
carry-over as of that page's end, compressor.py), so a prefix-cache hit or a page copy brings
the state with the page.

The compressors' carry-over lives in the sequence's state slot (`PagedCache.state`, bytes),
each compressed layer at a fixed element offset, in the projections' dtype.

It reads a backend's step metadata by duck typing (the model package imports no backend):
`STEP_FIELDS` on the metadata, and per KV group `slot_mapping` (a device tensor [T]) and
`block_tables` (a device tensor [N, W], freed window pages as block 0); the CPU backend's
`PagedAttentionMeta` and the CUDA backend's `GroupedMeta` both carry them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from deepinfer.models.deepseek_v4 import static
from deepinfer.models.deepseek_v4.compressor import PAGE_TOKENS, Compressor
from deepinfer.models.deepseek_v4.decode_compress import SlotRows
from deepinfer.models.deepseek_v4.paged_ops import DecodeLens, DecodeTarget, PagedRows

ENTRY_TENSORS = 2  # compressed (+ index_key): the entry tensors; a CSA's page_state follows
# Host lists per sequence, the layer -> KV group map and the per-group device tensors.
STEP_FIELDS = ("query_starts", "query_lens", "seq_lens", "groups", "group_of", "state_slots")
# A decode step without host lists (what a CUDA graph holds): seq_lens [B] int32 and
# state_slots [B] int64 are device tensors, max_seq_len bounds the lengths.
DECODE_FIELDS = ("seq_lens", "groups", "group_of", "state_slots", "max_seq_len")
# A step in static shapes (static.py): per token, its sequence's chunk start [T], the state
# slot it reads [T] and the one it writes [T] (its sequence's on its last token, else a
# scratch slot); per KV group, per-token block tables [T, W] and the slot mapping [T].
STATIC_FIELDS = ("starts", "state_slots", "state_writes", "groups", "group_of")

@dataclass(frozen=True)
class SeqView:
    """One sequence of the step: its rows of the flat token list and its positions."""

    index: int  # in the step's sequence list
    rows: slice  # its new tokens in the flat list
    start: int  # position of its first new token (0: its first chunk, a fresh state)
    seq_len: int  # tokens once this step is done
    state_slot: int | None


class V4PagedCache:
    """One step's view of the paged cache: writes and gathers by sequence."""

    def __init__(self, cache: Any, meta: Any, dtype: torch.dtype) -> None:
        self.cache, self.meta, self.dtype = cache, meta, dtype
        self.sequences: list[SeqView] = []
        self.static = all(hasattr(meta, f) for f in STATIC_FIELDS)
        self.decode = self.device_only = False
        if self.static:
            return
        self.decode = True
        # Device-only decode metadata: every sequence decodes, nothing is known per sequence
        # on the host (`sequences` is empty; the decode path needs none).
        self.device_only = all(hasattr(meta, f) for f in DECODE_FIELDS)
        fields = DECODE_FIELDS if self.device_only else STEP_FIELDS
        missing = [f for f in fields if not hasattr(meta, f)]
        if missing:
            raise NotImplementedError(
                f"DeepSeek-V4's paged data path needs step metadata with {STEP_FIELDS} "
                f"(or, decoding, {DECODE_FIELDS}; or {STATIC_FIELDS}); "
                f"{type(meta).__name__} lacks {missing}")
        # Decode rows come in runs of this many tokens of one sequence (a verify step):
        # the compressors step token j of every run at once, j = 0, 1, ...
        self.tokens_per_seq = getattr(meta, "tokens_per_seq", 1)
        if not self.device_only:
            self._host_sequences(meta)

    def _host_sequences(self, meta: Any) -> None:
        slots = meta.state_slots or [None] * len(meta.query_starts)
        self.sequences = [
            SeqView(i, slice(start, start + qlen), seq_len - qlen, seq_len, slot)
            for i, (start, qlen, seq_len, slot) in enumerate(
                zip(meta.query_starts, meta.query_lens, meta.seq_lens, slots))]
        self.decode = all(q == 1 for q in meta.query_lens)

    def _group(self, layer: int) -> Any:
        return self.meta.groups[self.meta.group_of[layer]]

    def paged(self, layer: int, entry: int = 0, rate: int = 1) -> PagedRows:
        """The layer's entry tensor number `entry` with its group's block tables."""
        return PagedRows(self.cache.layer(layer)[entry], self._group(layer).block_tables,
                         self.cache.block_size, rate)

    @property
    def device(self) -> torch.device:
        return self.cache.layer(0)[0].device

    @cached_property
    def decode_lens(self) -> DecodeLens:
        """The step's sequence lengths, host and device (decode ops read both): one copy a
        step, shared by the layers."""
        if self.device_only:
            return DecodeLens(self.meta.seq_lens, None, self.meta.max_seq_len)
        lens = list(self.meta.seq_lens)
        return DecodeLens(torch.tensor(lens, dtype=torch.int32, device=self.device), lens,
                          max(lens, default=0))

    @cached_property
    def slot_index(self) -> torch.Tensor:
        """[B] int64: each sequence's state slot (decode steps)."""
        if self.device_only:
            return self.meta.state_slots
        return torch.tensor(self.meta.state_slots, dtype=torch.long, device=self.device)

    # ---- the sliding window (every layer) -----------------------------------------------
    def write_window(self, layer: int, kv: torch.Tensor) -> None:
        """Every token's K=V vector [T, D] into the layer's window pages."""
        (window,) = self.cache.layer(layer)
        window.index_copy_(0, self._group(layer).slot_mapping, kv.to(window.dtype))

    def window(self, seq: SeqView, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [K, D], their positions [K]): every key the sequence's new queries can see
        in the window, the new tokens' included (written first)."""
        width = self.cache.spec.layers[layer].sliding_window
        pages = self.paged(layer)
        start = max(0, seq.start - width + 1)
        positions = torch.arange(start, seq.seq_len, device=pages.cache.device)
        return pages.gather(seq.index, positions), positions

    # ---- compressed entries (CSA / HCA layers' second spec layer) ------------------------
    def _entry_rows(self, seq: SeqView, layer: int, indices: torch.Tensor,
                    rate: int) -> torch.Tensor:
        """Rows of entries `indices` of the sequence in the layer's entry tensors: the token
        slot of each entry's first source position, divided by the rate."""
        return self.paged(layer, 0, rate).rows(seq.index, indices)

    def write_entries(self, seq: SeqView, layer: int, rate: int, indices: torch.Tensor,
                      values: tuple[torch.Tensor, ...]) -> None:
        """Entries number `indices` of the sequence: values[e] [m, *shape] into the layer's
        e-th entry tensor (compressed, then index_key on CSA layers)."""
        if indices.numel() == 0:
            return
        rows = self._entry_rows(seq, layer, indices.to(torch.long), rate)
        for tensor, value in zip(self.cache.layer(layer)[:ENTRY_TENSORS], values):
            tensor.index_copy_(0, rows, value.to(tensor.dtype))

    def entries(self, seq: SeqView, layer: int, rate: int, count: int
                ) -> tuple[torch.Tensor, ...]:
        """The sequence's entries 0..count-1 of each of the layer's entry tensors."""
        tensors = self.cache.layer(layer)[:ENTRY_TENSORS]
        rows = self._entry_rows(seq, layer, torch.arange(count, device=tensors[0].device), rate)
        return tuple(t.index_select(0, rows) for t in tensors)

    # ---- page-end carry-over (CSA layers' page_state entry) -------------------------------
    def _page_state(self, layer: int) -> torch.Tensor:
        return self.cache.layer(layer)[ENTRY_TENSORS]

    def write_page_states(self, seq: SeqView, layer: int, pages: list[int],
                          values: torch.Tensor) -> None:
        """values [len(pages), n]: the carry-over as of the end of each page number."""
        tensor = self._page_state(layer)
        index = torch.tensor(pages, device=tensor.device)
        rows = self._entry_rows(seq, layer, index, PAGE_TOKENS)
        tensor.index_copy_(0, rows, values.to(tensor.dtype))

    def page_state(self, seq: SeqView, layer: int, page: int) -> torch.Tensor:
        """[n] the carry-over stored as of the end of the sequence's page number `page`."""
        tensor = self._page_state(layer)
        rows = self._entry_rows(seq, layer, torch.tensor([page], device=tensor.device),
                                PAGE_TOKENS)
        return tensor.index_select(0, rows)[0].to(self.dtype)

    # ---- a decode step: one token of every sequence, batched ------------------------------
    def decode_target(self, layer: int, entry: int, rate: int, state_offset: int,
                      page_offset: int | None, rows: slice = slice(None)) -> DecodeTarget:
        """Where one compressor of the layer reads and writes at a decode step: its part of
        the state slots, entry tensor number `entry` and, CSA, its columns of page_state;
        for the decode rows `rows` (one token of each sequence)."""
        if self.cache.state is None:
            raise RuntimeError("DeepSeek-V4 needs a state slot per running sequence")
        page_state = None if page_offset is None else \
            self.paged(layer, ENTRY_TENSORS, PAGE_TOKENS).select(rows)
        slots = self.slot_index[rows].contiguous()
        return DecodeTarget(self.states, slots, state_offset,
                            self.paged(layer, entry, rate).select(rows), page_state,
                            page_offset or 0)

    # ---- compressor state ---------------------------------------------------------------
    @property
    def states(self) -> torch.Tensor:
        """Every state slot [num_slots, elements] in the model's dtype (the pool keeps bytes,
        or, where a bitcast is not to be had, the model's dtype already)."""
        state = self.cache.state
        return state if state.dtype == self.dtype else state.view(self.dtype)

    def state(self, seq: SeqView, offset: int, numel: int) -> torch.Tensor:
        """A view of elements [offset, offset + numel) of the sequence's state slot, in the
        model's dtype (writes go straight to the slot)."""
        if seq.state_slot is None or self.cache.state is None:
            raise RuntimeError("DeepSeek-V4 needs a state slot per running sequence")
        return self.states[seq.state_slot][offset:offset + numel]

    # ---- a step in static shapes (static.py) ----------------------------------------------
    def static_compress(self, comp: Compressor, kv: torch.Tensor, gate: torch.Tensor,
                        positions: torch.Tensor, layer: int, entry: int, state_offset: int,
                        page_offset: int) -> None:
        """One compressor over every token of the step: the entries whose windows close,
        (overlapping) the carry-over where a page ends, each sequence's state slot."""
        if self.cache.state is None:
            raise RuntimeError("DeepSeek-V4 needs a state slot per running sequence")
        states, starts = self.states, self.meta.starts
        columns = slice(state_offset, state_offset + comp.state_numel)
        slots = SlotRows.unpack(comp, states[self.meta.state_slots, columns])
        pages = self.paged(layer, ENTRY_TENSORS, PAGE_TOKENS) if comp.overlap else None
        if pages is not None:  # a chunk at a page end resumes from the page
            page = torch.div(starts, PAGE_TOKENS, rounding_mode="floor").sub(1).clamp(min=0)
            stored = pages.cache[pages.rows_of_each(page),
                                 page_offset:page_offset + comp.page_state_numel]
            slots = static.resumed_slots(comp, slots, stored, starts)
        rows = static.TokenRows(kv, gate, positions, starts, slots, comp.rate, comp.head_dim)
        static.write_closed(self.paged(layer, entry, comp.rate), static.compress(comp, rows),
                            positions, comp.rate)
        if pages is not None:
            static.write_page_ends(pages, static.page_carry(comp, rows), positions,
                                   page_offset)
        states[self.meta.state_writes, columns] = static.state_after(comp, rows)
