"""A step's host lists packed into one int64 tensor, moved with one copy, sliced on the device.

The scheduler hands over plain Python lists (ModelBatch). Moving each list separately costs a
copy and a launch apiece; packing them costs one host-to-device copy per step. Decode batches
use a row layout [batch, DECODE_COLS + max_blocks] so that a captured graph reads a fixed
buffer whose first B rows are the live batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from deepinfer.backends.cuda.kernels.decode_rows import unpack_decode_rows
from deepinfer.core.batch import ModelBatch

# Decode row layout: token id, position, KV slot, sequence length, the row of the step in flight
# whose sampled id is this row's token id (-1: the id column holds it), then the block table.
SRC_COL = 4
DECODE_COLS = 5


@dataclass
class AttentionMeta:
    """What the attention kernels read; every tensor lives on the device."""

    slot_mapping: torch.Tensor  # [T] int64; -1: padding, nothing is written
    block_tables: torch.Tensor  # [N, W] int32
    seq_lens: torch.Tensor  # [N] int32
    query_starts: torch.Tensor | None  # [N + 1] int32; None for decode-only steps
    max_query_len: int
    decode: bool
    num_splits: int = 1  # split-K of the decode kernel
    max_seq_len: int = 0  # the longest sequence (host int: sizes split-K without a sync)
    # A mixed step's leading sequences with one new token each (decodes, scheduled first):
    # the decode kernel serves them, the prefill kernel the rest.
    num_decodes: int = 0
    # The sequences past those decodes, on the host (eager steps only; empty in graphs): their
    # lengths and their causal (query, key) pairs, which size and choose MLA's expanded prefill.
    prefill_seq_lens: tuple[int, ...] = ()
    prefill_pairs: int = 0


@dataclass
class LayerGroupMeta:
    """A step's metadata for a model of several KV groups whose layers read one group each
    (the llama family with sliding and full layers): each group's AttentionMeta, and which
    group a layer's cache belongs to."""

    groups: list[AttentionMeta]
    group_of: dict[int, int]  # spec layer -> group

    def of(self, layer: int) -> AttentionMeta:
        return self.groups[self.group_of[layer]]


def layer_meta(meta: AttentionMeta | LayerGroupMeta, layer: int) -> AttentionMeta:
    """The metadata the kernels read for `layer`."""
    return meta.of(layer) if isinstance(meta, LayerGroupMeta) else meta


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMeta | Any  # group_inputs.GroupedMeta for multi-group / stateful models
    logits_index: torch.Tensor | None  # rows of the hidden states whose logits are sampled


