"""HiCache page copies over a list of KV chunks (page_copy.py, page_copy.cu, host_pool.py).

Without a GPU: the page layout (block bytes, host offsets, page bytes, from a KVSpec too), every
argument check and its message, the per-chunk table, the index range checks, and the torch
reference copy against a page built by hand. With a GPU: the UVA kernel, the memcpy baseline
and the torch reference agree byte for byte, both directions, on llama-like, MLA-like and
two-group chunk lists, pages out of order, indices as lists, CPU tensors and device tensors.

Null blocks (skip_null, what HiCache's pool asks for): without a GPU, the host-side split of a
copy's pairs into launches (copy_parts), the chunk-subset tables, the reference copy against the
CPU backend's host pool, and UVAPageCopier's launches against an emulation of the kernel on CPU
memory; with a GPU, the kernel, the memcpy baseline and the pool leave the host bytes of a null
group untouched and never write device block 0, and a sliding-window model's host tier
decodes the same tokens through the engine.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from deepinfer.backends.cuda import page_copy
from deepinfer.backends.cuda.page_copy import (
    TABLE_ROWS,
    ChunkLayout,
    DeviceChunks,
    UVAPageCopier,
    block_indices,
    chunk_layout_of,
    chunk_table,
    copy_parts,
    copy_reference,
    host_page_indices,
    layer_launches,
    validate_host_pool,
)
from deepinfer.core.kv.spec import KVSpec, kv_heads_layer, latent_layer

BLOCK, HEADS, DIM, LATENT = 4, 2, 8, 576
KV_BYTES = BLOCK * HEADS * DIM * 2  # one block of a bf16 K (or V) chunk: 256
LATENT_BYTES = BLOCK * LATENT * 2  # one block of a bf16 MLA latent chunk: 4608

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _two_group_spec() -> KVSpec:
    """Layers 0 and 2 attend fully, layer 1 over a window: two KV groups."""
    full, window = kv_heads_layer(HEADS, DIM), kv_heads_layer(1, 16, sliding_window=8)
    return KVSpec((full, window, full))


def _chunk_tensors(spec: KVSpec, num_blocks: tuple[int, ...], device: str,
                   seed: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """One random bf16 tensor [num_blocks * BLOCK, *entry shape] per chunk, as a cache holds."""
    g = torch.Generator().manual_seed(seed)
    tensors, groups = [], []
    for chunk in spec.chunks(BLOCK):
        rows = num_blocks[chunk.group] * chunk.entry.entries_per_block(BLOCK)
        t = torch.randn(rows, *chunk.entry.shape, generator=g).to(torch.bfloat16)
        tensors.append(t.to(device))
        groups.append(chunk.group)
    return tensors, groups


# ---- layout ------------------------------------------------------------------------------------


def test_page_is_the_chunks_back_to_back():
    layout = ChunkLayout((256, 256, 4608, 32), (0, 0, 1, 0), (6, 4))
    assert layout.host_offsets == (0, 256, 512, 5120)
    assert layout.page_bytes == 5152
    assert (layout.num_chunks, layout.num_groups) == (4, 2)


@pytest.mark.parametrize("spec, groups, block_bytes", [
    (KVSpec.uniform(2, kv_heads_layer(HEADS, DIM)), (0, 0, 0, 0), (KV_BYTES,) * 4),
    (KVSpec.uniform(2, latent_layer(LATENT)), (0, 0), (LATENT_BYTES,) * 2),
    # spec.chunks order: group by group, so layer 2's K and V come before layer 1's.
    (_two_group_spec(), (0, 0, 0, 0, 1, 1), (KV_BYTES,) * 4 + (BLOCK * 16 * 2,) * 2),
])
def test_layout_from_spec(spec, groups, block_bytes):
    layout = ChunkLayout.from_spec(spec, BLOCK, 2, 5)
    assert layout.groups == groups and layout.block_bytes == block_bytes
    assert layout.num_blocks == (5,) * spec.num_groups
    assert layout.page_bytes == spec.block_bytes(BLOCK, 2)


def test_mla_latent_block_is_1152_bytes_per_token():
    layout = ChunkLayout.from_spec(KVSpec.uniform(61, latent_layer(LATENT)), 64, 2, 10)
    assert set(layout.block_bytes) == {1152 * 64}
    assert layout.page_bytes == 61 * 1152 * 64


@pytest.mark.parametrize("block_bytes, groups, num_blocks, match", [
    ((), (), (4,), "no chunks"),
    ((256, 256), (0,), (4,), "1 group ids for 2 chunks"),
    ((256, 24), (0, 0), (4,), "chunk 1: 24 bytes per block is not a positive multiple of 16"),
    ((8,), (0,), (4,), "not a positive multiple of 16"),
    ((0,), (0,), (4,), "not a positive multiple of 16"),
    ((256, 256), (0, 2), (4, 4), "chunk 1 names KV group 2, but there are 2 groups"),
    ((256, 256), (0, -1), (4, 4), "names KV group -1"),
    ((256, 256), (0, 0), (4, 4), "KV group 1 has no chunk"),
    ((256,), (0,), (0,), "num_blocks must be >= 1"),
])
def test_layout_errors(block_bytes, groups, num_blocks, match):
    with pytest.raises(ValueError, match=match):
        ChunkLayout(block_bytes, groups, num_blocks)


def test_layout_of_tensors_divides_bytes_by_group_blocks():
    tensors, groups = _chunk_tensors(_two_group_spec(), (6, 3), "cpu")
    layout = chunk_layout_of(tensors, groups, (6, 3))
    assert layout == ChunkLayout.from_spec(_two_group_spec(), BLOCK, 2, (6, 3))
    # Dtype and shape don't matter, bytes do: a flat uint8 view is the same chunk.
    flat = [t.view(-1).view(torch.uint8) for t in tensors]
    assert chunk_layout_of(flat, groups, (6, 3)) == layout


def _misaligned() -> torch.Tensor:
    return torch.zeros(4 * 256 + 2, dtype=torch.uint8)[2:]


@pytest.mark.parametrize("tensors, groups, num_blocks, match", [
    ([torch.zeros(16, 16)], [0, 0], 4, "2 group ids for 1 chunk tensors"),
    ([torch.zeros(16, 16).t()], [0], 4, "chunk 0 must be contiguous"),
    ([torch.zeros(16, 16), torch.zeros(642, dtype=torch.uint8)], [0, 0], 4,
     "chunk 1: 642 bytes are not 4 equal blocks"),
    ([torch.zeros(4 * 12, dtype=torch.uint8)], [0], 4, "12 bytes per block"),  # 12-byte blocks
    ([torch.zeros(4, 100, dtype=torch.float16)], [0], 4, "200 bytes per block"),  # odd latent
    ([_misaligned()], [0], 4, "chunk 0 is not 16-byte aligned"),
    ([torch.zeros(16, 16)], [1], 4, "KV group 0 has no chunk"),
    ([torch.zeros(16, 16)], [1], [4], "chunk 0 names KV group 1, but there are 1 groups"),
    ([torch.zeros(16, 16)], [0], [4, 4], "KV group 1 has no chunk"),
    ([torch.zeros(16, 16)], [0], 0, "num_blocks must be >= 1"),
])
def test_chunk_tensor_errors(tensors, groups, num_blocks, match):
    with pytest.raises(ValueError, match=match):
        chunk_layout_of(tensors, groups, num_blocks)
    with pytest.raises(ValueError, match=match):
        DeviceChunks.prepare(tensors, groups, num_blocks)


def test_prepare_checks_placement_last():
    tensors, groups = _chunk_tensors(KVSpec.uniform(2, kv_heads_layer(HEADS, DIM)), (3,), "cpu")
    with pytest.raises(ValueError, match="chunks must be on a CUDA device, not cpu"):
        DeviceChunks.prepare(tensors, groups, 3)
    mixed = tensors[:1] + [torch.empty_like(tensors[1], device="meta")] + tensors[2:]
    with pytest.raises(ValueError, match="on one CUDA device"):
        DeviceChunks.prepare(mixed, groups, 3)


def test_chunk_table_rows():
    tensors, groups = _chunk_tensors(_two_group_spec(), (6, 3), "cpu")
    layout = chunk_layout_of(tensors, groups, (6, 3))
    table = chunk_table(tensors, layout)
    assert table.dtype == torch.int64 and tuple(table.shape) == (len(TABLE_ROWS), 6)
    rows = dict(zip(TABLE_ROWS, table.tolist()))
    assert rows["base"] == [t.data_ptr() for t in tensors]
    assert rows["block_bytes"] == list(layout.block_bytes)
    assert rows["host_offset"] == list(layout.host_offsets)
    assert rows["group"] == groups == [0, 0, 0, 0, 1, 1]
    assert rows["num_blocks"] == [6, 6, 6, 6, 3, 3]


# ---- indices and the host pool -------------------------------------------------------------------


def test_host_page_indices():
    assert host_page_indices([3, 0, 4], 5).tolist() == [3, 0, 4]
    assert host_page_indices(torch.tensor([1], dtype=torch.int32), 5).dtype == torch.int64
    for bad in ([5], [-1], [0, 7]):
        with pytest.raises(ValueError, match=r"host_pages out of range \[0, 5\)"):
            host_page_indices(bad, 5)
    with pytest.raises(ValueError, match="one index per pair"):
        host_page_indices([[0, 1]], 5)


def test_block_indices_per_group():
    layout = ChunkLayout((256, 64), (0, 1), (6, 3))
    want = [[5, 2, 1], [0, 2, 1]]
    for ids in (want, torch.tensor(want), [torch.tensor(want[0]), want[1]]):
        blocks = block_indices(ids, layout, 3)
        assert blocks.dtype == torch.int64 and blocks.tolist() == want
    assert tuple(block_indices([[], []], layout, 0).shape) == (2, 0)


@pytest.mark.parametrize("ids, match", [
    ([[5, 2, 1]], r"1 rows for 2 KV groups"),
    ([5, 2, 1], r"3 rows for 2 KV groups"),
    ([[5, 2, 1], [0, 2, 1], [0, 0, 0]], "3 rows for 2 KV groups"),
    (torch.tensor([5, 2, 1]), r"must be \[num_groups=2, n=3\], got shape \(3,\)"),
    (torch.zeros(3, 2, dtype=torch.int64), r"must be \[num_groups=2, n=3\]"),
    ([[5, 2], [0, 2, 1]], r"rows have \[2, 3\] block ids for 3 host pages"),
    ([5, 2], "one 1-D list of block ids per KV group"),
    ([[6, 2, 1], [0, 2, 1]], r"KV group 0 out of range \[0, 6\)"),
    ([[5, 2, 1], [0, 3, 1]], r"KV group 1 out of range \[0, 3\)"),
    ([[5, 2, 1], [0, -1, 1]], r"KV group 1 out of range"),
])
def test_block_index_errors(ids, match):
    layout = ChunkLayout((256, 64), (0, 1), (6, 3))
    with pytest.raises(ValueError, match=match):
        block_indices(ids, layout, 3)


@pytest.mark.parametrize("pool, match", [
    (torch.zeros(5, 511, dtype=torch.uint8), r"must hold \[num_pages, 512\] bytes"),
    (torch.zeros(5, 512, dtype=torch.uint8)[:, :256], r"must hold \[num_pages, 512\] bytes"),
    (torch.zeros(()), r"must hold \[num_pages, 512\] bytes"),
    (torch.zeros(256, 5, dtype=torch.bfloat16).t(), "must be contiguous"),
    (torch.zeros(5 * 512 + 1, dtype=torch.uint8)[1:].view(5, 512), "not 16-byte aligned"),
    (torch.zeros(5, 512, dtype=torch.uint8), "must be pinned CPU memory"),
])
def test_host_pool_errors(pool, match):
    with pytest.raises(ValueError, match=match):
        validate_host_pool(pool, 512)


def test_host_pool_of_any_dtype_is_bytes_up_to_placement():
    for pool in (torch.zeros(5, 512, dtype=torch.uint8), torch.zeros(5, 2, 64, dtype=torch.float32),
                 torch.zeros(5, 4, 32, 2, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="pinned"):  # every shape check passed
            validate_host_pool(pool, 512)


@pytest.mark.parametrize("kwargs, match", [
    ({"threads": 48}, "threads must be a multiple of 32"),
    ({"threads": 2048}, "threads must be a multiple of 32"),
    ({"ctas_per_chunk": 0}, "ctas_per_chunk must be >= 1"),
    ({"unroll": 3}, "unroll must be 1, 2, 4 or 8"),
    ({"max_ctas": -1}, "max_ctas must be >= 0"),
])
def test_launch_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UVAPageCopier(**kwargs)


# ---- the torch reference, against pages built by hand -----------------------------------------


def _page_by_hand(tensors, layout, blocks: list[int]) -> torch.Tensor:
    """One page: block blocks[g] of every chunk of group g, concatenated in chunk order."""
    parts = []
    for c, t in enumerate(tensors):
        size = layout.block_bytes[c]
        raw = t.reshape(-1).view(torch.uint8)
        b = blocks[layout.groups[c]]
        parts.append(raw[b * size:(b + 1) * size])
    return torch.cat(parts)


def test_reference_copy_on_cpu():
    num_blocks = (6, 3)
    tensors, groups = _chunk_tensors(_two_group_spec(), num_blocks, "cpu")
    layout = chunk_layout_of(tensors, groups, num_blocks)
    host = torch.zeros(5, layout.page_bytes, dtype=torch.uint8)
    pages, blocks = [3, 0, 4], [[5, 2, 1], [0, 2, 1]]
    copy_reference(host, tensors, layout, pages, blocks, to_device=False)
    for i, p in enumerate(pages):
        assert torch.equal(host[p], _page_by_hand(tensors, layout, [blocks[0][i], blocks[1][i]]))
    assert not host[[1, 2]].any()  # pages not named stay untouched
    # Back into other blocks: each lands where its page was read from, nothing else changes.
    before = [t.clone() for t in tensors]
    to = [[4, 3, 0], [2, 0, 1]]
    copy_reference(host, tensors, layout, pages, to, to_device=True)
    for i, p in enumerate(pages):
        assert torch.equal(_page_by_hand(tensors, layout, [to[0][i], to[1][i]]), host[p])
    for c, (t, old) in enumerate(zip(tensors, before)):
        untouched = sorted(set(range(num_blocks[groups[c]])) - set(to[groups[c]]))
        paged = t.view(num_blocks[groups[c]], -1)
        assert torch.equal(paged[untouched], old.view(num_blocks[groups[c]], -1)[untouched])


# ---- null blocks: the host-side split (skip_null) ---------------------------------------------

# _two_group_spec's chunks: 0-3 are group 0 (K, V of layers 0 and 2), 4-5 group 1 (layer 1).
G0, G1, ALL = (0, 1, 2, 3), (4, 5), (0, 1, 2, 3, 4, 5)


def _two_group_layout(num_blocks=(6, 3)) -> ChunkLayout:
    return ChunkLayout.from_spec(_two_group_spec(), BLOCK, 2, num_blocks)


def _parts(blocks, skip_null: bool = True) -> list[tuple[tuple[int, ...], list[int]]]:
    parts = copy_parts(torch.tensor(blocks, dtype=torch.int64).view(2, -1), _two_group_layout(),
                       skip_null)
    for part in parts:
        assert part.pairs.dtype == torch.int64
    return [(part.chunks, part.pairs.tolist()) for part in parts]


def test_copy_parts_drop_null_pairs_and_keep_order():
    # pair:       0  1  2  3  4  5
    blocks = [[5, 2, 0, 1, 0, 4],   # group 0
              [0, 2, 1, 0, 0, 2]]   # group 1
    # Pairs moving the same groups form one part, parts in order of their first pair, pairs
    # ascending; pair 4 (no block in either group) moves nothing.
    assert _parts(blocks) == [(G0, [0, 3]), (ALL, [1, 5]), (G1, [2])]


def test_copy_parts_without_null_blocks_is_one_launch():
    assert _parts([[5, 2, 1], [1, 2, 1]]) == [(ALL, [0, 1, 2])]
    # skip_null off: the null block is a block like any other (the benchmarks' copies)
    assert _parts([[5, 0, 1], [0, 2, 0]], skip_null=False) == [(ALL, [0, 1, 2])]
    assert _parts([[], []]) == [] and _parts([[], []], skip_null=False) == []
    assert _parts([[0, 0], [0, 0]]) == []  # nothing held: nothing to launch


def test_copy_parts_move_every_held_pair_chunk_once():
    layout = _two_group_layout()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 12, (1,), generator=g))
        blocks = torch.stack([torch.randint(0, limit, (n,), generator=g)
                              for limit in layout.num_blocks])
        moved = [(int(i), c) for part in copy_parts(blocks, layout, True)
                 for i in part.pairs for c in part.chunks]
        want = [(i, c) for i in range(n) for c in range(layout.num_chunks)
                if blocks[layout.groups[c], i] != 0]
        assert sorted(moved) == want  # each held (pair, chunk) exactly once, no null one
        for part in copy_parts(blocks, layout, True):
            assert part.pairs.tolist() == sorted(part.pairs.tolist())


def _cpu_chunks(seed: int = 0, num_blocks=(6, 3)) -> DeviceChunks:
    """DeviceChunks on CPU tensors, built around prepare's placement check: the tables and the
    copier's host-side work, without a GPU."""
    tensors, groups = _chunk_tensors(_two_group_spec(), num_blocks, "cpu", seed)
    layout = chunk_layout_of(tensors, groups, num_blocks)
    table = chunk_table(tensors, layout)
    return DeviceChunks(tuple(tensors), layout, table, table.clone())


