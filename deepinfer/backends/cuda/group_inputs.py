"""Step inputs of models with several KV groups or per-request state (DeepSeek-V4).

Such a model reads every group's slot mapping and block tables, each sequence's state slot,
and the step's per-sequence lengths on the host too (its compressors step sequence by
sequence). As for one group (step_inputs.py), the lists are packed into one int64 array and
moved with one copy; the host lists stay beside it. These steps run eagerly: no CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.backends.cuda.step_inputs import StepInputs
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
                       groups, group_of, list(batch.state_slots))
    return StepInputs(flat[:t], flat[t:2 * t], meta, flat[2 * t:2 * t + sampled])
