"""What a model's layers cache: the KV spec, declared by the model, read by everyone else.

A layer caches zero or more *entries* per token (K and V; one MLA latent; a compressed entry per
`rate` tokens) and attends over all of its past or a sliding window of it. Layers with the same
description form a *KV group*: the block manager keeps one block table per group and request,
so a sliding-window group can free the blocks that fell out of its window while a full group
keeps them. A block id names `block_size` tokens within its group; one *page* (what HiCache
moves) is one block of every group. Everything that sizes or copies KV memory (block bytes,
device pools, host pools, page copies) walks `chunks()`, never assumes "K and V".
Per-request state (fixed bytes per request, e.g. a compressor's carry-over) is a slot, not a page.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class CacheEntry:
    """One tensor a layer keeps per cached token, or per `rate` tokens."""

    name: str  # "k", "v", "latent", ...
    shape: tuple[int, ...]  # of one entry, e.g. (kv_heads, head_dim)
    rate: int = 1  # one entry per `rate` tokens (compressed caches)

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.rate:
            raise ValueError(f"block_size {block_size} is not a multiple of the {self.name!r} "
                             f"entry's compression rate {self.rate}")
        return block_size // self.rate

    def numel_per_block(self, block_size: int) -> int:
        return self.entries_per_block(block_size) * math.prod(self.shape)


@dataclass(frozen=True)
class LayerKV:
    """A layer's cache: its entries and how far back it attends."""

    entries: tuple[CacheEntry, ...]  # (): the layer caches nothing
    sliding_window: int | None = None  # a query at p sees keys p - W < k <= p

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


def kv_heads_layer(kv_heads: int, head_dim: int, sliding_window: int | None = None) -> LayerKV:
    """The usual attention layer: K and V of kv_heads x head_dim per token."""
    shape = (kv_heads, head_dim)
    return LayerKV((CacheEntry("k", shape), CacheEntry("v", shape)), sliding_window)


def latent_layer(latent_dim: int) -> LayerKV:
    """An MLA layer: one latent vector per token (kv_lora_rank + qk_rope_head_dim), K and V
    both read from it."""
    return LayerKV((CacheEntry("latent", (latent_dim,)),))


@dataclass(frozen=True)
class KVGroup:
    index: int
    layers: tuple[int, ...]
    kind: LayerKV

    @property
    def sliding_window(self) -> int | None:
        return self.kind.sliding_window


@dataclass(frozen=True)
class Chunk:
    """One (layer, entry) slice of one block: the unit page copies and pools are built from."""

    group: int
    layer: int
    entry: CacheEntry
    numel: int  # elements per block


@dataclass(frozen=True)
class KVSpec:
    layers: tuple[LayerKV, ...]
    state_bytes: int = 0  # per-request state besides pages (0: none)
    # block_size must be a multiple of this: a model whose state is only well defined at
    # page ends that line up with its compression windows (DeepSeek-V4: 128)
    block_multiple: int = 1
    # The state as of every page end is stored in the pages themselves (DeepSeek-V4's
    # page_state entries): a request can resume from cached pages, so prefix hits are allowed.
    state_in_pages: bool = False

    @cached_property
    def groups(self) -> tuple[KVGroup, ...]:
        """Layers with equal descriptions, in order of first appearance; empty layers in none."""
        members: dict[LayerKV, list[int]] = {}
        for i, layer in enumerate(self.layers):
            if layer.entries:
                members.setdefault(layer, []).append(i)
        return tuple(KVGroup(g, tuple(ids), kind) for g, (kind, ids) in enumerate(members.items()))

    @cached_property
    def _group_of(self) -> dict[int, int]:
        return {layer: g.index for g in self.groups for layer in g.layers}

    def group_of(self, layer: int) -> int:
        return self._group_of[layer]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def has_sliding_window(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    def chunks(self, block_size: int) -> list[Chunk]:
        """Every (layer, entry) slice of a page, group by group: a page's layout in order."""
        if block_size % self.block_multiple:
            raise ValueError(f"this model needs a block_size that is a multiple of "
                             f"{self.block_multiple}, got {block_size}")
        return [Chunk(g.index, layer, entry, entry.numel_per_block(block_size))
                for g in self.groups for layer in g.layers for entry in g.kind.entries]

    def block_bytes(self, block_size: int, element_size: int) -> int:
        """Bytes of one page: one block of every group."""
        return sum(c.numel for c in self.chunks(block_size)) * element_size

    @classmethod
    def uniform(cls, num_layers: int, layer: LayerKV, state_bytes: int = 0) -> "KVSpec":
        return cls(tuple([layer] * num_layers), state_bytes)
