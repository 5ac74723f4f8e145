"""The device KV pool of a torch backend, laid out from the model's KV spec.

One tensor per (layer, cache entry) — a llama layer's K and V, an MLA layer's latent —
[num_blocks * entries_per_block, *entry shape], so a slot id (block * block_size + offset)
indexes a token's entry directly. Each chunk of the spec is one such tensor, and block b of it
is one contiguous run: what a page copy moves. Models with per-request state get a
[num_slots, state_bytes] byte tensor besides.
"""
from __future__ import annotations

import math
import mmap

import torch

from deepinfer.core.kv.spec import Chunk, KVSpec


class PagedCache:
    def __init__(self) -> None:
        self.spec: KVSpec | None = None  # set once the model is built
        self.block_size = 0
        self.num_blocks = 0
        self._layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._chunks: list[tuple[Chunk, torch.Tensor]] = []
        self.state: torch.Tensor | None = None
        # Bytes, as a page copy moves them; a device that cannot reinterpret a tensor's bytes
        # in the middle of a graph (XLA) keeps the slots in the dtype the model reads them in.
        self.state_dtype = torch.uint8

    @property
    def kv_spec(self) -> KVSpec:
        """The model's KV spec; set when the model is built, before any pool is allocated."""
        if self.spec is None:
            raise RuntimeError("the KV pool has no KV spec: load a model first")
        return self.spec

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_state_slots: int = 0) -> None:
        self.free()  # the old pool first: the two need not fit together
        self.block_size, self.num_blocks = block_size, num_blocks
        for group in self.kv_spec.groups:
            for layer in group.layers:
                self._layers[layer] = tuple(
                    zeros((num_blocks * e.entries_per_block(block_size), *e.shape), dtype,
                          device) for e in group.kind.entries)
        self._chunks = self._pair_chunks()
        if self.kv_spec.state_bytes and num_state_slots:
            width = self.kv_spec.state_bytes // self.state_dtype.itemsize
            self.state = zeros((num_state_slots, width), self.state_dtype, device)

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """The layer's entry tensors, in the order its LayerKV lists them."""
        return self._layers[index]

    def chunk_tensors(self) -> list[tuple[Chunk, torch.Tensor]]:
        """Every chunk of a page with the tensor holding it, in page order."""
        return self._chunks

    def _pair_chunks(self) -> list[tuple[Chunk, torch.Tensor]]:
        names = {}
        for group in self.kv_spec.groups:
            for layer in group.layers:
                for entry, tensor in zip(group.kind.entries, self._layers[layer]):
                    names[(layer, entry.name)] = tensor
        return [(c, names[(c.layer, c.entry.name)]) for c in self.kv_spec.chunks(self.block_size)]

    @property
    def allocated(self) -> bool:
        return bool(self._layers)

    @property
    def nbytes(self) -> int:
        tensors = [t for entries in self._layers.values() for t in entries]
        if self.state is not None:
            tensors.append(self.state)
        return sum(t.numel() * t.element_size() for t in tensors)

    def zero_(self) -> None:
        """Every page and state slot back to zeros (after steps that served no request)."""
        for entries in self._layers.values():
            for tensor in entries:
                tensor.zero_()
        if self.state is not None:
            self.state.zero_()

    def free(self) -> None:
        self._layers, self._chunks = {}, []
        self.state = None


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed pool tensor. In host memory it is made of fresh anonymous pages, which read as
    zero and take memory only once written: a CPU server's resident size is the KV its
    requests have used, not the whole pool."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes)  # the tensor holds the mapping alive through its buffer
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
