"""Paged attention on the CPU: KV written by slot, read back through block tables.

The cache of each layer is two flat tensors [num_blocks * block_size, kv_heads, head_dim], so
a slot id (block * block_size + offset) indexes a token's K or V directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.core.batch import ModelBatch


@dataclass
class CPUAttentionMeta:
    slot_mapping: torch.Tensor  # [T] long
    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    context_slots: list[torch.Tensor]  # per sequence: slots of all seq_len tokens
    decode_slots: torch.Tensor | None  # [B, max_len] for decode-only batches
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_len] True where a key is valid

    @classmethod
    def from_batch(cls, batch: ModelBatch) -> "CPUAttentionMeta":
        bs = batch.block_size
        offsets = torch.arange(bs)
        context = []
        for table, seq_len in zip(batch.block_tables, batch.seq_lens):
            blocks = torch.tensor(table[: (seq_len + bs - 1) // bs], dtype=torch.long)
            context.append((blocks[:, None] * bs + offsets).flatten()[:seq_len])
        starts = [0]
        for q in batch.query_lens[:-1]:
            starts.append(starts[-1] + q)
        slots, mask = (None, None)
        if batch.is_decode_only:
            slots, mask = _padded(context, batch.seq_lens)
        return cls(torch.tensor(batch.slot_mapping, dtype=torch.long), starts,
                   list(batch.query_lens), list(batch.seq_lens), context, slots, mask)


def _padded(context: list[torch.Tensor], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    max_len = max(seq_lens)
    slots = torch.zeros(len(context), max_len, dtype=torch.long)
    for i, c in enumerate(context):
        slots[i, : c.numel()] = c
    lens = torch.tensor(seq_lens)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return slots, mask


class CPUPagedAttention:
    def __init__(self, num_layers: int) -> None:
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.num_layers = num_layers

    def allocate(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (num_slots, kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype) for _ in range(self.num_layers)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: CPUAttentionMeta) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if meta.decode_slots is not None:
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for i, start in enumerate(meta.query_starts):
            qlen, seq_len = meta.query_lens[i], meta.seq_lens[i]
            rows = slice(start, start + qlen)
            if qlen == seq_len:  # no cached prefix: attend over the fresh K/V directly
                keys, values = k[rows], v[rows]
            else:
                keys = k_cache.index_select(0, meta.context_slots[i])
                values = v_cache.index_select(0, meta.context_slots[i])
            out[rows] = _causal(q[rows], keys, values)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: CPUAttentionMeta) -> torch.Tensor:
        batch, max_len = meta.decode_slots.shape
        kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        # index_select on the flat slot list is several times faster than advanced indexing.
        flat = meta.decode_slots.flatten()
        keys = k_cache.index_select(0, flat).view(batch, max_len, kv_heads, head_dim)
        values = v_cache.index_select(0, flat).view(batch, max_len, kv_heads, head_dim)
        # The query heads sharing a KV head act as that head's query rows: one dense attention
        # per KV head instead of the slow grouped-query path for one-token queries.
        group = q.shape[1] // kv_heads
        out = F.scaled_dot_product_attention(
            q.view(batch, kv_heads, group, head_dim), keys.transpose(1, 2),
            values.transpose(1, 2), attn_mask=meta.decode_mask)
        return out.reshape(batch, kv_heads * group, head_dim)


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [Q, Hq, D] are the last Q of the L keys; each sees keys up to its own position."""
    qlen, klen = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if qlen == klen:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        pos = torch.arange(klen - qlen, klen)[:, None]
        mask = torch.arange(klen)[None, :] <= pos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)
