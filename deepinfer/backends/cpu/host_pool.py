"""HiCache's host pages on the CPU backend: plain memory (nothing to pin), page-first.

Layout [num_pages, num_layers, 2 (K, V), block_size, kv_heads, head_dim]: a page is one
contiguous run of every layer's K and V for its block_size tokens, so a device-side backend would
move it as one large DMA. Copies are synchronous index_select / index_copy_ on the per-layer
flat caches ([num_blocks * block_size, kv_heads, head_dim]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer.backends.cpu.attention import CPUPagedAttention


@dataclass
class CPUHostPool:
    pages: torch.Tensor

    @classmethod
    def allocate(cls, num_pages: int, num_layers: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> "CPUHostPool":
        # empty, not zeros: the OS commits memory only for pages actually written.
        return cls(torch.empty((num_pages, num_layers, 2, block_size, kv_heads, head_dim),
                               dtype=dtype))

    def copy(self, attention: CPUPagedAttention, host_pages: Sequence[int],
             device_blocks: Sequence[int], to_device: bool) -> None:
        if len(host_pages) != len(device_blocks):
            raise ValueError(f"{len(host_pages)} host pages for {len(device_blocks)} blocks")
        if not host_pages:
            return
        pages = torch.tensor(host_pages, dtype=torch.long)
        blocks = torch.tensor(device_blocks, dtype=torch.long)
        block_size = self.pages.shape[3]
        caches = (attention.k_cache, attention.v_cache)
        with torch.inference_mode():
            if to_device:
                data = self.pages.index_select(0, pages)  # one gather of whole pages
                for layer in range(self.pages.shape[1]):
                    for kv, cache in enumerate(caches):
                        paged = cache[layer].view(-1, block_size, *cache[layer].shape[1:])
                        paged.index_copy_(0, blocks, data[:, layer, kv])
            else:
                for layer in range(self.pages.shape[1]):
                    for kv, cache in enumerate(caches):
                        paged = cache[layer].view(-1, block_size, *cache[layer].shape[1:])
                        self.pages[:, layer, kv].index_copy_(0, pages,
                                                             paged.index_select(0, blocks))
