"""Paged attention in static shapes: every token reads its sequence's blocks through a block
table padded to the step's context bucket, in fixed-size chunks of keys with an online softmax.

Shapes depend on the step's bucket only: T tokens (padded by the scheduler), W blocks a table
(padded here with the null block), C blocks a chunk. A token sees the keys at positions <= its
own (and, in a sliding-window layer, > its position - window); everything else — table padding,
the null block's junk, keys written by padding rows — is masked, never trusted. The KV write
goes to each token's slot; padding rows' slots are in the null block, which sinks them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.core.batch import ModelBatch
from deepinfer.core.kv.block_pool import NULL_BLOCK_ID

# Keys per chunk of the online softmax: bounds the gathered [T, keys, heads, dim] tile.
CHUNK_KEYS = 256


@dataclass(frozen=True)
class GroupTables:
    """One KV group's per-token tables, as models that read the groups see them."""

    block_tables: torch.Tensor  # [T, W] long
    slot_mapping: torch.Tensor  # [T] long


@dataclass
class StaticMeta:
    """One step's attention inputs, every tensor of a bucket's shape."""

    positions: torch.Tensor  # [T] long
    tables: list[torch.Tensor]  # per KV group: [T, W] long, each token's sequence's blocks
    slot_mapping: list[torch.Tensor]  # per KV group: [T] long
    windows: list[int]  # per KV group: 0 for full attention
    group_of: dict[int, int]  # layer -> KV group
    block_size: int

    @property
    def groups(self) -> list[GroupTables]:
        return [GroupTables(t, s) for t, s in zip(self.tables, self.slot_mapping)]

    @property
    def num_inputs(self) -> int:
        """Device tensors the step copies in."""
        return 1 + len(self.tables) + len(self.slot_mapping)

    @classmethod
    def from_batch(cls, batch: ModelBatch, cache: PagedCache, width: int,
                   device: torch.device, scratch_slot: int | None = None) -> "StaticMeta":
        """width: the context bucket (blocks a table) of this step; the KV spec and block size
        are the cache's. scratch_slot: a model with state slots (StateMeta), the slot that
        padding reads and every token but a sequence's last writes."""
        spec = cache.spec
        lens = torch.tensor(batch.query_lens)
        tables, slots = [], []
        for group in batch.groups:
            rows = torch.full((len(group.block_tables), width), NULL_BLOCK_ID, dtype=torch.long)
            for i, table in enumerate(group.block_tables):
                rows[i, :len(table)] = torch.tensor(table[:width], dtype=torch.long)
            tables.append(rows.repeat_interleave(lens, dim=0).to(device))
            slots.append(torch.tensor(group.slot_mapping, dtype=torch.long, device=device))
        windows = [kv.sliding_window or 0 for kv in spec.groups]
        group_of = {layer: g.index for g in spec.groups for layer in g.layers}
        positions = torch.tensor(batch.positions, dtype=torch.long, device=device)
        if scratch_slot is None:
            return cls(positions, tables, slots, windows, group_of, cache.block_size)
        return StateMeta(positions, tables, slots, windows, group_of, cache.block_size,
                         *_state_inputs(batch, scratch_slot, device))


@dataclass
class StateMeta(StaticMeta):
    """StaticMeta of a model with per-sequence state slots (DeepSeek-V4's static path,
    models/deepseek_v4/static.py): per token, what its sequence's state is."""

    starts: torch.Tensor | None = None  # [T] long: its sequence's first new position
    state_slots: torch.Tensor | None = None  # [T] long: the slot it reads
    state_writes: torch.Tensor | None = None  # [T] long: the slot it writes

    @property
    def num_inputs(self) -> int:
        return super().num_inputs + 3


def _state_inputs(batch: ModelBatch, scratch: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: its sequence's chunk start, the slot it reads (padding: the scratch slot)
    and the slot it writes (its sequence's on the sequence's last token, else the scratch)."""
    real = batch.num_seqs - batch.num_padding_seqs
    starts, reads, writes = [], [], []
    for i, (q, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens)):
        slot = batch.state_slots[i] if i < real and batch.state_slots else scratch
        starts += [seq_len - q] * q
        reads += [slot] * q
        writes += [scratch] * (q - 1) + [slot]
    return tuple(torch.tensor(x, dtype=torch.long, device=device)
                 for x in (starts, reads, writes))


def chunk_blocks(width: int, block_size: int) -> int:
    """Blocks per chunk: about CHUNK_KEYS keys, a divisor of the (power-of-two) width."""
    return max(1, min(width, CHUNK_KEYS // block_size))


def static_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                           window: int = 0, scale: float | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache [slots, Hk, D], v_cache [slots, Hk, Dv]; tables [T, W] ->
    [T, Hq, Dv] in q's dtype. scale: of the scores (default 1/sqrt(D))."""
    tokens, q_heads, dim = q.shape
    kv_heads, value_dim = k_cache.shape[1], v_cache.shape[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    qg = q.float().view(tokens, kv_heads, q_heads // kv_heads, dim) * scale
    m = torch.full(qg.shape[:3], float("-inf"), device=q.device)
    total = torch.zeros(qg.shape[:3], device=q.device)
    acc = torch.zeros(qg.shape[:3] + (value_dim,), device=q.device)
    step = chunk_blocks(tables.shape[1], block_size)
    offsets = torch.arange(step * block_size, device=q.device)
    for first in range(0, tables.shape[1], step):
        slots = (tables[:, first:first + step, None] * block_size
                 + torch.arange(block_size, device=q.device)).reshape(tokens, -1)
        keys = first * block_size + offsets
        seen = keys[None, :] <= positions[:, None]
        if window:
            seen &= keys[None, :] > positions[:, None] - window
        scores = torch.einsum("thgd,tkhd->thgk", qg, k_cache[slots].float())
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        m, total, acc = _online_softmax(m, total, acc, scores, v_cache[slots].float())
    return (acc / total[..., None]).reshape(tokens, q_heads, value_dim).to(q.dtype)


def _online_softmax(m: torch.Tensor, total: torch.Tensor, acc: torch.Tensor,
                    scores: torch.Tensor, values: torch.Tensor):
    """Fold one chunk of keys into the running max, sum and weighted values. A chunk a token
    sees nothing of leaves its row unchanged (max -inf stays safe)."""
    new_m = torch.maximum(m, scores.amax(dim=-1))
    safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
    probs = torch.exp(scores - safe[..., None])
    scale = torch.exp(m - safe)
    acc = acc * scale[..., None] + torch.einsum("thgk,tkhd->thgd", probs, values)
    return new_m, total * scale + probs.sum(dim=-1), acc
