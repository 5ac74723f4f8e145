"""Page copies between HiCache's pinned host pool and the device KV cache (see page_copy.cu).

A model's KV cache is a list of *chunks* (`KVSpec.chunks`: one per (layer, cache entry), e.g. K
and V of every llama layer, one latent per MLA layer), each in a KV group with its own block
ids. On the device, chunk c is a contiguous tensor whose bytes are num_blocks[g] blocks of
block_bytes[c] (block b at byte b * block_bytes[c]): a per-layer K cache [num_blocks *
block_size, kv_heads, head_dim] is one, an MLA latent cache [num_blocks * block_size, L + R]
another. Dtypes don't matter: everything moves as bytes. A host page is one block of every
group: the chunks' blocks back to back in list order, `page_bytes` in all, and the host pool
is one pinned tensor of num_pages such pages ([num_pages, page_bytes] bytes, any dtype).

    chunks = DeviceChunks.prepare(tensors, groups, num_blocks)  # once, when the cache exists
    pool = pinned_empty(num_pages * chunks.page_bytes, chunks.device).view(num_pages, -1)
    UVAPageCopier().copy(pool, chunks, host_pages, device_blocks, to_device=True)

(host_pool.CUDAHostPool wraps these three.) ChunkLayout.from_spec(spec, block_size,
element_size, num_blocks) gives the same layout from a KVSpec, without tensors.

Pair i moves host page host_pages[i] <-> block device_blocks[g][i] of every chunk of group g:
host_pages is [n], device_blocks [num_groups][n] (a 2-D tensor, or one index list or tensor
per group). DeviceChunks validates the chunk tensors once and keeps their per-chunk table on the
device; it holds references to them, so it stays valid exactly as long as those tensors are the
cache (prepare it again when the cache is reallocated).

UVAPageCopier.copy runs one kernel that reads (or writes) the pinned pool through its UVA
address: no per-chunk DMA commands, and the indices can stay on the device. Indices already on
the chunks' device are used as they are (int64, unchecked: a range check would stall on the
host); lists and CPU tensors are range-checked and uploaded through pinned staging without a
host wait. copy_memcpy is the baseline it replaces: one cudaMemcpyAsync per (pair, chunk).
copy_reference is the same copy in plain torch (slow; the tests compare against it).

Null blocks (skip_null=True, what HiCache's pool asks for: Capabilities.host_copy_skips_null):
where device_blocks[g][i] is the null block 0 (a sliding-window group's page that left its
window), pair i moves none of group g's chunks, in either direction: the host bytes stay as
they were and block 0 is never written. The pairs are split on the host (copy_parts, as the CPU
backend's host pool does): pairs whose groups holding a block are the same form one part, moved
by one launch over a table of those groups' chunks only, so the kernel never sees a null block
it would move. Every part's indices go up in one upload; indices already on the device are
read back to the host first (a sync).

ChunkLayout and the index checks are plain Python, usable (and tested) without a GPU. The
extension is built on first use and kept under the deepinfer cache dir, so later starts load it.
"""
from __future__ import annotations

import functools
import numbers
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

from deepinfer.core.config import cache_dir
from deepinfer.core.kv.block_pool import NULL_BLOCK_ID

if TYPE_CHECKING:
    from deepinfer.core.kv.spec import KVSpec

Indices = Union[torch.Tensor, Sequence[int]]
GroupIndices = Union[torch.Tensor, Sequence[Indices]]  # [num_groups, n]

ALIGN = 16  # the kernel moves 16-byte vectors: every block and base address must be aligned
# Rows of the per-chunk table, in the order of page_copy.cu's enum Row.
TABLE_ROWS = ("base", "block_bytes", "host_offset", "group", "num_blocks")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page_copy.cu")