def fill_decode_rows(rows: np.ndarray, batch: ModelBatch, block_size: int) -> None:
    """Write a decode-only batch into rows[:B] and pad the rest as harmless null rows."""
    n = batch.num_seqs
    rows[:n, 0] = batch.input_ids
    rows[:n, 1] = batch.positions
    rows[:n, 2] = batch.slot_mapping
    rows[:n, 3] = batch.seq_lens
    rows[:n, SRC_COL] = -1
    if batch.from_last_step is not None:
        last = batch.from_last_step
        rows[last.token_indices, SRC_COL] = last.rows
    rows[:n, DECODE_COLS:] = 0
    for i, table in enumerate(batch.block_tables):
        used = -(-batch.seq_lens[i] // block_size)
        rows[i, DECODE_COLS:DECODE_COLS + used] = table[:used]
    # Padding rows attend one token of the null block and write no KV.
    rows[n:, :] = 0
    rows[n:, 2] = -1
    rows[n:, 3] = 1
    rows[n:, SRC_COL] = -1


def decode_inputs(rows: torch.Tensor, last_tokens: torch.Tensor, num_splits: int) -> StepInputs:
    """The model's inputs from packed decode rows, token ids from last_tokens (the ids the step
    in flight sampled) where a row's SRC_COL says so; inside a captured graph, its inputs."""
    ids, positions, slots, seq_lens, tables = unpack_decode_rows(rows, last_tokens,
                                                                 DECODE_COLS, SRC_COL)
    meta = AttentionMeta(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                         query_starts=None, max_query_len=1, decode=True, num_splits=num_splits)
    return StepInputs(ids, positions, meta, None)


@dataclass(frozen=True)
class DecodeRows:
    """The one-group row layout as a decode graph uses it (graphs.RowLayout)."""

    max_blocks: int
    block_size: int  # the KV pool's (PagedCache.block_size)
    split_policy: Callable[[int], int]  # batch -> split-K of the decode kernel
    # One class: the kernels read the lengths on the device and size their splits by the
    # longest context (a graph per context class gained nothing, docs/benchmarks.md).
    context_classes = (0,)

    @property
    def width(self) -> int:
        return DECODE_COLS + self.max_blocks

    def pad(self, rows: torch.Tensor) -> None:
        rows[:, 2] = -1  # null rows: no KV write, one token of the null block
        rows[:, 3] = 1

    def context_class(self, longest: int) -> int:
        return 0

    def fill(self, rows: np.ndarray, batch: ModelBatch) -> None:
        fill_decode_rows(rows, batch, self.block_size)

    def inputs(self, rows: torch.Tensor, last_tokens: torch.Tensor,
               context: int) -> StepInputs:
        return decode_inputs(rows, last_tokens, self.split_policy(rows.shape[0]))


def pack_batch(batch: ModelBatch, block_size: int) -> tuple[np.ndarray, int]:
    """Flat layout for eager steps: ids | positions | slots | seq_lens | query_starts |
    logits rows | block tables [N, W] (W: the blocks of the longest sequence). Returns the
    array and W."""
    t, n, s = batch.num_tokens, batch.num_seqs, len(batch.sample_indices)
    width = max(-(-length // block_size) for length in batch.seq_lens)
    out = np.zeros(3 * t + 2 * n + 1 + s + n * width, dtype=np.int64)
    out[:t] = batch.input_ids
    out[t:2 * t] = batch.positions
    out[2 * t:3 * t] = batch.slot_mapping
    o = 3 * t
    out[o:o + n] = batch.seq_lens
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(batch.query_lens, out=starts[1:])
    out[o + n:o + 2 * n + 1] = starts
    o += 2 * n + 1
    out[o:o + s] = starts[1:][batch.sample_indices] - 1  # each sampled sequence's last token
    o += s
    tables = out[o:].reshape(n, width)
    for i, table in enumerate(batch.block_tables):
        used = min(width, len(table))
        tables[i, :used] = table[:used]
    return out, width


def leading_decodes(query_lens: Sequence[int]) -> int:
    """How many sequences at the head of a step have one new token each."""
    count = 0
    for n in query_lens:
        if n != 1:
            break
        count += 1
    return count


def unpack_batch(flat: torch.Tensor, batch: ModelBatch, width: int,
                 num_splits: int) -> StepInputs:
    t, n, s = batch.num_tokens, batch.num_seqs, len(batch.sample_indices)
    o = 3 * t
    seq_lens = flat[o:o + n].to(torch.int32)
    starts = flat[o + n:o + 2 * n + 1].to(torch.int32)
    o += 2 * n + 1
    logits_index = flat[o:o + s]
    tables = flat[o + s:].view(n, width).to(torch.int32)
    decode = batch.is_decode_only
    decodes = 0 if decode else leading_decodes(batch.query_lens)
    lens, pairs = ((), 0) if decode else prefill_sizes(batch, decodes)
    meta = AttentionMeta(
        slot_mapping=flat[2 * t:3 * t], block_tables=tables, seq_lens=seq_lens,
        query_starts=None if decode else starts, max_query_len=max(batch.query_lens),
        decode=decode, num_splits=num_splits, max_seq_len=max(batch.seq_lens),
        num_decodes=decodes, prefill_seq_lens=lens, prefill_pairs=pairs)
    return StepInputs(flat[:t], flat[t:2 * t], meta, logits_index)


def prefill_sizes(batch: ModelBatch, skip: int) -> tuple[tuple[int, ...], int]:
    """(lengths, causal pairs) of the batch's sequences from index `skip` on: a sequence of
    s tokens, q of them new, attends q * (s - q) + q * (q + 1) / 2 pairs."""
    lens = zip(batch.seq_lens[skip:], batch.query_lens[skip:])
    return tuple(batch.seq_lens[skip:]), sum(q * (s - q) + q * (q + 1) // 2 for s, q in lens)
