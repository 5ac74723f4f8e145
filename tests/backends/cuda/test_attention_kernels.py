"""Paged decode and prefill attention kernels against a dense float64 reference.

Every case draws fresh inputs, scatters the sequences over shuffled blocks (never block 0, the
null block), leaves unused cache slots NaN so a read past a sequence shows up, and poisons the
output with NaN so an unwritten element shows up. Sliding-window cases also poison every key
that no query sees and point the blocks wholly before the window at a NaN null block, as the
engine does once it frees them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from deepinfer.backends.cuda.kernels import decode_attention, prefill_attention
from deepinfer.backends.cuda.kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from deepinfer.backends.cuda.kernels.prefill_attention import (
    choose_prefill_splits,
    paged_prefill_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_slots, Hk, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [N, max_blocks]
    seq_lens: torch.Tensor  # int32 [N]
    block_size: int


def _paged_kv(seq_lens: list[int], kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, gen: torch.Generator, num_blocks: int = 0,
              max_blocks: int = 0) -> PagedKV:
    """Random K/V for each sequence in randomly chosen, non-contiguous blocks."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = num_blocks or 1 + sum(blocks_per_seq) + 3
    max_blocks = max_blocks or max(blocks_per_seq) + 2
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # The null block holds junk that padded rows read; keep it finite.
    k_cache[:block_size] = torch.randn(block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache[:block_size] = torch.randn(block_size, kv_heads, head_dim, generator=gen).to(dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = torch.tensor([free.pop() for _ in range(nb)])
        tables[i, :nb] = ids.to(torch.int32)
        slots = _slots(ids, block_size, n)
        k_cache[slots] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[slots] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    return PagedKV(k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                   torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_size)


def _slots(block_ids: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    return (block_ids.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]


def _reference(q: torch.Tensor, kv: PagedKV, seq: int, scale: float,
               window: int = 0) -> torch.Tensor:
    """Dense float64 causal attention of q [Q, Hq, D], the last Q positions of sequence seq;
    window > 0 keeps keys k > p - window of the query at p (transformers' sliding_window)."""
    n = int(kv.seq_lens[seq])
    lo = _first_seen_key(n - q.shape[0], window)
    keys = torch.arange(lo, n)
    table = kv.block_tables[seq].cpu().long()
    slots = table[keys // kv.block_size] * kv.block_size + keys % kv.block_size
    k = kv.k_cache.cpu()[slots].double()
    v = kv.v_cache.cpu()[slots].double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n - lo, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qh = q.cpu().double().transpose(0, 1)  # [Hq, Q, D]
    scores = qh @ k.transpose(1, 2) * scale
    pos = torch.arange(n - q.shape[0], n)[:, None]
    hidden = keys[None, :] > pos
    if window:
        hidden |= keys[None, :] <= pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _first_seen_key(first_pos: int, window: int) -> int:
    return max(0, first_pos - window + 1) if window else 0


def _drop_out_of_window(kv: PagedKV, first_positions: list[int], window: int) -> None:
    """What a windowed sequence's cache looks like once the engine freed the blocks behind its
    window: keys no query sees hold NaN, and table entries of blocks wholly before the window
    point at the null block, which holds NaN too."""
    kv.k_cache[:kv.block_size] = float("nan")
    kv.v_cache[:kv.block_size] = float("nan")
    for seq, first_pos in enumerate(first_positions):
        lo = _first_seen_key(first_pos, window)
        table = kv.block_tables[seq]
        keys = torch.arange(lo, device=table.device)
        slots = table[keys // kv.block_size].long() * kv.block_size + keys % kv.block_size
        kv.k_cache[slots] = float("nan")
        kv.v_cache[slots] = float("nan")
        table[: lo // kv.block_size] = 0


def _strided_q(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               gen: torch.Generator) -> torch.Tensor:
    """q as the first slice of a fused qkv projection: rows are not contiguous."""
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype).to(DEVICE)
    return qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.cpu().double()
    assert not out.isnan().any(), "output has unwritten or NaN elements"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        rel = (out - ref).norm() / ref.norm()
        assert rel < 1e-2, f"relative error {rel:.3g}"


# (Hq, Hk, head_dim, block_size, num_splits, dtype)
DECODE_CASES = [
    (8, 2, 32, 16, 1, torch.float32),
    (8, 2, 32, 16, 4, torch.float32),
    (4, 4, 16, 32, 2, torch.float32),
    (16, 2, 64, 32, 4, torch.float32),
    (8, 1, 32, 16, 2, torch.bfloat16),
    (4, 4, 64, 32, 1, torch.bfloat16),
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,num_splits,dtype", DECODE_CASES)
def test_decode_matches_reference(q_heads, kv_heads, head_dim, block_size, num_splits, dtype):
    gen = torch.Generator().manual_seed(hash((q_heads, kv_heads, head_dim, num_splits)) % 2**31)
    # A padded row (seq_len 1 on the null block) last; lengths inside and across blocks.
    seq_lens = [1, 17, 32, 100, 257, 1]
    kv = _paged_kv(seq_lens, kv_heads, head_dim, block_size, dtype, gen)
    kv.block_tables[-1].zero_()
    q = _strided_q(len(seq_lens), q_heads, kv_heads, head_dim, dtype, gen)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                 block_size, scale, num_splits, out=out)
    assert got is out
    ref = torch.stack([_reference(q[b:b + 1], kv, b, scale)[0] for b in range(len(seq_lens))])
    _assert_close(out, ref, dtype)


def test_decode_new_lengths_same_shapes():
    """Same shapes, new seq_lens and tables: one compiled kernel serves both (graph replay)."""
    gen = torch.Generator().manual_seed(7)
    scale = 0.125
    for seq_lens in ([40, 3, 90], [130, 64, 1]):
        kv = _paged_kv(seq_lens, 2, 32, 16, torch.float32, gen, num_blocks=20, max_blocks=10)
        q = _strided_q(3, 4, 2, 32, torch.float32, gen)
        out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     16, scale, 4)
        ref = torch.stack([_reference(q[b:b + 1], kv, b, scale)[0] for b in range(3)])
        _assert_close(out, ref, torch.float32)


# (block_size, window, num_splits, dtype): windows of 1 key, inside a block, exactly a block,
# several blocks, past the longest sequence; tiles (32 keys interpreted) across and inside blocks.
WINDOW_DECODE_CASES = [
    (16, 1, 1, torch.float32),
    (16, 5, 4, torch.float32),
    (16, 16, 2, torch.float32),
    (16, 50, 1, torch.float32),
    (16, 50, 4, torch.float32),
    (64, 40, 4, torch.float32),
    (64, 100, 2, torch.bfloat16),
    (16, 1000, 4, torch.float32),
]


@pytest.mark.parametrize("block_size,window,num_splits,dtype", WINDOW_DECODE_CASES)
def test_decode_sliding_window(block_size, window, num_splits, dtype):
    gen = torch.Generator().manual_seed(window * 131 + block_size + num_splits)
    seq_lens = [1, 17, 32, 100, 257, 64]
    kv = _paged_kv(seq_lens, 2, 32, block_size, dtype, gen)
    _drop_out_of_window(kv, [n - 1 for n in seq_lens], window)
    q = _strided_q(len(seq_lens), 8, 2, 32, dtype, gen)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, block_size,
                           0.2, num_splits, out=out, window=window)
    ref = torch.stack([_reference(q[b:b + 1], kv, b, 0.2, window)[0]
                       for b in range(len(seq_lens))])
    _assert_close(out, ref, dtype)


# (Hq, Hk, head_dim, block_size, dtype)
PREFILL_CASES = [
    (8, 2, 32, 16, torch.float32),
    (4, 4, 16, 32, torch.float32),
    (16, 2, 64, 16, torch.float32),
    (8, 1, 32, 32, torch.bfloat16),
    (4, 2, 64, 16, torch.bfloat16),
]


@dataclass
class PrefillCase:
    """Chunks (cached prefix, new tokens) of several sequences, packed as one step."""

    chunks: list[tuple[int, int]]
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    window: int = 0


def _check_prefill(case: PrefillCase, gen: torch.Generator, scale: float,
                   num_splits: int = 1) -> None:
    """Run the kernel over the case's paged K/V (poisoned output, strided q; keys out of a
    window dropped as the engine frees them) and compare with the dense reference."""
    kv = _paged_kv([p + n for p, n in case.chunks], case.kv_heads, case.head_dim,
                   case.block_size, case.dtype, gen)
    if case.window:
        _drop_out_of_window(kv, [p for p, _ in case.chunks], case.window)
    starts = [0]
    for _, n in case.chunks:
        starts.append(starts[-1] + n)
    q = _strided_q(starts[-1], case.q_heads, case.kv_heads, case.head_dim, case.dtype, gen)
    out = torch.full(q.shape, float("nan"), dtype=case.dtype, device=DEVICE)
    query_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, query_starts,
                                  kv.seq_lens, max(n for _, n in case.chunks), case.block_size,
                                  scale, out=out, window=case.window, num_splits=num_splits)
    assert got is out
    ref = torch.cat([_reference(q[starts[i]:starts[i + 1]], kv, i, scale, case.window)
                     for i in range(len(case.chunks))])
    _assert_close(out, ref, case.dtype)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,dtype", PREFILL_CASES)
def test_prefill_matches_reference(q_heads, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(hash((q_heads, kv_heads, head_dim, block_size)) % 2**31)
    # (cached prefix, new tokens): none, partial block, several blocks, a single new token;
    # prefix 14 puts a query tile one key short of a key-tile edge.
    chunks = [(0, 37), (5, 1), (40, 70), (100, 16), (0, 1), (33, 20), (14, 40)]
    _check_prefill(PrefillCase(chunks, q_heads, kv_heads, head_dim, block_size, dtype), gen,
                   head_dim ** -0.5)


# (num_splits, block_size, dtype): more splits than a short sequence has key tiles (empty
# splits), 32-key blocks whose tiles arrive whole, bfloat16.
SPLIT_PREFILL_CASES = [(2, 16, torch.float32), (4, 32, torch.float32), (8, 16, torch.float32),
                       (4, 16, torch.bfloat16)]


@pytest.mark.parametrize("num_splits,block_size,dtype", SPLIT_PREFILL_CASES)
def test_prefill_split_keys_match_reference(num_splits, block_size, dtype):
    """Split-K prefill: a few new tokens over long prefixes (a prefix-cache hit's last chunk),
    chunks whose early query tiles see fewer key tiles than there are splits, a fresh prompt."""
    gen = torch.Generator().manual_seed(num_splits * 31 + block_size)
    chunks = [(300, 20), (0, 37), (250, 1), (5, 60), (130, 33)]
    _check_prefill(PrefillCase(chunks, 8, 2, 32, block_size, dtype), gen, 0.2, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_of_a_step_s_later_sequences(num_splits):
    """Sequences 2.. of a step on slices of its q and out (query_starts[0] is the slice's first
    row): rows before the slice are left alone."""
    gen = torch.Generator().manual_seed(7 + num_splits)
    chunks = [(40, 1), (90, 1), (200, 17), (0, 30)]
    kv = _paged_kv([p + n for p, n in chunks], 2, 32, 16, torch.float32, gen)
    starts = [0, 1, 2, 19, 49]
    q = _strided_q(starts[-1], 4, 2, 32, torch.float32, gen)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    query_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    paged_prefill_attention(q[2:], kv.k_cache, kv.v_cache, kv.block_tables[2:],
                            query_starts[2:], kv.seq_lens[2:], 30, 16, 0.2, out=out[2:],
                            num_splits=num_splits)
    assert out[:2].isnan().all()
    ref = torch.cat([_reference(q[starts[i]:starts[i + 1]], kv, i, 0.2) for i in (2, 3)])
    _assert_close(out[2:], ref, torch.float32)


@pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (64, 8), (8, 8), (4, 1)])
def test_warm_up_contexts_meet_every_split_count(monkeypatch, q_heads, kv_heads):
    """Every split count a step can choose (any sequences, chunk sizes and context lengths)
    is one the start-up's mixed steps choose: none compiles on a request's path."""
    from deepinfer.backends.cuda.dummy_batches import SMALL_CHUNKS, split_warmup_contexts

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's tiles and split sizes
    sms, max_len = 132, 131072
    lengths = range(1, max_len + 1, 61)
    prefill = {choose_prefill_splits(seqs, q_heads, tokens, n, sms) for n in lengths
               for seqs in (1, 2, 3, 8) for tokens in (1, 16, 128, 129, 512)}
    decode = {choose_num_splits(seqs, kv_heads, n, sms) for n in lengths
              for seqs in (1, 2, 3, 5, 9, 17, 33, 64)}
    contexts = split_warmup_contexts(max_len)
    assert prefill <= {choose_prefill_splits(1, q_heads, SMALL_CHUNKS, n, sms) for n in contexts}
    assert decode <= {choose_num_splits(1, kv_heads, n, sms) for n in contexts}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_sdpa_equals_the_paged_kernel(dtype):
    """A fresh prompt's attention through SDPA (K/V gathered back from the paged cache, GQA)
    equals the paged kernel's; on a GPU with the default backends (cuDNN, then flash)."""
    from deepinfer.backends.cuda.ops import CUDAOps, sdpa_backends

    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("cuDNN and flash take 16-bit inputs; float32 stays on the paged kernel")
    gen = torch.Generator().manual_seed(11)
    n, block_size = 200, 16
    kv = _paged_kv([n], 2, 64, block_size, dtype, gen)
    q = _strided_q(n, 8, 2, 64, dtype, gen)
    starts = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    table = kv.block_tables[0].long()
    positions = torch.arange(n, device=DEVICE)
    slots = table[positions // block_size] * block_size + positions % block_size
    ops = CUDAOps(cache=None)
    assert ops.sdpa_backends == sdpa_backends("") and sdpa_backends("0") == ()
    with pytest.raises(ValueError, match="no SDPA backend 'FLASH'"):
        sdpa_backends("cudnn_attention,flash")
    got = ops._sdpa_prefill(q, kv.k_cache, kv.v_cache, slots, 0.125)
    assert got.is_contiguous() and got.shape == q.shape
    ref = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, starts,
                                  kv.seq_lens, n, block_size, 0.125)
    _assert_close(got, ref.double().cpu(), dtype)


def test_choose_prefill_splits(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's tiles and split sizes
    # A 128-token chunk over 32K keys: 32 programs on 132 SMs -> 16 splits of 2K keys.
    assert choose_prefill_splits(1, 32, 128, 32768, 132) == 16
    assert choose_prefill_splits(1, 32, 8192, 8192, 132) == 1  # 2,048 programs fill the GPU
    assert choose_prefill_splits(1, 32, 128, 600, 132) == 1  # too few keys to split
    assert choose_prefill_splits(2, 32, 128, 4096, 132) == 4  # bounded by the keys
    with pytest.raises(ValueError, match="window"):
        cache = torch.empty(64, 2, 32, device="meta")
        lens = torch.empty(1, dtype=torch.int32, device="meta")
        paged_prefill_attention(torch.empty(3, 4, 32, device="meta"), cache, cache,
                                torch.empty(1, 4, dtype=torch.int32, device="meta"),
                                torch.empty(2, dtype=torch.int32, device="meta"), lens, 3, 16,
                                0.1, window=8, num_splits=2)


# (block_size, window, dtype): 16-key blocks are gathered, 32-key ones (the interpreted tile)
# arrive whole, as bulk copies do on the GPU.
WINDOW_PREFILL_CASES = [
    (16, 1, torch.float32),
    (16, 5, torch.float32),
    (32, 16, torch.float32),
    (16, 16, torch.float32),
    (32, 45, torch.float32),
    (16, 45, torch.bfloat16),
    (32, 1000, torch.float32),
]


@pytest.mark.parametrize("block_size,window,dtype", WINDOW_PREFILL_CASES)
def test_prefill_sliding_window(block_size, window, dtype):
    gen = torch.Generator().manual_seed(window * 7 + block_size)
    # (cached prefix, new tokens): a fresh prompt, chunks after a prefix longer and shorter
    # than the window, one new token, query tiles that start mid key tile.
    chunks = [(0, 70), (5, 1), (40, 70), (100, 16), (33, 20), (14, 40), (90, 3)]
    _check_prefill(PrefillCase(chunks, block_size=block_size, dtype=dtype, window=window), gen,
                   0.2)


def test_window_must_be_a_non_negative_int():
    cache = torch.empty(64, 2, 32, device="meta")
    tables = torch.empty(2, 4, dtype=torch.int32, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    q = torch.empty(2, 4, 32, device="meta")
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, cache, cache, tables, lens, 16, 0.1, 1, window=-1)
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention(q, cache, cache, tables, lens, lens, 1, 16, 0.1, window=-4)


def test_choose_num_splits():
    for batch, heads, length in [(1, 8, 32768), (1, 8, 100), (4, 8, 4096), (64, 8, 2048),
                                 (256, 8, 640), (1, 1, 1)]:
        n = choose_num_splits(batch, heads, length)
        assert 1 <= n <= 32 and n & (n - 1) == 0
    assert choose_num_splits(1, 8, 32768) >= 16
    assert choose_num_splits(64, 8, 2048) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 100) == 1  # too short to be worth a merge


class _Recorder:
    """Stands in for a jitted kernel: records the grid instead of launching."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


def test_launchers_never_read_tensor_values(monkeypatch):
    """Launch on 'meta' tensors, which have no values: any host read would raise, and the
    grids may depend on shapes and num_splits only (a must for CUDA graph capture)."""
    split, merge, prefill = _Recorder(), _Recorder(), _Recorder()
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", split)
    monkeypatch.setattr(decode_attention, "_decode_merge_kernel", merge)
    monkeypatch.setattr(prefill_attention, "_prefill_kernel", prefill)
    meta = dict(device="meta")
    cache = torch.empty(64 * 16, 2, 32, **meta)
    tables = torch.empty(5, 4, dtype=torch.int32, **meta)
    lens = torch.empty(5, dtype=torch.int32, **meta)
    q = torch.empty(5, 8, 32, **meta)
    for window in (0, 64):
        paged_decode_attention(q, cache, cache, tables, lens, 16, 0.1, 8, window=window)
    merge_programs = math.ceil(8 / decode_attention.merge_heads_per_program(8, 8, 32))
    assert split.grids == [(5, 2, 8)] * 2 and merge.grids == [(5, merge_programs)] * 2
    q = torch.empty(40, 8, 32, **meta)
    starts = torch.empty(6, dtype=torch.int32, **meta)
    block_m = prefill_attention._config(32, torch.float32).block_m
    for block_size in (16, 256):  # tiles gathered by slot, and (where supported) bulk copies
        for window in (0, 64):
            paged_prefill_attention(q, cache, cache, tables, starts, lens, 20, block_size, 0.1,
                                    window=window)
    assert prefill.grids == [(8, 5, math.ceil(20 / block_m))] * 4