@functools.lru_cache(maxsize=None)
def load_extension(capability: tuple[int, int]):
    """Build (or load the cached build of) page_copy.cu for one compute capability."""
    from torch.utils.cpp_extension import load

    arch = f"{capability[0]}{capability[1]}"
    # "page_copy3": the chunk-list kernel with a capped grid; an older build is not reused.
    build = os.path.join(cache_dir(), "extensions",
                         f"page_copy3-torch{torch.__version__}-sm{arch}")
    os.makedirs(build, exist_ok=True)
    return load(name="deepinfer_page_copy3", sources=[_SOURCE], build_directory=build,
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"])


def _extension(device: torch.device):
    return load_extension(torch.cuda.get_device_capability(device))


# ---- layout: plain Python ------------------------------------------------------------------


def _check_groups(groups: Sequence[int], num_groups: int) -> None:
    for c, g in enumerate(groups):
        if not 0 <= g < num_groups:
            raise ValueError(f"chunk {c} names KV group {g}, but there are {num_groups} groups "
                             f"(num_blocks has one entry per group)")
    missing = sorted(set(range(num_groups)) - set(groups))
    if missing:
        raise ValueError(f"KV group {missing[0]} has no chunk (groups {list(groups)})")


def _num_blocks_per_group(num_blocks: int | Sequence[int],
                          groups: Sequence[int]) -> tuple[int, ...]:
    """An int means every group has that many blocks; a sequence has one entry per group."""
    if isinstance(num_blocks, numbers.Integral):
        return (int(num_blocks),) * (max(groups) + 1 if groups else 0)
    return tuple(int(n) for n in num_blocks)


def _check_num_blocks(num_blocks: Sequence[int]) -> None:
    for g, n in enumerate(num_blocks):
        if n < 1:
            raise ValueError(f"KV group {g}: num_blocks must be >= 1, got {n}")


@dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk's block sits in a host page, and how many blocks each group has."""

    block_bytes: tuple[int, ...]  # per chunk: bytes of one block
    groups: tuple[int, ...]  # per chunk: its KV group
    num_blocks: tuple[int, ...]  # per group: device blocks

    def __post_init__(self) -> None:
        if not self.block_bytes:
            raise ValueError("no chunks: a page needs at least one")
        if len(self.groups) != len(self.block_bytes):
            raise ValueError(f"{len(self.groups)} group ids for {len(self.block_bytes)} chunks")
        for c, size in enumerate(self.block_bytes):
            if size <= 0 or size % ALIGN:
                raise ValueError(f"chunk {c}: {size} bytes per block is not a positive multiple "
                                 f"of {ALIGN} (the copy moves {ALIGN}-byte vectors)")
        _check_num_blocks(self.num_blocks)
        _check_groups(self.groups, len(self.num_blocks))

    @classmethod
    def from_spec(cls, spec: "KVSpec", block_size: int, element_size: int,
                  num_blocks: int | Sequence[int]) -> "ChunkLayout":
        """The layout of a model's cache, chunks in `spec.chunks(block_size)` order."""
        chunks = spec.chunks(block_size)
        groups = tuple(c.group for c in chunks)
        return cls(tuple(c.numel * element_size for c in chunks), groups,
                   _num_blocks_per_group(num_blocks, groups))

    @property
    def num_chunks(self) -> int:
        return len(self.block_bytes)

    @property
    def num_groups(self) -> int:
        return len(self.num_blocks)

    @cached_property
    def host_offsets(self) -> tuple[int, ...]:
        """Byte offset of each chunk's block within a host page."""
        offsets, at = [], 0
        for size in self.block_bytes:
            offsets.append(at)
            at += size
        return tuple(offsets)

    @property
    def page_bytes(self) -> int:
        return sum(self.block_bytes)


def chunk_layout_of(tensors: Sequence[torch.Tensor], groups: Sequence[int],
                    num_blocks: int | Sequence[int]) -> ChunkLayout:
    """Check chunk tensors (contiguity, sizes, alignment; not placement) and derive their
    layout: chunk c's block bytes are its bytes over its group's num_blocks."""
    groups = tuple(int(g) for g in groups)
    if len(tensors) != len(groups):
        raise ValueError(f"{len(groups)} group ids for {len(tensors)} chunk tensors")
    per_group = _num_blocks_per_group(num_blocks, groups)
    _check_num_blocks(per_group)
    _check_groups(groups, len(per_group))
    block_bytes = []
    for c, (t, g) in enumerate(zip(tensors, groups)):
        if not t.is_contiguous():
            raise ValueError(f"chunk {c} must be contiguous")
        nbytes = t.numel() * t.element_size()
        if nbytes % per_group[g]:
            raise ValueError(f"chunk {c}: {nbytes} bytes are not {per_group[g]} equal blocks "
                             f"(num_blocks of KV group {g})")
        if t.data_ptr() % ALIGN:
            raise ValueError(f"chunk {c} is not {ALIGN}-byte aligned")
        block_bytes.append(nbytes // per_group[g])
    return ChunkLayout(tuple(block_bytes), groups, per_group)


def chunk_table(tensors: Sequence[torch.Tensor], layout: ChunkLayout) -> torch.Tensor:
    """The kernel's per-chunk table: int64 [len(TABLE_ROWS), num_chunks] on the CPU."""
    rows = ([t.data_ptr() for t in tensors], layout.block_bytes, layout.host_offsets,
            layout.groups, [layout.num_blocks[g] for g in layout.groups])
    return torch.tensor(rows, dtype=torch.int64)


# ---- indices: plain Python -----------------------------------------------------------------


def host_page_indices(ids: Indices, num_pages: int) -> torch.Tensor:
    """host_pages as a range-checked int64 [n] CPU tensor."""
    ids = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
    if ids.dim() != 1:
        raise ValueError(f"host_pages must be one index per pair, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise ValueError(f"host_pages out of range [0, {num_pages})")
    return ids.contiguous()


def block_indices(ids: GroupIndices, layout: ChunkLayout, n: int) -> torch.Tensor:
    """device_blocks as a range-checked int64 [num_groups, n] CPU tensor."""
    if isinstance(ids, torch.Tensor):
        rows = ids.to(device="cpu", dtype=torch.int64)
    else:
        if len(ids) != layout.num_groups:
            raise ValueError(f"device_blocks has {len(ids)} rows for {layout.num_groups} KV "
                             f"groups: it needs one list of block ids per group")
        rows = [torch.as_tensor(r, dtype=torch.int64, device="cpu") for r in ids]
        if any(r.dim() != 1 for r in rows):
            raise ValueError("device_blocks must hold one 1-D list of block ids per KV group")
        if any(r.numel() != n for r in rows):
            raise ValueError(f"device_blocks rows have {[r.numel() for r in rows]} block ids "
                             f"for {n} host pages")
        rows = torch.stack(rows) if rows else torch.empty(0, n, dtype=torch.int64)
    _check_block_shape(rows, layout, n)
    for g, limit in enumerate(layout.num_blocks):
        row = rows[g]
        if row.numel() and (int(row.min()) < 0 or int(row.max()) >= limit):
            raise ValueError(f"device_blocks of KV group {g} out of range [0, {limit})")
    return rows.contiguous()


def _check_block_shape(blocks: torch.Tensor, layout: ChunkLayout, n: int) -> None:
    if tuple(blocks.shape) != (layout.num_groups, n):
        raise ValueError(f"device_blocks must be [num_groups={layout.num_groups}, n={n}], got "
                         f"shape {tuple(blocks.shape)}")


def validate_host_pool(host_pool: torch.Tensor, page_bytes: int) -> int:
    """Check the pool holds [num_pages, page_bytes] bytes, then its placement; return
    num_pages."""
    nbytes = host_pool.numel() * host_pool.element_size()
    if host_pool.dim() < 1 or nbytes != host_pool.shape[0] * page_bytes:
        raise ValueError(f"host_pool must hold [num_pages, {page_bytes}] bytes (one page per "
                         f"index of dim 0), got {tuple(host_pool.shape)} {host_pool.dtype}")
    if not host_pool.is_contiguous():
        raise ValueError("host_pool must be contiguous")
    if host_pool.data_ptr() % ALIGN:
        raise ValueError(f"host_pool is not {ALIGN}-byte aligned")
    if host_pool.device.type != "cpu" or not host_pool.is_pinned():
        raise ValueError("host_pool must be pinned CPU memory (pin_memory=True)")
    return host_pool.shape[0]


# ---- null blocks: which chunks of which pairs a copy moves -----------------------------------


@dataclass(frozen=True, eq=False)
class CopyPart:
    """One launch of a copy: the chunks it moves, of the pairs it moves them for."""

    chunks: tuple[int, ...]  # chunk ids, ascending (page order)
    pairs: torch.Tensor  # int64 [m], CPU: positions in the copy's pair list, ascending


def layer_launches(parts: Sequence[CopyPart], chunk_layers: Sequence[int]
                   ) -> list[tuple[int, list[tuple[int, tuple[int, ...]]]]]:
    """A copy's launches layer by layer: per layer (ascending, every layer that has a chunk),
    the (part index, that part's chunks of the layer) with any; a layer no part moves has an
    empty list (its pages were all out of that layer's window: nothing to wait for)."""
    out = []
    for layer in sorted(set(chunk_layers)):
        subsets = [(i, ids) for i, part in enumerate(parts)
                   if (ids := tuple(c for c in part.chunks if chunk_layers[c] == layer))]
        out.append((layer, subsets))
    return out


def copy_parts(blocks: torch.Tensor, layout: ChunkLayout, skip_null: bool) -> list[CopyPart]:
    """Split a copy into launches; `blocks` is its device_blocks as a checked int64
    [num_groups, n] CPU tensor (block_indices). Without skip_null, or without a null block:
    one part, every chunk of every pair (none if n == 0). With it, pair i moves the chunks of
    the groups g whose blocks[g][i] is not the null block; pairs that move the same groups
    form one part (parts in order of their first pair), and a pair with no block moves
    nothing. A chunk keeps its host offset: the page layout does not change."""
    n = blocks.shape[1]
    held = blocks != NULL_BLOCK_ID
    if not skip_null or bool(held.all()):
        return [CopyPart(tuple(range(layout.num_chunks)), torch.arange(n))] if n else []
    by_groups: dict[tuple[bool, ...], list[int]] = {}
    for i, groups in enumerate(held.t().tolist()):
        by_groups.setdefault(tuple(groups), []).append(i)
    parts = []
    for groups, pairs in by_groups.items():
        chunks = tuple(c for c, g in enumerate(layout.groups) if groups[g])
        if chunks:
            parts.append(CopyPart(chunks, torch.tensor(pairs, dtype=torch.int64)))
    return parts


# ---- device chunks and the copier ------------------------------------------------------------


def _placement(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"chunks must all be on one CUDA device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda":
        raise ValueError(f"chunks must be on a CUDA device, not {device}")
    return device


@dataclass(frozen=True, eq=False)
class DeviceChunks:
    """A validated chunk list and its per-chunk table, on the device (for the kernel) and on the
    host (for copy_memcpy). Keeps the tensors alive: the table holds their addresses."""

    tensors: tuple[torch.Tensor, ...]
    layout: ChunkLayout
    host_table: torch.Tensor  # int64 [len(TABLE_ROWS), num_chunks], CPU
    table: torch.Tensor  # the same on the chunks' device
    # Device tables of chunk subsets (copies that skip null blocks), uploaded on first use.
    _tables: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def prepare(cls, tensors: Sequence[torch.Tensor], groups: Sequence[int],
                num_blocks: int | Sequence[int]) -> "DeviceChunks":
        """tensors[c] is chunk c, in page order, of KV group groups[c]; num_blocks is each
        group's block count (an int: the same for all)."""
        layout = chunk_layout_of(tensors, groups, num_blocks)
        device = _placement(tensors)
        host_table = chunk_table(tensors, layout)
        return cls(tuple(tensors), layout, host_table, host_table.to(device))

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def _all(self, chunk_ids: tuple[int, ...]) -> bool:
        return chunk_ids == tuple(range(self.layout.num_chunks))

    def host_table_of(self, chunk_ids: tuple[int, ...]) -> torch.Tensor:
        """The table's columns of chunk_ids (CPU): each keeps its base, block bytes, host
        offset and group, so a launch over them moves those chunks where the full one would."""
        if self._all(chunk_ids):
            return self.host_table
        return self.host_table[:, list(chunk_ids)].contiguous()

    def table_of(self, chunk_ids: tuple[int, ...]) -> torch.Tensor:
        """The same on the device: uploaded once per subset and kept (one subset per set of
        groups that hold a block in some copy's pair, so a few)."""
        if self._all(chunk_ids):
            return self.table
        table = self._tables.get(chunk_ids)
        if table is None:
            # Synchronous like `table` itself: later copies may run on another stream.
            table = self.host_table_of(chunk_ids).to(self.device)
            self._tables[chunk_ids] = table
        return table


def pinned_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """Exactly nbytes of pinned, device-mapped host memory as a uint8 [nbytes] CPU tensor, freed
    with the tensor's storage. torch's pinned allocator rounds each request up to a power of
    two (a 40 GiB pool would pin 64 GiB); a HiCache pool is sized to a memory budget."""
    if nbytes < 1:
        raise ValueError(f"a pinned buffer needs at least one byte, got {nbytes}")
    return _extension(device).pinned_empty(nbytes, device.index)


def _upload(ids: torch.Tensor, device: torch.device,
            staging: "PinnedStaging | None" = None) -> torch.Tensor:
    # Pinned staging keeps the upload asynchronous: the pool's PinnedStaging buffers, or
    # pin_memory() (torch's caching host allocator keeps that block until the copy has run).
    # Nothing to copy: nothing to upload.
    if ids.numel() == 0:
        return ids
    if staging is not None:
        return staging.upload(ids, device)
    return ids.pin_memory().to(device, non_blocking=True)


class PinnedStaging:
    """Pinned int64 buffers for the index uploads of copies, allocated once and each reused
    when the upload that last used it has run (its event). pin_memory() allocates with
    cudaHostAlloc whenever torch's host cache has no free block of the size, and that call
    takes the driver's global lock: a load or store that needed one would wait there behind
    the copies in flight (a 32K-token store moves 4 GB, ~80 ms). When every buffer is busy
    (or too small) the upload falls back to pin_memory()."""

    def __init__(self, capacity: int, count: int = 8) -> None:
        self.buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=True)
                        for _ in range(count)]
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.turn = 0
        self.fallbacks = 0  # uploads that found no free buffer

    def upload(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        for _ in range(len(self.buffers)):
            i, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
            event = self.events[i]
            if self.buffers[i].numel() >= ids.numel() and (event is None or event.query()):
                host = self.buffers[i][:ids.numel()]
                host.copy_(ids)
                out = host.to(device, non_blocking=True)
                self.events[i] = torch.cuda.Event()
                self.events[i].record()
                return out
        self.fallbacks += 1
        return ids.pin_memory().to(device, non_blocking=True)


def _rows_on_device(ids: GroupIndices, device: torch.device) -> bool:
    """A tensor on the device, or a non-empty sequence of such tensors (one per group)."""
    if isinstance(ids, torch.Tensor):
        return ids.device == device
    return len(ids) > 0 and all(isinstance(r, torch.Tensor) and r.device == device for r in ids)


def _device_pages(ids: Indices, device: torch.device, num_pages: int) -> torch.Tensor:
    if isinstance(ids, torch.Tensor) and ids.device == device:
        # Trusted, since a range check would stall on the host.
        if ids.dim() != 1:
            raise ValueError(f"host_pages must be one index per pair, got {tuple(ids.shape)}")
        return ids.to(torch.int64).contiguous()
    return _upload(host_page_indices(ids, num_pages), device)


def _upload_parts(chunks: DeviceChunks, pages: torch.Tensor, blocks: torch.Tensor,
                  parts: Sequence[CopyPart], staging: PinnedStaging | None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every part's pages [m], then its blocks [num_groups, m], up in one upload; per part its
    slices on the device (a part's blocks keep every group's row: the kernel reads only the
    rows of the groups its table names)."""
    if not parts:
        return []
    indices = [(pages[part.pairs], blocks[:, part.pairs]) for part in parts]
    flat = _upload(torch.cat([t.reshape(-1) for pair in indices for t in pair]),
                   chunks.device, staging)
    out, at = [], 0
    for part_pages, part_blocks in indices:
        m, size = part_pages.numel(), part_blocks.numel()
        out.append((flat[at:at + m], flat[at + m:at + m + size].view(part_blocks.shape)))
        at += m + size
    return out


def _device_blocks(ids: GroupIndices, device: torch.device, layout: ChunkLayout,
                   n: int) -> torch.Tensor:
    if _rows_on_device(ids, device):
        # Trusted like host_pages; only the shape (host metadata) is checked.
        if isinstance(ids, torch.Tensor):
            rows = ids
        elif any(r.dim() != 1 or r.numel() != n for r in ids):
            raise ValueError(f"device_blocks rows must be 1-D with {n} block ids each, got "
                             f"{[tuple(r.shape) for r in ids]}")
        else:
            rows = torch.stack(list(ids))
        _check_block_shape(rows, layout, n)
        return rows.to(torch.int64).contiguous()
    return _upload(block_indices(ids, layout, n), device)


@dataclass(frozen=True)
class UVAPageCopier:
    """Launch configuration of the copy kernel: threads per CTA, CTAs per (pair, chunk), and
    16-byte loads each thread keeps in flight (1, 2, 4 or 8).

    On an H200 (bench_page_copy, 256 pages a copy) every configuration tried ran at the PCIe
    limit, 51 GB/s host->device and 52.5 GB/s device->host against 55 for one contiguous pinned
    copy, at both the Llama-3-8B layout (64 chunks of 256 KiB a page) and an MLA layout (61
    latent chunks of 72 KiB), where a cudaMemcpyAsync per chunk reached 36/38 and 19/22 GB/s.
    The default was the fastest by a hair.

    max_ctas caps the grid (0: one CTA per work item); the CTAs then stride over the work. A
    copy beside the model's kernels (the write-through's own stream) is capped so that it
    leaves the SMs to them.
    """

    threads: int = 256
    ctas_per_chunk: int = 1
    unroll: int = 4
    max_ctas: int = 0

    def __post_init__(self) -> None:
        if not (32 <= self.threads <= 1024 and self.threads % 32 == 0):
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if self.ctas_per_chunk < 1:
            raise ValueError(f"ctas_per_chunk must be >= 1, got {self.ctas_per_chunk}")
        if self.unroll not in (1, 2, 4, 8):
            raise ValueError(f"unroll must be 1, 2, 4 or 8, got {self.unroll}")
        if self.max_ctas < 0:
            raise ValueError(f"max_ctas must be >= 0, got {self.max_ctas}")

    def copy(self, host_pool: torch.Tensor, chunks: DeviceChunks, host_pages: Indices,
             device_blocks: GroupIndices, to_device: bool, skip_null: bool = False,
             staging: PinnedStaging | None = None) -> None:
        """Enqueue the copy on the current stream: one kernel for every pair and chunk. With
        skip_null, group g of pair i is left alone where device_blocks[g][i] is the null block:
        one kernel per part of copy_parts, the indices checked on the host (device tensors
        read back, a sync) and uploaded in one go."""
        if skip_null:  # every chunk as one "layer": a launch per part
            self.copy_layers(host_pool, chunks, host_pages, device_blocks, to_device,
                             [0] * chunks.layout.num_chunks, lambda layer: None, staging)
            return
        num_pages = validate_host_pool(host_pool, chunks.page_bytes)
        pages = _device_pages(host_pages, chunks.device, num_pages)
        blocks = _device_blocks(device_blocks, chunks.device, chunks.layout, pages.numel())
        if pages.numel():
            _extension(chunks.device).copy_uva(host_pool, chunks.table, chunks.page_bytes, pages,
                                               blocks, to_device, self.threads,
                                               self.ctas_per_chunk, self.unroll, self.max_ctas)

    def copy_layers(self, host_pool: torch.Tensor, chunks: DeviceChunks, host_pages: Indices,
                    device_blocks: GroupIndices, to_device: bool, chunk_layers: Sequence[int],
                    layer_done: Callable[[int], None],
                    staging: PinnedStaging | None = None) -> None:
        """copy with skip_null, layer by layer (chunk_layers[c]: chunk c's layer): each
        layer's chunks of every part are launched, in layer order, and then layer_done(layer)
        is called (to record an event a step's layer waits for before it reads its KV). The
        indices go up once, as for copy."""
        num_pages = validate_host_pool(host_pool, chunks.page_bytes)
        pages = host_page_indices(host_pages, num_pages)
        blocks = block_indices(device_blocks, chunks.layout, pages.numel())
        parts = copy_parts(blocks, chunks.layout, skip_null=True)
        uploaded = _upload_parts(chunks, pages, blocks, parts, staging)
        extension = _extension(chunks.device)
        for layer, subsets in layer_launches(parts, chunk_layers):
            for index, chunk_ids in subsets:
                dev_pages, dev_blocks = uploaded[index]
                extension.copy_uva(host_pool, chunks.table_of(chunk_ids), chunks.page_bytes,
                                   dev_pages, dev_blocks, to_device, self.threads,
                                   self.ctas_per_chunk, self.unroll, self.max_ctas)
            layer_done(layer)

    def copy_memcpy(self, host_pool: torch.Tensor, chunks: DeviceChunks, host_pages: Indices,
                    device_blocks: GroupIndices, to_device: bool, skip_null: bool = False) -> None:
        """The baseline: one cudaMemcpyAsync per (pair, chunk) on the current stream (indices
        on the device are first read back to the host); skip_null as in copy."""
        num_pages = validate_host_pool(host_pool, chunks.page_bytes)
        pages = host_page_indices(host_pages, num_pages)
        blocks = block_indices(device_blocks, chunks.layout, pages.numel())
        for part in copy_parts(blocks, chunks.layout, skip_null):
            _extension(chunks.device).copy_memcpy(
                host_pool, chunks.host_table_of(part.chunks), chunks.page_bytes,
                pages[part.pairs], blocks[:, part.pairs], to_device, chunks.device.index)


def copy_reference(host_pool: torch.Tensor, tensors: Sequence[torch.Tensor], layout: ChunkLayout,
                   host_pages: Indices, device_blocks: GroupIndices, to_device: bool,
                   skip_null: bool = False) -> None:
    """The same copy in plain torch, a gather/scatter per chunk; any device, synchronous
    semantics, unpinned host memory allowed; skip_null as in UVAPageCopier.copy. Slow: for
    tests and benchmarks."""
    pages = host_page_indices(host_pages, host_pool.shape[0])
    blocks = block_indices(device_blocks, layout, pages.numel())
    host = host_pool.view(-1).view(torch.uint8).view(-1, layout.page_bytes)
    for part in copy_parts(blocks, layout, skip_null):
        part_pages = pages[part.pairs]
        for c in part.chunks:
            t = tensors[c]
            g, size, off = layout.groups[c], layout.block_bytes[c], layout.host_offsets[c]
            dev = t.view(-1).view(torch.uint8).view(layout.num_blocks[g], size)
            rows = blocks[g][part.pairs].to(t.device)
            if to_device:
                dev[rows] = host[part_pages, off:off + size].to(t.device)
            else:
                host[part_pages, off:off + size] = dev[rows].cpu()
