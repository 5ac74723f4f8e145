"""HiCache page copies over a list of KV chunks (page_copy.py, page_copy.cu, host_pool.py).

Without a GPU: the page layout (block bytes, host offsets, page bytes, from a KVSpec too), every
argument check and its message, the per-chunk table, the index range checks, and the torch
reference copy against a page built by hand. With a GPU: the UVA kernel, the memcpy baseline
and the torch reference agree byte for byte, both directions, on llama-like, MLA-like and
two-group chunk lists, pages out of order, indices as lists, CPU tensors and device tensors.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.page_copy import (TABLE_ROWS, ChunkLayout, DeviceChunks,
                                               UVAPageCopier, block_indices, chunk_layout_of,
                                               chunk_table, copy_reference, host_page_indices,
                                               validate_host_pool)
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


# ---- on the GPU --------------------------------------------------------------------------------

LAYOUTS = {  # name: (spec, blocks per group)
    "llama": (KVSpec.uniform(2, kv_heads_layer(HEADS, DIM)), (6,)),
    "mla": (KVSpec.uniform(2, latent_layer(LATENT)), (6,)),
    "two_groups": (_two_group_spec(), (6, 3)),
}
PAGES = [3, 0, 4]
BLOCKS = {1: [[5, 2, 1]], 2: [[5, 2, 1], [0, 2, 1]]}  # per number of groups
CONFIGS = [UVAPageCopier(), UVAPageCopier(32, 3, 1), UVAPageCopier(128, 2, 8)]


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
    handle = pool.copy([6], [[blocks[0][0]], [blocks[1][0]]], to_device=True)
    handle.wait()
    assert handle.done()
    pool.pages[6] = 0
    pool.copy([6], [[blocks[0][0]], [blocks[1][0]]], to_device=False).wait()
    assert torch.equal(pool.pages[6], host[4])


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