def test_chunk_subset_tables_keep_each_chunks_offset_and_group():
    chunks = _cpu_chunks()
    layout, full = chunks.layout, chunks.host_table
    assert chunks.host_table_of(ALL) is full and chunks.table_of(ALL) is chunks.table
    for ids in (G0, G1, (1, 4)):
        sub = chunks.host_table_of(ids)
        assert sub.is_contiguous() and torch.equal(sub, full[:, list(ids)])
        rows = dict(zip(TABLE_ROWS, sub.tolist()))
        assert rows["host_offset"] == [layout.host_offsets[c] for c in ids]  # the page layout
        assert rows["group"] == [layout.groups[c] for c in ids]  # rows of device_blocks
        assert rows["base"] == [chunks.tensors[c].data_ptr() for c in ids]
        table = chunks.table_of(ids)
        assert torch.equal(table, sub) and chunks.table_of(ids) is table  # uploaded once


def _cpu_cache(num_blocks: int, seed: int):
    from deepinfer.backends.torch.paged_cache import PagedCache

    cache = PagedCache()
    cache.spec = _two_group_spec()
    cache.allocate(num_blocks, BLOCK, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(seed)
    for _, t in cache.chunk_tensors():
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _blocks_of(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return t.view(-1).view(torch.uint8).view(num_blocks, -1)


def test_reference_copy_skips_null_like_the_cpu_host_pool():
    """copy_reference(skip_null=True) moves the bytes the CPU backend's host pool moves (the
    reference implementation of host_copy_skips_null): same pages, byte for byte."""
    from deepinfer.backends.torch.host_pool import CPUHostPool

    cache = _cpu_cache(6, seed=11)
    tensors = [t for _, t in cache.chunk_tensors()]
    layout = chunk_layout_of(tensors, [c.group for c, _ in cache.chunk_tensors()], 6)
    cpu_pool = CPUHostPool.allocate(5, cache)
    cpu_host = cpu_pool.pages.view(torch.uint8)  # the same page-first layout, as bytes
    assert tuple(cpu_host.shape) == (5, layout.page_bytes)
    cpu_host.copy_(torch.randint(0, 256, cpu_host.shape, generator=torch.Generator()
                                 .manual_seed(12), dtype=torch.uint8))
    host = cpu_host.clone()
    ours = [t.clone() for t in tensors]
    pages, stored = [3, 0, 4, 1], [[5, 2, 1, 0], [0, 2, 0, 0]]
    cpu_pool.copy(cache, pages, stored, to_device=False)
    copy_reference(host, ours, layout, pages, stored, to_device=False, skip_null=True)
    assert torch.equal(host, cpu_host)
    g1 = slice(layout.host_offsets[4], layout.page_bytes)  # group 1's bytes of a page
    before = cpu_host.clone()
    assert torch.equal(host[[3, 4], g1], before[[3, 4], g1])
    loaded = [[4, 3, 0, 0], [0, 1, 2, 0]]
    cpu_pool.copy(cache, pages, loaded, to_device=True)
    copy_reference(host, ours, layout, pages, loaded, to_device=True, skip_null=True)
    for t, mine in zip(tensors, ours):
        assert torch.equal(t.view(torch.int16), mine.view(torch.int16))
    for c, t in enumerate(ours):  # the null block was never written
        assert torch.equal(_blocks_of(t, 6)[0], _blocks_of(tensors[c], 6)[0])


class _EmulatedKernel:
    """page_copy.cu's copy_uva and copy_memcpy on CPU memory: the argument checks, then for
    every pair and every chunk of the table a memmove between block device_blocks[group][pair]
    at the chunk's base and host page host_pages[pair] at the chunk's host offset (on CPU
    tensors a base address is a host address). Records what each launch moved."""

    def __init__(self) -> None:
        self.launches: list[list[tuple[int, int, int, int]]] = []  # (pair, chunk, block, page)

    def copy_uva(self, host_pool, table, page_bytes, pages, blocks, to_device, threads,
                 ctas_per_chunk, unroll, max_ctas=0) -> None:
        self._copy(host_pool, table, page_bytes, pages, blocks, to_device)

    def copy_memcpy(self, host_pool, table, page_bytes, pages, blocks, to_device,
                    device_index) -> None:
        self._copy(host_pool, table, page_bytes, pages, blocks, to_device)

    def _copy(self, host_pool, table, page_bytes, pages, blocks, to_device) -> None:
        assert table.dtype == torch.int64 and table.dim() == 2 and table.is_contiguous()
        assert table.shape[0] == len(TABLE_ROWS) and table.shape[1] >= 1
        assert pages.dtype == blocks.dtype == torch.int64 and pages.dim() == 1
        assert blocks.dim() == 2 and blocks.shape[1] == pages.shape[0] and blocks.shape[0] >= 1
        assert pages.is_contiguous() and blocks.is_contiguous()
        rows = dict(zip(TABLE_ROWS, table.tolist()))
        moved = []
        for pair, page in enumerate(pages.tolist()):
            for c, base in enumerate(rows["base"]):
                block = int(blocks[rows["group"][c], pair])
                size = rows["block_bytes"][c]
                dev = base + block * size
                hst = host_pool.data_ptr() + page * page_bytes + rows["host_offset"][c]
                ctypes.memmove(hst if not to_device else dev, dev if not to_device else hst, size)
                moved.append((pair, base, block, page))
        self.launches.append(moved)


@pytest.fixture
def emulated(monkeypatch) -> _EmulatedKernel:
    kernel = _EmulatedKernel()
    monkeypatch.setattr(page_copy, "_extension", lambda device: kernel)
    monkeypatch.setattr(page_copy, "_upload", lambda ids, device, staging=None: ids.clone())
    # CPU memory stands in for the pinned pool: every check but pinning.
    monkeypatch.setattr(page_copy, "validate_host_pool",
                        lambda pool, page_bytes: pool.view(-1).view(torch.uint8).numel()
                        // page_bytes)
    return kernel


@pytest.mark.parametrize("indices", ["lists", "tensors"])
@pytest.mark.parametrize("method", ["copy", "copy_memcpy"])
def test_copier_launches_skip_null_blocks(emulated, method: str, indices: str):
    """UVAPageCopier with skip_null, its launches run by the kernel's emulation: one launch per
    part over that part's chunks, no launch moves a null block, and the result is
    copy_reference's, both directions."""
    chunks = _cpu_chunks(seed=21)
    layout = chunks.layout
    ref_tensors = [t.clone() for t in chunks.tensors]
    g = torch.Generator().manual_seed(22)
    host = torch.randint(0, 256, (5, layout.page_bytes), generator=g, dtype=torch.uint8)
    ref_host = host.clone()
    as_given = (lambda x: x) if indices == "lists" else (lambda x: torch.tensor(x))
    copy = getattr(UVAPageCopier(), method)
    pages = [3, 0, 4, 1, 2]
    # Each direction: pairs moving group 0 only, both groups, group 1 only, and neither.
    for to_device, blocks in ((False, [[5, 2, 0, 0, 4], [0, 2, 1, 0, 1]]),
                              (True, [[4, 3, 0, 0, 1], [0, 1, 2, 0, 0]])):
        emulated.launches.clear()
        copy(host, chunks, as_given(pages), as_given(blocks), to_device, skip_null=True)
        copy_reference(ref_host, ref_tensors, layout, pages, blocks, to_device, skip_null=True)
        assert torch.equal(host, ref_host)
        for t, ref in zip(chunks.tensors, ref_tensors):
            assert torch.equal(t.view(torch.int16), ref.view(torch.int16))
        parts = copy_parts(torch.tensor(blocks), layout, skip_null=True)
        assert len(emulated.launches) == len(parts) == 3
        for launch, part in zip(emulated.launches, parts):
            bases = [chunks.tensors[c].data_ptr() for c in part.chunks]
            assert sorted({base for _, base, _, _ in launch}) == sorted(bases)
            assert [page for *_, page in launch[::len(bases)]] == [pages[i] for i in part.pairs]
            assert all(block != 0 for _, _, block, _ in launch)


def test_copier_without_null_blocks_is_one_launch_of_the_full_table(emulated):
    chunks = _cpu_chunks(seed=31)
    host = torch.zeros(5, chunks.page_bytes, dtype=torch.uint8)
    UVAPageCopier().copy(host, chunks, [3, 0], [[5, 2], [1, 2]], False, skip_null=True)
    assert len(emulated.launches) == 1 and len(emulated.launches[0]) == 2 * len(ALL)
    for page, b0, b1 in ((3, 5, 1), (0, 2, 2)):
        assert torch.equal(host[page], _page_by_hand(chunks.tensors, chunks.layout, [b0, b1]))
    emulated.launches.clear()
    UVAPageCopier().copy(host, chunks, [], [[], []], False, skip_null=True)
    assert emulated.launches == []


# ---- on the GPU --------------------------------------------------------------------------------

LAYOUTS = {  # name: (spec, blocks per group)
    "llama": (KVSpec.uniform(2, kv_heads_layer(HEADS, DIM)), (6,)),
    "mla": (KVSpec.uniform(2, latent_layer(LATENT)), (6,)),
    "two_groups": (_two_group_spec(), (6, 3)),
}
PAGES = [3, 0, 4]
BLOCKS = {1: [[5, 2, 1]], 2: [[5, 2, 1], [0, 2, 1]]}  # per number of groups
# The last two stride: fewer CTAs than work items (6 pairs' chunks x ctas_per_chunk).
CONFIGS = [UVAPageCopier(), UVAPageCopier(32, 3, 1), UVAPageCopier(128, 2, 8),
           UVAPageCopier(max_ctas=1), UVAPageCopier(64, 3, 2, max_ctas=5)]


def _setup(name: str, seed: int = 0):
    spec, num_blocks = LAYOUTS[name]
    tensors, groups = _chunk_tensors(spec, num_blocks, "cuda", seed)
    chunks = DeviceChunks.prepare(tensors, groups, num_blocks)
    g = torch.Generator().manual_seed(seed + 1)
    host = torch.randint(0, 256, (5, chunks.page_bytes), generator=g, dtype=torch.uint8)
    return chunks, host.pin_memory(), BLOCKS[spec.num_groups]


def _copies(chunks: DeviceChunks, config: UVAPageCopier):
    def reference(host, pages, blocks, to_device):
        copy_reference(host, chunks.tensors, chunks.layout, pages, blocks, to_device)

    def uva(host, pages, blocks, to_device):
        config.copy(host, chunks, pages, blocks, to_device)

    def memcpy(host, pages, blocks, to_device):
        config.copy_memcpy(host, chunks, pages, blocks, to_device)

    return {"reference": reference, "uva": uva, "memcpy": memcpy}


@needs_cuda
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uva_equals_memcpy_equals_reference(name: str, config: UVAPageCopier):
    chunks, host0, blocks = _setup(name)
    state0 = [t.clone() for t in chunks.tensors]
    results = {}
    for method, copy in _copies(chunks, config).items():
        for t, s in zip(chunks.tensors, state0):
            t.copy_(s)
        host = host0.clone().pin_memory()
        # Host -> device with list indices, then device -> host with device-tensor indices
        # into a poisoned pool (other pages keep their bytes).
        copy(host, PAGES, blocks, True)
        torch.cuda.synchronize()
        loaded = [t.clone() for t in chunks.tensors]
        host[PAGES] = 0xA5
        copy(host, torch.tensor(PAGES, device="cuda"), torch.tensor(blocks, device="cuda"), False)
        torch.cuda.synchronize()
        results[method] = (loaded, host.clone())
    want_dev, want_host = results.pop("reference")
    assert torch.equal(want_host, host0)  # the pages went down and came back unchanged
    for method, (dev, host) in results.items():
        assert torch.equal(host, want_host), method
        for c, (got, want) in enumerate(zip(dev, want_dev)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (method, c)


@needs_cuda
@pytest.mark.parametrize("method", ["copy", "copy_memcpy"])
def test_device_to_host_pages_are_the_chunks_back_to_back(method: str):
    chunks, host, blocks = _setup("two_groups", seed=3)
    cpu = [t.cpu() for t in chunks.tensors]
    # Indices as CPU tensors, device_blocks as one device tensor per group.
    rows = [torch.tensor(r, device="cuda") for r in blocks]
    getattr(UVAPageCopier(), method)(host, chunks, torch.tensor(PAGES), rows, False)
    torch.cuda.synchronize()
    for i, p in enumerate(PAGES):
        want = _page_by_hand(cpu, chunks.layout, [r[i] for r in blocks])
        assert torch.equal(host[p], want)


@needs_cuda
def test_host_pool_allocates_exactly_and_returns_an_event():
    from deepinfer.backends.cuda.host_pool import CUDAHostPool

    chunks, host, blocks = _setup("two_groups", seed=5)
    pool = CUDAHostPool.allocate(7, chunks)
    assert pool.pages.is_pinned() and pool.pages.dtype == torch.uint8
    assert tuple(pool.pages.shape) == (7, chunks.page_bytes) and pool.num_pages == 7
    assert pool.pages.untyped_storage().nbytes() == 7 * chunks.page_bytes
    assert pool.copy([], [[], []], to_device=True) is None
    with pytest.raises(ValueError, match="rows for 2 KV groups"):
        pool.copy([], [[]], to_device=True)
    pool.pages[6] = host[4]
    # Pair 1's blocks: the pool leaves a group whose block is the null block alone (pair 0's
    # group 1 here; test_null_blocks_are_left_alone_on_the_gpu), so none of those.
    pair = [[blocks[0][1]], [blocks[1][1]]]
    assert 0 not in (pair[0][0], pair[1][0])
    handle = pool.copy([6], pair, to_device=True)
    handle.wait()
    assert handle.done()
    pool.pages[6] = 0
    pool.copy([6], pair, to_device=False).wait()
    assert torch.equal(pool.pages[6], host[4])


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister as calls recorded, for a host without CUDA."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0


def _pool_file(folder: str, nbytes: int) -> str:
    path = os.path.join(folder, "pool")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def test_a_shared_pool_is_unregistered_when_its_last_view_goes(pool_dir, monkeypatch):
    """The registration of a shared pool's mapping ends with the mapping (before the unmap),
    so a second pool over the same file in the same process registers afresh; writes go to
    the file either way."""
    import gc

    from deepinfer.backends.cuda import host_pool

    cudart = _FakeCudart()
    monkeypatch.setattr(host_pool, "_cudart", lambda: cudart)
    monkeypatch.setattr(host_pool, "file_system_of", lambda path: "tmpfs")  # any machine
    path = _pool_file(pool_dir, 4096)
    pages = host_pool.pin_shared(path, 4096).view(4, 1024)
    first = cudart.calls[0][1]
    assert cudart.calls == [("register", first)] and first == pages.data_ptr()
    pages[3, 5] = 7
    rows = pages[2:]  # a view keeps the mapping, and so the registration
    del pages
    gc.collect()
    assert len(cudart.calls) == 1 and rows[1, 5] == 7
    del rows
    gc.collect()
    assert cudart.calls == [("register", first), ("unregister", first)]
    again = host_pool.pin_shared(path, 4096)
    assert again[3 * 1024 + 5] == 7 and cudart.calls[-1] == ("register", again.data_ptr())
    with pytest.raises(ValueError, match="holds 4096 bytes"):
        host_pool.pin_shared(path, 8192)


def test_a_pool_on_a_disk_file_system_is_refused_before_the_driver_is_asked(tmp_path,
                                                                           monkeypatch):
    """A failed cudaHostRegister would leave its error as the runtime's last error, raised
    later by an unrelated CUDA call: a pool file outside shared memory is refused first."""
    from deepinfer.backends.cuda import host_pool

    if host_pool.file_system_of(str(tmp_path)) in host_pool.LOCKABLE_FILE_SYSTEMS:
        pytest.skip("tmp_path is in shared memory here")
    cudart = _FakeCudart()
    monkeypatch.setattr(host_pool, "_cudart", lambda: cudart)
    with pytest.raises(RuntimeError, match="cannot be page-locked"):
        host_pool.pin_shared(_pool_file(str(tmp_path), 4096), 4096)
    assert cudart.calls == []


def test_file_system_of_takes_the_longest_mount_point_above_the_path(tmp_path):
    from deepinfer.backends.cuda.host_pool import file_system_of

    table = tmp_path / "mounts"
    table.write_text("/dev/vda / ext4 rw 0 0\n"
                     "tmpfs /dev/shm tmpfs rw 0 0\n"
                     "tmpfs /mnt/pool\\040dir tmpfs rw 0 0\n"
                     "/dev/vdb /mnt/pool\\040dir/disk xfs rw 0 0\n"
                     "tmpfs /dev/shmx tmpfs rw 0 0\n")

    def kind(path: str) -> str | None:
        return file_system_of(path, str(table))

    assert kind("/dev/shm/deepinfer-1/pages") == "tmpfs"
    assert kind("/mnt/pool dir/pages") == "tmpfs"  # "\040" is a space
    assert kind("/mnt/pool dir/disk/pages") == "xfs"
    assert kind("/dev/shmpool") == "ext4"  # a prefix of the name is no mount point above it
    assert file_system_of("/x", str(tmp_path / "none")) is None


@needs_cuda
def test_pools_over_one_file_made_and_freed_in_turn_register_each_time():
    """The GPU's own registrations: pools over one /dev/shm file made one after another in a
    process (each freed first) all register, with writes seen by the next."""
    import gc
    import tempfile

    from deepinfer.backends.cuda.host_pool import pin_shared

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        path = _pool_file(folder, 1 << 22)
        for value in range(1, 5):
            pages = pin_shared(path, 1 << 22)
            assert pages[0].item() == value - 1
            pages[0] = value
            del pages
            gc.collect()


@needs_cuda
def test_a_store_after_an_event_does_not_wait_for_work_queued_since():
    """A store follows `after` (where its blocks were final), not a step the engine launched
    since: it completes while a long kernel queued after the event still runs, and reads the
    blocks as they were at the event."""
    from deepinfer.backends.cuda.host_pool import CUDAHostPool

    chunks, host, blocks = _setup("llama", seed=6)
    pool = CUDAHostPool.allocate(2, chunks)
    pair = [[blocks[0][1]]]
    want = _page_by_hand([t.cpu() for t in chunks.tensors], chunks.layout, [pair[0][0]])
    ready = torch.cuda.Event()
    ready.record()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the engine stream, queued after the event
    busy = torch.cuda.Event()
    busy.record()
    pool.copy([1], pair, to_device=False, after=ready).wait()
    assert not busy.query()  # the store ended before the work queued after its event
    assert torch.equal(pool.pages[1], want)
    # Without an event it starts behind everything the engine stream holds.
    pool.pages[1] = 0
    pool.copy([1], pair, to_device=False).wait()
    assert busy.query() and torch.equal(pool.pages[1], want)


@needs_cuda
def test_gpu_range_checks_and_trusted_device_indices():
    chunks, host, _ = _setup("llama")
    copier = UVAPageCopier()
    with pytest.raises(ValueError, match=r"host_pages out of range \[0, 5\)"):
        copier.copy(host, chunks, [5], [[0]], True)
    with pytest.raises(ValueError, match=r"KV group 0 out of range \[0, 6\)"):
        copier.copy_memcpy(host, chunks, [0], [[6]], True)
    with pytest.raises(ValueError, match="must be pinned"):
        copier.copy(host.clone(), chunks, [0], [[0]], True)
    with pytest.raises(ValueError, match=r"must be \[num_groups=1, n=2\]"):
        copier.copy(host, chunks, torch.tensor([0, 1], device="cuda"),
                    torch.tensor([0, 1], device="cuda"), True)


# ---- null blocks on the GPU (skip_null: HiCache's pool) ---------------------------------------

NULL_PAGES = [3, 0, 4, 1]  # page 2 is never named
# Stored from: pair 0 group 0 only, pair 1 both groups, pair 2 group 0 only, pair 3 neither.
NULL_STORE = [[5, 2, 1, 0], [0, 2, 0, 0]]
# Loaded into: pair 0 group 0 only, pair 1 both, pair 2 group 1 only, pair 3 neither.
NULL_LOAD = [[4, 3, 0, 0], [0, 1, 2, 0]]


def _null_copy(method: str, chunks: DeviceChunks, host: torch.Tensor):
    """copy(pages, blocks, to_device) of one method, with skip_null, run to the end."""
    from deepinfer.backends.cuda.host_pool import CUDAHostPool

    if method.startswith("pool"):  # what CUDAAccelerator.copy_pages calls
        # "pool stream": stores on a stream of their own with a grid of 2 CTAs, as allocated.
        stream = torch.cuda.Stream() if method == "pool stream" else None
        pool = CUDAHostPool(host, chunks, UVAPageCopier(), UVAPageCopier(max_ctas=2), stream)

        def copy(pages, blocks, to_device):
            handle = pool.copy(pages, blocks, to_device)
            if handle is not None:
                handle.wait()
                assert handle.done()
        return copy
    run = getattr(UVAPageCopier(), "copy" if method == "uva" else "copy_memcpy")

    def copy(pages, blocks, to_device):
        run(host, chunks, pages, blocks, to_device, skip_null=True)
        torch.cuda.synchronize()
    return copy


@needs_cuda
@pytest.mark.parametrize("indices", ["lists", "device tensors"])
@pytest.mark.parametrize("method", ["uva", "memcpy", "pool", "pool stream"])
def test_null_blocks_are_left_alone_on_the_gpu(method: str, indices: str):
    """Store: a pair's group whose device block is the null block leaves that group's bytes of
    the host page as they were (a pair with no block leaves the page whole); every other chunk
    lands in the page byte for byte. Load: device block 0 of every chunk is never written, the
    other named blocks get their page's bytes, every other block keeps its own."""
    chunks, _, _ = _setup("two_groups", seed=7)
    layout = chunks.layout
    g = torch.Generator().manual_seed(8)
    host = torch.randint(0, 256, (5, layout.page_bytes), generator=g,
                         dtype=torch.uint8).pin_memory()
    copy = _null_copy(method, chunks, host)
    as_given = ((lambda x: x) if indices == "lists"
                else (lambda x: torch.tensor(x, device=chunks.device)))

    def device_blocks() -> list[torch.Tensor]:  # per chunk, [num_blocks, block_bytes] on the CPU
        return [_blocks_of(t, layout.num_blocks[layout.groups[c]]).cpu()
                for c, t in enumerate(chunks.tensors)]

    # device -> host
    dev, want = device_blocks(), host.clone()
    for i, page in enumerate(NULL_PAGES):
        for c in range(layout.num_chunks):
            block = NULL_STORE[layout.groups[c]][i]
            if block != 0:
                off = layout.host_offsets[c]
                want[page, off:off + layout.block_bytes[c]] = dev[c][block]
    before = host.clone()
    copy(as_given(NULL_PAGES), as_given(NULL_STORE), False)
    assert torch.equal(host, want)
    g1 = slice(layout.host_offsets[G1[0]], layout.page_bytes)  # group 1's bytes of a page
    assert torch.equal(host[[3, 4], g1], before[[3, 4], g1])  # null in group 1: untouched
    assert torch.equal(host[[1, 2]], before[[1, 2]])  # no block / not named: untouched
    assert not torch.equal(host[[3, 4], :g1.start], before[[3, 4], :g1.start])  # group 0 moved

    # host -> device, from fresh host bytes
    host.copy_(torch.randint(0, 256, host.shape, generator=g, dtype=torch.uint8))
    before, want = device_blocks(), device_blocks()
    for i, page in enumerate(NULL_PAGES):
        for c in range(layout.num_chunks):
            block = NULL_LOAD[layout.groups[c]][i]
            if block != 0:
                off = layout.host_offsets[c]
                want[c][block] = host[page, off:off + layout.block_bytes[c]]
    copy(as_given(NULL_PAGES), as_given(NULL_LOAD), True)
    after = device_blocks()
    for c in range(layout.num_chunks):
        assert torch.equal(after[c][0], before[c][0]), f"chunk {c}: block 0 was written"
        assert torch.equal(after[c], want[c]), f"chunk {c}"


@needs_cuda
def test_host_tier_serves_a_sliding_window_model_on_the_gpu(tmp_path):
    """HiCache through the engine on the GPU with Mistral and a 48-token window (its one KV
    group frees the pages that leave the window, so a hit loads its pages out of the window at
    its end into the null block, which the copy must leave alone; prompts here prefill in one
    chunk, so every stored page is whole): greedy tokens equal the run without the host tier,
    and hits come from the host.
    (A model mixing windowed and full layers has two KV groups, which the nvidia backend serves
    for DeepSeek-V4 only.)"""
    from deepinfer.backends.cuda.accelerator import CUDAAccelerator
    from deepinfer.testing.hicache import check_host_tier
    from tests.checkpoints import make_checkpoint

    null_copies = []

    class Recording(CUDAAccelerator):
        def copy_pages(self, host_pages, device_blocks, to_device):
            null_copies.extend(to_device for row in device_blocks if 0 in list(row))
            return super().copy_pages(host_pages, device_blocks, to_device)

    assert CUDAAccelerator.capabilities.host_copy_skips_null
    path = make_checkpoint(str(tmp_path / "mistral"), "mistral", sliding_window=48)
    stats = check_host_tier(path, Recording, vocab=250)
    assert stats.host_hit_tokens > 0 and stats.stored_pages > 0
    assert True in null_copies  # loads that left the null block alone


@needs_cuda
def test_store_on_its_own_stream_waits_for_the_engine_and_not_the_other_way():
    """A store runs after the engine's work enqueued before it (it reads what a long kernel
    is still writing), and the engine's later work does not wait for the store: its event is
    not passed while the engine stream already is."""
    from deepinfer.backends.cuda.host_pool import CUDAHostPool

    chunks, _, blocks = _setup("llama", seed=3)
    pool = CUDAHostPool.allocate(5, chunks)
    assert pool.store_stream is not None and pool.store_copier.max_ctas > 0
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the engine is busy for tens of ms, then writes the blocks
    for t in chunks.tensors:
        t.fill_(7)
    handle = pool.copy(PAGES, blocks, to_device=False)
    handle.wait()
    expected = torch.zeros_like(pool.pages)  # the bytes of the 7s, laid out as pages
    copy_reference(expected, chunks.tensors, chunks.layout, PAGES, blocks, to_device=False,
                   skip_null=True)
    assert torch.equal(pool.pages[PAGES], expected[PAGES])
    # Now a store that is still running while the engine has nothing ahead of it.
    with torch.cuda.stream(pool.store_stream):
        torch.cuda._sleep(200_000_000)
    handle = pool.copy(PAGES, blocks, to_device=False)
    mark = torch.cuda.Event()
    mark.record()
    mark.synchronize()
    assert not handle.done()
    handle.wait()


@needs_cuda
def test_pinned_staging_reuses_its_buffers_and_falls_back_while_they_are_busy():
    from deepinfer.backends.cuda.page_copy import PinnedStaging

    staging = PinnedStaging(capacity=64, count=2)
    device = torch.device("cuda")
    first = staging.upload(torch.arange(10), device)
    torch.cuda.synchronize()
    for k in range(6):  # each upload's event has passed: no new pinned memory
        assert torch.equal(staging.upload(torch.arange(k, k + 50), device).cpu(),
                           torch.arange(k, k + 50))
        torch.cuda.synchronize()
    assert staging.fallbacks == 0 and torch.equal(first.cpu(), torch.arange(10))
    torch.cuda._sleep(50_000_000)  # both buffers' uploads queue behind this
    busy = [staging.upload(torch.full((8,), v), device) for v in (1, 2)]
    late = staging.upload(torch.full((8,), 3), device)  # neither buffer free yet
    big = staging.upload(torch.arange(100), device)  # larger than any buffer
    assert staging.fallbacks == 2
    torch.cuda.synchronize()
    assert [int(t[0]) for t in busy + [late]] == [1, 2, 3] and int(big[-1]) == 99


def test_layer_launches_group_each_parts_chunks_by_layer():
    chunks = _cpu_chunks()
    layers = [0, 0, 2, 2, 1, 1]  # chunk -> layer: group 0 holds layers 0 and 2, group 1 layer 1
    parts = copy_parts(torch.tensor([[5, 2, 0, 4], [0, 2, 1, 1]]), chunks.layout, skip_null=True)
    plan = layer_launches(parts, layers)
    assert [layer for layer, _ in plan] == [0, 1, 2]
    for layer, subsets in plan:
        for index, ids in subsets:
            assert ids and all(layers[c] == layer for c in ids)
            assert set(ids) <= set(parts[index].chunks)
    # Every chunk of every part is launched exactly once, over all layers.
    launched = sorted((i, c) for _, subsets in plan for i, ids in subsets for c in ids)
    assert launched == sorted((i, c) for i, part in enumerate(parts) for c in part.chunks)


def test_copy_layers_moves_what_copy_does_a_layer_at_a_time(emulated):
    """copy_layers, its launches run by the kernel's emulation: after each layer's callback
    exactly that layer's (and earlier layers') chunks hold the loaded pages; the end result is
    copy_reference's with skip_null."""
    chunks = _cpu_chunks(seed=31)
    layout = chunks.layout
    layers = [0, 0, 2, 2, 1, 1]  # chunk -> layer (page order is group by group)
    ref_tensors = [t.clone() for t in chunks.tensors]
    host = torch.randint(0, 256, (5, layout.page_bytes), generator=torch.Generator()
                         .manual_seed(32), dtype=torch.uint8)
    pages, blocks = [3, 0, 4, 1], [[4, 3, 0, 1], [0, 1, 2, 2]]
    copy_reference(host.clone(), ref_tensors, layout, pages, blocks, True, skip_null=True)
    seen: list[int] = []

    def layer_done(layer: int) -> None:
        seen.append(layer)
        for c, (t, ref) in enumerate(zip(chunks.tensors, ref_tensors)):
            if layers[c] <= layer:
                assert torch.equal(t.view(torch.int16), ref.view(torch.int16)), (layer, c)

    UVAPageCopier().copy_layers(host, chunks, pages, blocks, True, layers, layer_done)
    assert seen == sorted(set(layers))
    for t, ref in zip(chunks.tensors, ref_tensors):
        assert torch.equal(t.view(torch.int16), ref.view(torch.int16))


@needs_cuda
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_layer_load_waits_behind_the_engine_and_equals_the_reference(name: str):
    """load_layers on the pool's load stream: it starts only after the engine's work queued so
    far (a kernel still running reads those blocks), each layer's event passes once its chunks
    are in, and the blocks end up as copy_reference loads them."""
    from deepinfer.backends.cuda.host_pool import CUDAHostPool

    chunks, host, blocks = _setup(name, seed=7)
    pool = CUDAHostPool.allocate(5, chunks)
    pool.pages.copy_(host)
    layers = list(range(chunks.layout.num_chunks))  # a chunk per "layer": the finest split
    ref = [t.clone() for t in chunks.tensors]
    pages = [4, 1, 3]
    pair_blocks = [row[:3] for row in blocks]
    copy_reference(host.clone(), ref, chunks.layout, pages, pair_blocks, True, skip_null=True)
    torch.cuda._sleep(1_000_000_000)  # the engine's stream is busy for a while
    busy = torch.cuda.Event()
    busy.record()
    load = pool.load_layers(pages, pair_blocks, layers)
    assert set(load.events) == set(layers)
    load.wait()
    assert busy.query(), "the load ran before the engine's queued work"
    for t, r in zip(chunks.tensors, ref):  # as bits: random bf16 bytes hold NaNs
        assert torch.equal(t.view(torch.int16), r.view(torch.int16))
    assert pool.load_layers([], [[] for _ in pair_blocks], layers) is None
