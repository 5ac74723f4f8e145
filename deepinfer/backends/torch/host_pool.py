"""HiCache's host pages of a KV pool that lives in host memory (the CPU backend's): plain
memory (nothing to pin), page-first.

Layout [num_pages, page_numel]: a page is one contiguous run of every chunk of the KV spec
(every layer's entries of one block, group by group), so a device-side backend would move it
as one large DMA. Copies are synchronous index_select / index_copy_ per chunk, over the chunk
tensors viewed as [num_blocks, numel per block].
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.core.kv.block_pool import NULL_BLOCK_ID


def host_memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor as a memoryview (HiCache's disk tier reads and
    writes pages through it). The view does not keep `t` alive: the pool that owns it does."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("host_memory needs a contiguous tensor in host memory")
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def check_pool_file(path: str, nbytes: int) -> None:
    """A shared pool's file must already hold the bytes a rank maps (its maker reserved
    them): a mapping past the end would fault at first touch."""
    if os.path.getsize(path) < nbytes:
        raise ValueError(f"{path} holds {os.path.getsize(path)} bytes, not {nbytes}")


def map_shared(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """numel elements of an existing file, mapped shared (writes reach every process that
    maps it), as a 1-D tensor."""
    check_pool_file(path, numel * torch.empty((), dtype=dtype).element_size())
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


@dataclass
class CPUHostPool:
    pages: torch.Tensor

    @classmethod
    def allocate(cls, num_pages: int, cache: PagedCache,
                 shared_file: str | None = None) -> "CPUHostPool":
        chunks = cache.chunk_tensors()
        numel = sum(c.numel for c, _ in chunks)
        dtype = chunks[0][1].dtype
        if shared_file is not None:  # the node's pool: every rank maps the file
            return cls(map_shared(shared_file, num_pages * numel, dtype).view(num_pages, numel))
        # empty, not zeros: the OS commits memory only for pages actually written.
        return cls(torch.empty((num_pages, numel), dtype=dtype))

    def copy(self, cache: PagedCache, host_pages: Sequence[int],
             device_blocks: Sequence[Sequence[int]], to_device: bool) -> None:
        if any(len(host_pages) != len(blocks) for blocks in device_blocks):
            raise ValueError(f"{len(host_pages)} host pages for {len(device_blocks[0])} blocks")
        if not host_pages:
            return
        pages = torch.tensor(host_pages, dtype=torch.long)
        blocks = [torch.tensor(b, dtype=torch.long) for b in device_blocks]
        # Per group, the pairs it takes part in: a null block is a sliding group's page that
        # left its window, whose bytes are neither stored nor loaded (and block 0 never written).
        held = [(b != NULL_BLOCK_ID).nonzero().flatten() for b in blocks]
        data = self.pages.index_select(0, pages) if to_device else self.pages  # one gather
        offset = 0
        with torch.inference_mode():
            for chunk, tensor in cache.chunk_tensors():
                paged = tensor.view(-1, chunk.numel)
                cols = slice(offset, offset + chunk.numel)
                rows, group_blocks = held[chunk.group], blocks[chunk.group]
                if to_device:  # data: the pages read, in host_pages order
                    paged.index_copy_(0, group_blocks[rows], data[rows, cols])
                else:
                    self.pages[:, cols].index_copy_(0, pages[rows],
                                                    paged.index_select(0, group_blocks[rows]))
                offset += chunk.numel
