"""HiCache's host tier on NVIDIA GPUs: a pinned, page-first pool moved by the UVA copy kernel.

Copies are enqueued on the engine's stream, so a step launched after a load reads the loaded
pages in order without a host wait; the returned handle (an event) tells HiCache when a host
page may be reused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer.backends.cuda.page_copy import UVAPageCopier


@dataclass
class EventHandle:
    event: torch.cuda.Event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


@dataclass
class CUDAHostPool:
    pages: torch.Tensor  # pinned [num_pages, layers, 2, block_size, kv_heads, head_dim]
    copier: UVAPageCopier

    @classmethod
    def allocate(cls, num_pages: int, kv: torch.Tensor, block_size: int) -> "CUDAHostPool":
        layers, _, _, kv_heads, head_dim = kv.shape
        pages = torch.empty((num_pages, layers, 2, block_size, kv_heads, head_dim),
                            dtype=kv.dtype, pin_memory=True)
        return cls(pages, UVAPageCopier())

    def copy(self, kv: torch.Tensor, host_pages: Sequence[int], device_blocks: Sequence[int],
             block_size: int, to_device: bool) -> EventHandle | None:
        if len(host_pages) != len(device_blocks):
            raise ValueError(f"{len(host_pages)} host pages for {len(device_blocks)} blocks")
        if not host_pages:
            return None
        # Lists are range-checked and uploaded through pinned staging by the copier.
        self.copier.copy(self.pages, kv, list(host_pages), list(device_blocks), block_size,
                         to_device)
        event = torch.cuda.Event()
        event.record()
        return EventHandle(event)
