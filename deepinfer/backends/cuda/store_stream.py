"""HiCache's write-through off the engine's stream.

A store copies a prefill's pages to the host at the end of the prefill: 4 GB for a 32K-token
Llama-3-8B prompt, ~80 ms over PCIe. On the engine's stream every step queued behind it waited
that long (on the H200 a device hit sent right after its prompt was stored took 120 ms against
65 ms once the store was done). Stores run on their own stream instead, after what the engine
has queued (the pages' KV writes). A step only reads the pages a store reads, unless it writes
one of them (a block freed and reused, or a load into it): the engine's stream then waits for
that store first, on the device, without a host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import torch

from deepinfer.core.batch import ModelBatch

if TYPE_CHECKING:
    from deepinfer.backends.cuda.host_pool import EventHandle


@dataclass(frozen=True)
class _Store:
    event: torch.cuda.Event
    blocks: frozenset[int]  # device blocks the store reads


class StoreStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._stores: list[_Store] = []

    def store(self, copy: Callable[[], EventHandle | None], blocks: Iterable[int]
              ) -> EventHandle | None:
        """Run `copy` (a device-to-host page copy that records its event on the current
        stream) on the store stream, after everything the engine's stream has queued."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            handle = copy()
        if handle is not None:
            self._stores.append(_Store(handle.event, frozenset(blocks)))
        return handle

    def before_writes(self, blocks: Iterable[int]) -> None:
        """The engine's stream waits for every store in flight that reads one of `blocks`."""
        self._stores = [s for s in self._stores if not s.event.query()]
        if not self._stores:
            return
        blocks = set(blocks)
        engine = torch.cuda.current_stream(self.device)
        for s in self._stores:
            if not s.blocks.isdisjoint(blocks):
                engine.wait_event(s.event)

    def before_step(self, batch: ModelBatch) -> None:
        """before_writes() for the blocks a step's tokens write their KV into."""
        if not self._stores:
            return
        slots = np.concatenate([np.asarray(g.slot_mapping, dtype=np.int64) for g in batch.groups])
        self.before_writes(np.unique(slots[slots >= 0] // batch.block_size).tolist())
