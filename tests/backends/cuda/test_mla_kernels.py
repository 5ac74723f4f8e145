"""Paged MLA kernels (weight-absorbed DeepSeek attention) against a dense float64 reference.

Every case draws fresh inputs, scatters the sequences' latent rows over shuffled blocks (never
block 0, the null block), leaves unused cache slots NaN so a read past a sequence shows up, and
poisons the output with NaN so an unwritten element shows up. Shapes are small (H 2-4, L 16-32,
R 8-16) so that the interpreter gets through them in seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from deepinfer.backends.cuda.kernels import decode_attention, mla_attention
from deepinfer.backends.cuda.kernels.mla_attention import (
    _decode_config,
    choose_mla_num_splits,
    launch_mla_decode,
    paged_mla_decode,
    paged_mla_prefill,
    store_latent,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedLatent:
    cache: torch.Tensor  # [num_slots, L + R]
    block_tables: torch.Tensor  # int32 [N, max_blocks]
    seq_lens: torch.Tensor  # int32 [N]
    block_size: int


def _paged_latent(seq_lens: list[int], width: int, block_size: int, dtype: torch.dtype,
                  gen: torch.Generator) -> PagedLatent:
    """Random latent rows for each sequence in randomly chosen, non-contiguous blocks."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    cache = torch.full((num_blocks * block_size, width), float("nan"), dtype=dtype)
    # The null block holds junk that padded rows read; keep it finite.
    cache[:block_size] = torch.randn(block_size, width, generator=gen).to(dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = torch.tensor([free.pop() for _ in range(nb)])
        tables[i, :nb] = ids.to(torch.int32)
        cache[_slots(ids, block_size, n)] = torch.randn(n, width, generator=gen).to(dtype)
    return PagedLatent(cache.to(DEVICE), tables.to(DEVICE),
                       torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_size)


def _slots(block_ids: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    return (block_ids.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]


def _reference(q: torch.Tensor, kv: PagedLatent, seq: int, scale: float,
               lora: int) -> torch.Tensor:
    """Dense float64 MLA of q [Q, H, L + R], the last Q positions of sequence seq: every head
    scores all L + R dims of the shared latent and averages its first L."""
    n = int(kv.seq_lens[seq])
    table = kv.block_tables[seq].cpu()
    latent = kv.cache.cpu()[_slots(table[: math.ceil(n / kv.block_size)], kv.block_size, n)]
    latent = latent.double()  # [n, L + R]
    scores = q.cpu().double() @ latent.T * scale  # [Q, H, n]
    pos = torch.arange(n - q.shape[0], n)[:, None, None]
    scores = scores.masked_fill(torch.arange(n)[None, None, :] > pos, float("-inf"))
    return scores.softmax(-1) @ latent[:, :lora]


def _strided_q(tokens: int, heads: int, width: int, dtype: torch.dtype,
               gen: torch.Generator) -> torch.Tensor:
    """q as a slice of a wider projection output: rows are not contiguous."""
    full = torch.randn(tokens, heads * width + 24, generator=gen).to(dtype).to(DEVICE)
    return full[:, : heads * width].view(tokens, heads, width)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.cpu().double()
    assert not out.isnan().any(), "output has unwritten or NaN elements"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        rel = (out - ref).norm() / ref.norm()
        assert rel < 1e-2, f"relative error {rel:.3g}"


# (H, L, R, block_size, num_splits, dtype, seq_lens); a trailing seq_len 1 is a padded row on
# the null block. Interpreted tiles are 8 keys: across 4-key blocks, inside 8- and 16-key ones.
DECODE_CASES = [
    (2, 16, 8, 4, 1, torch.float32, [1, 9, 33, 70, 1]),
    (4, 32, 16, 16, 2, torch.float32, [50]),
    (3, 16, 8, 8, 4, torch.float32, [5, 17, 64, 100, 1]),
    (4, 32, 8, 4, 4, torch.float32, [31, 2]),
    (4, 32, 16, 16, 4, torch.bfloat16, [12, 77, 1]),
    (2, 16, 16, 8, 1, torch.bfloat16, [40, 3, 60]),
    (80, 16, 8, 4, 2, torch.float32, [9, 40]),  # two programs of heads, the second partial
]


@pytest.mark.parametrize("heads,lora,rope,block_size,num_splits,dtype,seq_lens", DECODE_CASES)
def test_mla_decode_matches_reference(heads, lora, rope, block_size, num_splits, dtype,
                                      seq_lens):
    gen = torch.Generator().manual_seed(heads * 1000 + lora * 10 + num_splits)
    kv = _paged_latent(seq_lens, lora + rope, block_size, dtype, gen)
    if seq_lens[-1] == 1 and len(seq_lens) > 2:
        kv.block_tables[-1].zero_()
    q = _strided_q(len(seq_lens), heads, lora + rope, dtype, gen)
    out = torch.full((len(seq_lens), heads, lora), float("nan"), dtype=dtype, device=DEVICE)
    scale = (lora + rope) ** -0.5
    got = paged_mla_decode(q, kv.cache, kv.block_tables, kv.seq_lens, block_size, scale,
                           num_splits, lora, out=out)
    assert got is out
    ref = torch.stack([_reference(q[b:b + 1], kv, b, scale, lora)[0]
                       for b in range(len(seq_lens))])
    _assert_close(out, ref, dtype)


# (H, L, R, block_size, dtype, [(cached prefix, new tokens)])
PREFILL_CASES = [
    (2, 16, 8, 4, torch.float32, [(0, 37), (0, 1), (0, 16)]),
    (4, 32, 16, 8, torch.float32, [(0, 20), (5, 1), (40, 35), (14, 16), (9, 7)]),
    (3, 16, 16, 16, torch.float32, [(23, 30), (0, 9)]),
    (4, 32, 8, 16, torch.bfloat16, [(30, 25), (0, 18), (3, 1)]),
]


@pytest.mark.parametrize("heads,lora,rope,block_size,dtype,chunks", PREFILL_CASES)
def test_mla_prefill_matches_reference(heads, lora, rope, block_size, dtype, chunks):
    gen = torch.Generator().manual_seed(heads * 1000 + lora * 10 + block_size)
    kv = _paged_latent([p + n for p, n in chunks], lora + rope, block_size, dtype, gen)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = _strided_q(starts[-1], heads, lora + rope, dtype, gen)
    out = torch.full((starts[-1], heads, lora), float("nan"), dtype=dtype, device=DEVICE)
    scale = 0.15
    query_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    got = paged_mla_prefill(q, kv.cache, kv.block_tables, query_starts, kv.seq_lens,
                            max(n for _, n in chunks), block_size, scale, lora, out=out)
    assert got is out
    ref = torch.cat([_reference(q[starts[i]:starts[i + 1]], kv, i, scale, lora)
                     for i in range(len(chunks))])
    _assert_close(out, ref, dtype)


def test_mla_prefill_then_decode_agree():
    """The last token of a prompt attends the same keys in either kernel."""
    gen = torch.Generator().manual_seed(3)
    kv = _paged_latent([21], 24, 8, torch.float32, gen)
    q = _strided_q(21, 2, 24, torch.float32, gen)
    starts = torch.tensor([0, 21], dtype=torch.int32, device=DEVICE)
    pre = paged_mla_prefill(q, kv.cache, kv.block_tables, starts, kv.seq_lens, 21, 8, 0.3, 16)
    dec = paged_mla_decode(q[-1:], kv.cache, kv.block_tables, kv.seq_lens, 8, 0.3, 2, 16)
    torch.testing.assert_close(dec[0], pre[-1], rtol=1e-5, atol=1e-5)


def test_the_query_parts_apart_equal_the_joined_query():
    """q [T, H, L] and q_pe [T, H, R] as two tensors (the nvidia backend's einsum output and the
    rotated view of q_proj's output, no joined copy) give the joined query's result, in both
    kernels; 64 heads a decode program (a tuning option) too."""
    gen = torch.Generator().manual_seed(4)
    kv = _paged_latent([21, 9], 24, 8, torch.float32, gen)
    q = _strided_q(21, 64, 24, torch.float32, gen)
    q_pe = torch.randn(21, 64, 40, generator=gen).to(DEVICE)[:, :, 3:11]  # strided rows
    joined = torch.cat((q[..., :16], q_pe), dim=-1)
    starts = torch.tensor([0, 12, 21], dtype=torch.int32, device=DEVICE)
    lens = kv.seq_lens
    args = (kv.cache, kv.block_tables, starts, lens, 12, 8, 0.3, 16)
    torch.testing.assert_close(paged_mla_prefill(q[..., :16], *args, q_pe=q_pe),
                               paged_mla_prefill(joined, *args), rtol=0, atol=0)
    dec_q, dec_pe, dec_joined = q[:2, :, :16], q_pe[:2], joined[:2]
    want = paged_mla_decode(dec_joined, kv.cache, kv.block_tables, lens, 8, 0.3, 2, 16)
    torch.testing.assert_close(
        paged_mla_decode(dec_q, kv.cache, kv.block_tables, lens, 8, 0.3, 2, 16, q_pe=dec_pe),
        want, rtol=0, atol=0)
    wide = launch_mla_decode(dec_q, kv.cache, kv.block_tables, lens, 8, 0.3, 2, 16, None,
                             _decode_config(16), q_pe=dec_pe, max_block_h=64)
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)
    ref = torch.stack([_reference(dec_joined[b:b + 1], kv, b, 0.3, 16)[0] for b in range(2)])
    _assert_close(want, ref, torch.float32)
    with pytest.raises(ValueError, match="q_pe"):
        paged_mla_decode(dec_q, kv.cache, kv.block_tables, lens, 8, 0.3, 2, 16,
                         q_pe=dec_pe[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_latent_skips_padding(dtype):
    gen = torch.Generator().manual_seed(5)
    width, slots = 24, 40
    cache = torch.full((slots, width), float("nan"), dtype=dtype, device=DEVICE)
    rows = torch.randn(6, width + 8, generator=gen).to(dtype).to(DEVICE)[:, :width]  # strided
    slot_mapping = torch.tensor([7, -1, 0, 39, -1, 12], dtype=torch.int64, device=DEVICE)
    store_latent(rows, cache, slot_mapping)
    expected = torch.full((slots, width), float("nan"), dtype=dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[slot] = rows[t].cpu()
    torch.testing.assert_close(cache.cpu(), expected, rtol=0, atol=0, equal_nan=True)
    store_latent(rows[:0], cache, slot_mapping[:0])  # an empty step launches nothing


def test_mla_rejects_bad_layouts():
    meta = dict(device="meta")
    tables = torch.empty(2, 4, dtype=torch.int32, **meta)
    lens = torch.empty(2, dtype=torch.int32, **meta)
    q = torch.empty(2, 4, 24, **meta)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        paged_mla_decode(q, torch.empty(64, 24, **meta), tables, lens, 16, 0.1, 1, 12)
    with pytest.raises(ValueError, match="rotary"):
        paged_mla_decode(torch.empty(2, 4, 28, **meta), torch.empty(64, 28, **meta), tables,
                         lens, 16, 0.1, 1, 16)
    with pytest.raises(ValueError, match="latent_cache"):
        paged_mla_decode(q, torch.empty(64, 32, **meta), tables, lens, 16, 0.1, 1, 16)
    with pytest.raises(ValueError, match="num_splits"):
        paged_mla_decode(q, torch.empty(64, 24, **meta), tables, lens, 16, 0.1, 3, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_latent(torch.empty(2, 24, **meta), torch.empty(64, 24, **meta),
                     torch.empty(2, 2, dtype=torch.int64, **meta))


def test_choose_mla_num_splits():
    for batch in (1, 3, 32, 128, 512):
        for length in (1, 100, 1024, 4096, 65536):
            n = choose_mla_num_splits(batch, 16, length)
            assert 1 <= n <= 32 and n & (n - 1) == 0
    assert choose_mla_num_splits(1, 16, 4096) == 16  # 256 tokens a split
    assert choose_mla_num_splits(32, 16, 4096) == 8  # about one program per SM
    assert choose_mla_num_splits(256, 16, 4096) == 1
    assert choose_mla_num_splits(1, 128, 65536) == 32  # 4 head groups, at most 32 splits


class _Recorder:
    """Stands in for a jitted kernel: records the grid instead of launching."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


def test_mla_launchers_never_read_tensor_values(monkeypatch):
    """Launch on 'meta' tensors, which have no values: any host read would raise, and the
    grids may depend on shapes and num_splits only (a must for CUDA graph capture)."""
    split, merge, prefill, store = _Recorder(), _Recorder(), _Recorder(), _Recorder()
    monkeypatch.setattr(mla_attention, "_mla_decode_split_kernel", split)
    monkeypatch.setattr(decode_attention, "_decode_merge_kernel", merge)
    monkeypatch.setattr(mla_attention, "_mla_prefill_kernel", prefill)
    monkeypatch.setattr(mla_attention, "_store_latent_kernel", store)
    meta = dict(device="meta")
    cache = torch.empty(64 * 16, 576, dtype=torch.bfloat16, **meta)
    tables = torch.empty(5, 4, dtype=torch.int32, **meta)
    lens = torch.empty(5, dtype=torch.int32, **meta)
    for heads in (16, 128):  # one program per sequence and split; two 64-head groups
        q = torch.empty(5, heads, 576, dtype=torch.bfloat16, **meta)
        paged_mla_decode(q, cache, tables, lens, 16, 0.1, 8, 512)
    merges = [(5, math.ceil(h / decode_attention.merge_heads_per_program(h, 8, 512)))
              for h in (16, 128)]
    assert split.grids == [(5, 1, 8), (5, 2, 8)] and merge.grids == merges
    q = torch.empty(40, 16, 576, dtype=torch.bfloat16, **meta)
    starts = torch.empty(6, dtype=torch.int32, **meta)
    paged_mla_prefill(q, cache, tables, starts, lens, 20, 16, 0.1, 512)
    block_m = mla_attention._prefill_config(512).block_m
    assert prefill.grids == [(16, 5, math.ceil(20 / block_m))]
    store_latent(torch.empty(40, 576, dtype=torch.bfloat16, **meta), cache,
                 torch.empty(40, dtype=torch.int64, **meta))
    assert store.grids == [(40,)]
