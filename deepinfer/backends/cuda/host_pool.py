"""HiCache's host tier on NVIDIA GPUs: a pinned, page-first pool moved by the UVA copy kernel.

    chunks = DeviceChunks.prepare(tensors, groups, num_blocks)  # the device KV cache, checked
    pool = CUDAHostPool.allocate(num_pages, chunks)  # pinned uint8 [num_pages, page_bytes]
    handle = pool.copy(host_pages, device_blocks_per_group, to_device=True)

A page is one block of every KV group: the chunks' blocks back to back, in chunk order (see
page_copy.py). A null block (id 0) in device_blocks[g][i] leaves group g of page i alone, as on
the CPU backend (Capabilities.host_copy_skips_null): a sliding-window group's page that left its
window is neither stored nor loaded, and block 0 is never written.

Loads are enqueued on the current stream of the chunks' device (the engine's), so a step
launched after a load reads the loaded pages in order without a host wait; or, layer by layer
(load_layers), on a load stream of their own with an event per layer, which the next step
waits for layer by layer (LayerLoad): layer i's pages come in while layers before it compute.
Stores (the
write-through of a prompt just computed, gigabytes for a long one) run on a stream of their
own, after the point of the engine's stream the caller names (the end of the step that
computed the pages: not behind the next step, already launched under async scheduling), or
else after the engine's work enqueued so far, with a grid just below PCIe saturation
(STORE_CTAS): the steps that follow neither queue behind them nor slow down. That is safe
because HiCache holds the stored blocks until the store's event has passed (nothing writes a
full prompt page of a live request, and a held block is not handed out again). The returned
handle (an event) tells HiCache when a host page may be reused and the blocks let go.
"""
from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer.backends.cuda.page_copy import (
    DeviceChunks,
    GroupIndices,
    Indices,
    PinnedStaging,
    UVAPageCopier,
    pinned_empty,
)
from deepinfer.backends.torch.host_pool import check_pool_file


@dataclass
class EventHandle:
    event: torch.cuda.Event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


@dataclass
class LayerLoad:
    """A host -> device load in flight, layer by layer on the pool's load stream: an event per
    layer, recorded once that layer's pages are in. The step that reads them waits for layer
    i's event just before layer i reads its KV (wait_layer), so the copy of later layers runs
    beside the earlier layers' compute; a step that cannot wait per layer (a graph replay)
    waits for all of it (wait_all). The last event tells HiCache the host pages are free."""

    events: dict[int, torch.cuda.Event]
    last: torch.cuda.Event

    def wait_layer(self, layer: int, stream: torch.cuda.Stream) -> None:
        event = self.events.get(layer)
        if event is not None:
            stream.wait_event(event)

    def wait_all(self, stream: torch.cuda.Stream) -> None:
        stream.wait_event(self.last)

    def done(self) -> bool:
        return self.last.query()

    def wait(self) -> None:
        self.last.synchronize()


# CTAs of a store (256 threads, 4 loads in flight each: 16 KiB of writes to host memory per
# CTA): few enough that the writes never reach the PCIe limit, where the queue behind them
# stalls the model's own memory traffic (docs/benchmarks.md, "Tuned constants").
STORE_CTAS = 2


# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every device's DMA, and (under
# UVA) addressable by kernels at its host address, as the UVA copy kernel needs.
REGISTER_FLAGS = 0x1 | 0x2


class PinnedMap(mmap.mmap):
    """A file mapped shared and page-locked for as long as the mapping lives: a tensor made
    from it (torch.frombuffer) keeps it alive, and when the last one goes the registration
    ends before the pages are unmapped. An address range unmapped while still registered
    would make the next registration of a mapping placed there fail
    (cudaErrorHostMemoryAlreadyRegistered), as when a process makes a second pool over the
    same file (an engine restarted in place, the checks of two engines in one process)."""

    address = 0  # the registered range's start; 0 while not registered

    def __del__(self) -> None:
        if self.address:
            address, self.address = self.address, 0
            try:
                _cudart().cudaHostUnregister(address)
            except (RuntimeError, AttributeError, TypeError):
                pass  # at interpreter exit CUDA (or this module) may be torn down first


def _cudart():
    return torch.cuda.cudart()


# File systems whose pages the driver can page-lock for good: shared memory. A disk file
# system's cannot be (the kernel refuses long-term pins of page-cache pages).
LOCKABLE_FILE_SYSTEMS = ("tmpfs", "hugetlbfs")
_OCTAL = re.compile(r"\\([0-7]{3})")  # /proc/self/mounts escapes space, tab, newline, "\\"


def file_system_of(path: str, mounts_file: str = "/proc/self/mounts") -> str | None:
    """The type of the file system holding path (the longest mount point above it in the
    mount table), or None where that cannot be read."""
    real, best, kind = os.path.realpath(path), "", None
    try:
        with open(mounts_file) as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    for point, fs_type in mounts:
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), point)  # "\040" is a space
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fs_type
    return kind


