"""Step inputs of models with several KV groups or per-request state (DeepSeek-V4).

Such a model reads every group's slot mapping and block tables, each sequence's state slot,
and, in prefill and mixed steps, the step's per-sequence lengths on the host too (its
compressors step sequence by sequence there). As for one group (step_inputs.py), the lists are
packed into one int64 array and moved with one copy; the host lists stay beside it.

Decode steps of a model that reads no host list there (`graph_decode`) go through CUDA graphs
with `GroupedDecodeRows`: one row per sequence, every group's slot and block table in it, the
metadata all device tensors (`GroupedDecodeMeta`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.backends.cuda.step_inputs import SRC_COL, StepInputs
from deepinfer.core.batch import ModelBatch
from deepinfer.core.kv.spec import KVSpec
from deepinfer.core.transfer import to_device


@dataclass
class GroupTables:
    """One KV group's view of the step, on the device."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [N, W] int32; blocks a window group freed read as block 0


@dataclass
class GroupedMeta:
    """The step metadata of multi-group / stateful models (models/deepseek_v4/cache.py's
    STEP_FIELDS): host lists per sequence, device tensors per group."""

    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    groups: list[GroupTables]
    group_of: dict[int, int]  # spec layer -> group
    state_slots: list[int]
    tokens_per_seq: int = 1  # decode rows in runs of one sequence (ModelBatch.tokens_per_seq)


def _query_starts(batch: ModelBatch) -> list[int]:
    return np.concatenate(([0], np.cumsum(batch.query_lens)[:-1])).tolist()


def _table_width(tables: list[list[int]]) -> int:
    return max(1, max((len(t) for t in tables), default=0))


def pack_grouped(batch: ModelBatch) -> tuple[np.ndarray, list[int]]:
    """ids | positions | logits rows | per group: slots [T], tables [N, W_g].
    Returns the array and each group's table width."""
    t, n = batch.num_tokens, batch.num_seqs
    widths = [_table_width(g.block_tables) for g in batch.groups]
    sampled = len(batch.sample_indices)
    out = np.zeros(2 * t + sampled + sum(t + n * w for w in widths), dtype=np.int64)
    out[:t], out[t:2 * t] = batch.input_ids, batch.positions
    ends = np.cumsum(batch.query_lens)
    out[2 * t:2 * t + sampled] = ends[batch.sample_indices] - 1  # each sampled last token
    o = 2 * t + sampled
    for group, width in zip(batch.groups, widths):
        out[o:o + t] = group.slot_mapping
        tables = out[o + t:o + t + n * width].reshape(n, width)
        for i, table in enumerate(group.block_tables):
            tables[i, :len(table)] = table
        o += t + n * width
    return out, widths


def grouped_inputs(batch: ModelBatch, spec: KVSpec, device: torch.device) -> StepInputs:
    flat_host, widths = pack_grouped(batch)
    flat = to_device(torch.from_numpy(flat_host), device)
    t, n, sampled = batch.num_tokens, batch.num_seqs, len(batch.sample_indices)
    groups, o = [], 2 * t + sampled
    for width in widths:
        tables = flat[o + t:o + t + n * width].view(n, width).to(torch.int32)
        groups.append(GroupTables(flat[o:o + t], tables))
        o += t + n * width
    group_of = {layer: g.index for g in spec.groups for layer in g.layers}
    meta = GroupedMeta(_query_starts(batch), list(batch.query_lens), list(batch.seq_lens),
                       groups, group_of, list(batch.state_slots), batch.tokens_per_seq)
    return StepInputs(flat[:t], flat[t:2 * t], meta, flat[2 * t:2 * t + sampled])


# Decode row layout: token id, position, state slot, sequence length, the row of the step in
# flight whose sampled id is this row's (SRC_COL, as step_inputs), then per KV group its KV
# slot and its block table.
GROUPED_COLS = 5


@dataclass
class GroupedDecodeMeta:
    """A decode step's metadata with no host list (models/deepseek_v4/cache.DECODE_FIELDS)."""

    seq_lens: torch.Tensor  # [B] int32
    groups: list[GroupTables]
    group_of: dict[int, int]
    state_slots: torch.Tensor  # [B] int64
    max_seq_len: int  # sizes the kernels' grids: the bound of the graph's context class
    tokens_per_seq: int = 1  # rows in runs of one sequence (a verify step's decode rows)


@dataclass(frozen=True)
class GroupedDecodeRows:
    """graphs.RowLayout for several KV groups and state slots. Padding rows write their KV
    into the null block (slot 0, read by no sequence) and their state into `null_state_slot`,
    one slot beyond the engine's."""

    num_groups: int
    max_blocks: int
    block_size: int  # the KV pool's (PagedCache.block_size)
    group_of: dict[int, int]
    # Ascending bounds on the longest sequence, the last the longest context served: each
    # class's graph sizes the indexer's scores and top-k by its bound (GroupedDecodeMeta).
    context_classes: tuple[int, ...]
    null_state_slot: int
    # Rows in runs of this many tokens of one sequence (ModelBatch.tokens_per_seq): the
    # graphs of speculative decoding's verify steps (spec_graphs.py).
    tokens_per_seq: int = 1

    def context_class(self, longest: int) -> int:
        return next(b for b in self.context_classes if b >= longest)

    @property
    def width(self) -> int:
        return GROUPED_COLS + self.num_groups * (1 + self.max_blocks)

    def _group_col(self, g: int) -> int:
        return GROUPED_COLS + g * (1 + self.max_blocks)

    def pad(self, rows: torch.Tensor) -> None:
        rows.zero_()
        self._pad_tail(rows)

    def _pad_tail(self, rows: torch.Tensor | np.ndarray) -> None:
        rows[:, 2] = self.null_state_slot
        rows[:, 3] = 1
        rows[:, SRC_COL] = -1

    def fill(self, rows: np.ndarray, batch: ModelBatch) -> None:
        n = batch.num_seqs
        rows[:] = 0
        rows[:n, 0], rows[:n, 1] = batch.input_ids, batch.positions
        rows[:n, 2], rows[:n, 3] = batch.state_slots, batch.seq_lens
        self._pad_tail(rows[n:])
        rows[:n, SRC_COL] = -1
        if batch.from_last_step is not None:
            rows[batch.from_last_step.token_indices, SRC_COL] = batch.from_last_step.rows
        used = [-(-length // self.block_size) for length in batch.seq_lens]
        for g, group in enumerate(batch.groups):
            col = self._group_col(g)
            rows[:n, col] = group.slot_mapping
            for i, table in enumerate(group.block_tables):
                rows[i, col + 1:col + 1 + used[i]] = table[:used[i]]

    def inputs(self, rows: torch.Tensor, last_tokens: torch.Tensor,
               context: int) -> StepInputs:
        src = rows[:, SRC_COL]
        ids = torch.where(src >= 0, last_tokens[src.clamp(min=0)], rows[:, 0])
        groups = []
        for g in range(self.num_groups):
            col = self._group_col(g)
            groups.append(GroupTables(rows[:, col].contiguous(),
                                      rows[:, col + 1:col + 1 + self.max_blocks].to(torch.int32)))
        meta = GroupedDecodeMeta(rows[:, 3].to(torch.int32), groups, self.group_of,
                                 rows[:, 2].contiguous(), context, self.tokens_per_seq)
        return StepInputs(ids, rows[:, 1].contiguous(), meta, None)
