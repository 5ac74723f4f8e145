"""Paged attention in plain torch: entries written by slot, read back through block tables.

Each layer's cache entries are flat tensors [num_blocks * block_size, ...] (paged_cache.py),
so a slot id (block * block_size + offset) indexes a token's entry directly.
Metadata is built once per step and KV group; a sliding-window group gathers only the keys its
window can see (its table holds the null block before them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.core.batch import GroupBatch, ModelBatch


@dataclass
class GroupMeta:
    """One KV group's view of the step."""

    slot_mapping: torch.Tensor  # [T] long
    key_starts: list[int]  # per sequence: position of its first visible key
    context_slots: list[torch.Tensor]  # per sequence: slots of keys key_starts[i]..seq_len-1
    window: int | None
    decode_slots: torch.Tensor | None  # [B, max_keys] for decode-only steps
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_keys] True where a key is visible
    decode_lens: torch.Tensor | None  # [B] visible keys of each sequence (decode-only steps)
    block_tables: torch.Tensor  # [B, max_blocks] long, 0-padded (models that locate rows)


@dataclass
class PagedAttentionMeta:
    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    groups: list[GroupMeta]
    group_of: dict[int, int]  # layer -> group
    state_slots: list[int] = field(default_factory=list)  # per sequence (models with state)
    tokens_per_seq: int = 1  # decode rows in runs of one sequence (ModelBatch.tokens_per_seq)

    @classmethod
    def from_batch(cls, batch: ModelBatch, cache: PagedCache) -> "PagedAttentionMeta":
        """The step's metadata over the cache's KV spec and block size."""
        spec = cache.kv_spec
        starts = [0]
        for q in batch.query_lens[:-1]:
            starts.append(starts[-1] + q)
        groups = [_group_meta(g, batch, kv.sliding_window, cache.block_size)
                  for g, kv in zip(batch.groups, spec.groups)]
        group_of = {layer: g.index for g in spec.groups for layer in g.layers}
        return cls(starts, list(batch.query_lens), list(batch.seq_lens), groups, group_of,
                   list(batch.state_slots), batch.tokens_per_seq)


def _group_meta(group: GroupBatch, batch: ModelBatch, window: int | None,
                bs: int) -> GroupMeta:
    key_starts, context = [], []
    for table, qlen, seq_len in zip(group.block_tables, batch.query_lens, batch.seq_lens):
        first_query = seq_len - qlen
        start = 0 if window is None else max(0, first_query - window + 1)
        positions = torch.arange(start, seq_len)
        blocks = torch.tensor(table[: (seq_len + bs - 1) // bs], dtype=torch.long)
        context.append(blocks[positions // bs] * bs + positions % bs)
        key_starts.append(start)
    slots, mask, lens = (None, None, None)
    if batch.is_decode_only:
        slots, mask, lens = _padded(context)
    return GroupMeta(torch.tensor(group.slot_mapping, dtype=torch.long), key_starts, context,
                     window, slots, mask, lens, _padded_tables(group.block_tables))


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(tables), max((len(t) for t in tables), default=0), dtype=torch.long)
    for i, table in enumerate(tables):
        out[i, :len(table)] = torch.tensor(table, dtype=torch.long)
    return out


def _padded(context: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = torch.tensor([c.numel() for c in context], dtype=torch.long)
    max_len = int(lens.max())
    slots = torch.zeros(len(context), max_len, dtype=torch.long)
    for i, c in enumerate(context):
        slots[i, : c.numel()] = c
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return slots, mask, lens


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: PagedAttentionMeta, layer: int,
                    scale: float | None = None) -> torch.Tensor:
    """Write k, v into the layer's caches at the step's slots, then attend q causally over each
    sequence's visible keys."""
    g = meta.groups[meta.group_of[layer]]
    k_cache.index_copy_(0, g.slot_mapping, k)
    v_cache.index_copy_(0, g.slot_mapping, v)
    return attend_cached(q, k, v, k_cache, v_cache, g, meta, scale)


def latent_attention(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                     meta: PagedAttentionMeta, layer: int, value_dim: int,
                     scale: float) -> torch.Tensor:
    """MLA, weight-absorbed: every head attends one shared latent per token (keys: all of it,
    values: its first value_dim dims), written once and read twice."""
    g = meta.groups[meta.group_of[layer]]
    cache.index_copy_(0, g.slot_mapping, latent)
    keys, fresh = cache.unsqueeze(1), latent.unsqueeze(1)
    return attend_cached(q, fresh, fresh[..., :value_dim], keys, keys[..., :value_dim], g, meta,
                         scale)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, g: GroupMeta, meta: PagedAttentionMeta,
                  scale: float | None) -> torch.Tensor:
    """Attention over caches that already hold this step's entries."""
    if g.decode_slots is not None:
        return _decode(q, k_cache, v_cache, g.decode_slots, g.decode_mask, scale)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    for i, start in enumerate(meta.query_starts):
        qlen, seq_len = meta.query_lens[i], meta.seq_lens[i]
        rows = slice(start, start + qlen)
        if qlen == seq_len and g.window is None:  # no cached prefix: the fresh entries
            keys, values = k[rows], v[rows]
        else:
            keys = k_cache.index_select(0, g.context_slots[i])
            values = v_cache.index_select(0, g.context_slots[i])
        out[rows] = _causal(q[rows], keys, values, seq_len, g.key_starts[i], g.window, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
            mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    batch, max_len = slots.shape
    kv_heads = k_cache.shape[1]
    # index_select on the flat slot list is several times faster than advanced indexing.
    flat = slots.flatten()
    keys = k_cache.index_select(0, flat).view(batch, max_len, kv_heads, -1)
    values = v_cache.index_select(0, flat).view(batch, max_len, kv_heads, -1)
    # The query heads sharing a KV head act as that head's query rows: one dense attention
    # per KV head instead of the slow grouped-query path for one-token queries.
    group = q.shape[1] // kv_heads
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, group, q.shape[-1]), keys.transpose(1, 2),
        values.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(batch, kv_heads * group, values.shape[-1])


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int,
            key_start: int, window: int | None, scale: float | None) -> torch.Tensor:
    """q [Q, Hq, D] are the last Q positions of the sequence; keys start at key_start; each
    query sees keys up to its own position (and within its window)."""
    qlen, klen = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if qlen == klen and window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True,
                                             scale=scale)
    else:
        qpos = torch.arange(seq_len - qlen, seq_len)[:, None]
        kpos = torch.arange(key_start, key_start + klen)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True,
                                             scale=scale)
    return out.transpose(0, 1)