def pin_shared(path: str, nbytes: int) -> torch.Tensor:
    """A file's first nbytes, mapped shared and page-locked (cudaHostRegister), as a uint8
    [nbytes] tensor; unregistered and unmapped when the tensor and its views are gone."""
    check_pool_file(path, nbytes)
    fs_type = file_system_of(path)
    if fs_type is not None and fs_type not in LOCKABLE_FILE_SYSTEMS:
        # Asked anyway, the driver fails, and its error stays behind as the runtime's last
        # error, to be raised by whichever later CUDA call checks it.
        raise RuntimeError(f"the shared host pool {path} is on {fs_type}, which cannot be "
                           "page-locked: it must be in shared memory (tmpfs, e.g. /dev/shm)")
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = PinnedMap(fd, nbytes, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    err = _cudart().cudaHostRegister(pages.data_ptr(), nbytes, REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the shared host pool {path} ({nbytes} bytes) "
                           f"failed: CUDA error {int(err)} (is it on tmpfs, e.g. /dev/shm?)")
    mapping.address = pages.data_ptr()
    return pages


@dataclass
class CUDAHostPool:
    pages: torch.Tensor  # pinned uint8 [num_pages, page_bytes]
    chunks: DeviceChunks
    copier: UVAPageCopier
    store_copier: UVAPageCopier = UVAPageCopier(max_ctas=STORE_CTAS)
    store_stream: torch.cuda.Stream | None = None  # None: stores on the engine's stream too
    load_stream: torch.cuda.Stream | None = None  # layer-by-layer loads (load_layers)
    staging: PinnedStaging | None = None  # the copies' index uploads (None: pin_memory())

    @classmethod
    def allocate(cls, num_pages: int, chunks: DeviceChunks,
                 copier: UVAPageCopier | None = None,
                 shared_file: str | None = None) -> "CUDAHostPool":
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        nbytes = num_pages * chunks.page_bytes
        if shared_file is not None:  # the node's pool: every rank maps and registers the file
            pages = pin_shared(shared_file, nbytes)
        else:  # exactly the bytes asked for: torch's allocator would round up to a power of 2
            pages = pinned_empty(nbytes, chunks.device)
        # A copy moves at most one pair per host page: its indices are a page id and a block
        # per KV group each.
        staging = PinnedStaging(num_pages * (1 + len(chunks.layout.num_blocks)))
        return cls(pages.view(num_pages, chunks.page_bytes), chunks, copier or UVAPageCopier(),
                   store_stream=torch.cuda.Stream(chunks.device),
                   load_stream=torch.cuda.Stream(chunks.device), staging=staging)

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def page_bytes(self) -> int:
        return self.chunks.page_bytes

    def copy(self, host_pages: Indices, device_blocks: GroupIndices, to_device: bool,
             after: torch.cuda.Event | None = None) -> EventHandle | None:
        """Pair i: host page host_pages[i] <-> block device_blocks[g][i] of every chunk of group
        g, except where that block is the null block (group g of page i is left alone). Indices
        are range-checked on the host (tensors on the device read back first) and uploaded
        through the pool's pinned staging buffers. A store starts after `after`, the point of
        the engine stream where its blocks' contents are final (None: the engine's work
        enqueued so far). None when there is nothing to copy."""
        engine = torch.cuda.current_stream(self.chunks.device)
        if to_device or self.store_stream is None:
            return self._copy_on(engine, self.copier, host_pages, device_blocks, to_device)
        if after is None:
            self.store_stream.wait_stream(engine)
        else:
            self.store_stream.wait_event(after)
        with torch.cuda.stream(self.store_stream):
            return self._copy_on(self.store_stream, self.store_copier, host_pages,
                                 device_blocks, to_device)

    def load_layers(self, host_pages: Indices, device_blocks: GroupIndices,
                    chunk_layers: Sequence[int]) -> LayerLoad | None:
        """Host pages into device blocks (as copy, to_device) on the load stream, layer by
        layer (chunk_layers[c]: chunk c's layer), after the engine's work enqueued so far (the
        blocks may have been read by a step still in flight). None when there is nothing to
        copy."""
        if len(host_pages) == 0 or self.load_stream is None:
            return None
        engine = torch.cuda.current_stream(self.chunks.device)
        self.load_stream.wait_stream(engine)
        events: dict[int, torch.cuda.Event] = {}

        def layer_done(layer: int) -> None:
            event = torch.cuda.Event()
            event.record(self.load_stream)
            events[layer] = event

        with torch.cuda.stream(self.load_stream):
            self.copier.copy_layers(self.pages, self.chunks, host_pages, device_blocks, True,
                                    chunk_layers, layer_done, staging=self.staging)
        last = torch.cuda.Event()
        last.record(self.load_stream)
        return LayerLoad(events, last)

    def _copy_on(self, stream: torch.cuda.Stream, copier: UVAPageCopier, host_pages: Indices,
                 device_blocks: GroupIndices, to_device: bool) -> EventHandle | None:
        # Validated even when empty, so a wrong group count fails on the first call.
        copier.copy(self.pages, self.chunks, host_pages, device_blocks, to_device,
                    skip_null=True, staging=self.staging)
        if len(host_pages) == 0:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return EventHandle(event)
