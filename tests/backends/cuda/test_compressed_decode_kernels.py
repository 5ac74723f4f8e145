"""DeepSeek-V4's decode kernels against the model's own torch code (attention.attend,
compressor.index_scores / select_topk) on dense copies of the same rows.

Each case scatters every sequence's window K=V vectors and compressed entries over shuffled
blocks (never block 0), leaves every other row NaN, and points the window pages that lie wholly
before a query's window at block 0 (as the engine frees them): a read outside what the query
sees shows up as NaN. Lengths cross the window (16) and give entry counts that are no multiple
of the interpreter's 16-row tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from deepinfer.backends.cuda.kernels.compressed_decode import compressed_decode_attention
from deepinfer.backends.cuda.kernels.index_topk import index_scores, indexer_topk
from deepinfer.models.deepseek_v4.attention import attend, entries_visible, selected_visible
from deepinfer.models.deepseek_v4.compressor import index_scores as index_scores_reference
from deepinfer.models.deepseek_v4.compressor import select_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQ_LENS = [3, 21, 50, 77]
BLOCK_SIZE, WINDOW = 32, 16


@dataclass
class Paged:
    cache: torch.Tensor  # [blocks * per_block, D], NaN where no sequence's row is
    tables: torch.Tensor  # int32 [B, max pages]


def _scatter(rows: list[torch.Tensor], per_block: int, gen: torch.Generator) -> Paged:
    """Each sequence's rows [n, D] into its own shuffled blocks, in order."""
    pages = [max(1, math.ceil(r.shape[0] / per_block)) for r in rows]
    num_blocks = 1 + sum(pages)
    cache = torch.full((num_blocks * per_block, rows[0].shape[1]), float("nan"),
                       dtype=rows[0].dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(rows), max(pages), dtype=torch.int32)
    for b, (seq_rows, n_pages) in enumerate(zip(rows, pages)):
        for p in range(n_pages):
            block = free.pop()
            tables[b, p] = block
            chunk = seq_rows[p * per_block:(p + 1) * per_block]
            cache[block * per_block:block * per_block + chunk.shape[0]] = chunk
    return Paged(cache.to(DEVICE), tables.to(DEVICE))


def _free_window_pages(tables: torch.Tensor) -> None:
    """Pages wholly before the window of each sequence's query read as block 0."""
    for b, seq_len in enumerate(SEQ_LENS):
        for p in range(tables.shape[1]):
            if (p + 1) * BLOCK_SIZE <= seq_len - WINDOW:
                tables[b, p] = 0


def _picks(counts: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct visible entries per query (fewer, -1 padded, when it has fewer)."""
    out = torch.full((len(counts), k), -1, dtype=torch.long)
    for b, count in enumerate(counts):
        chosen = torch.randperm(count, generator=gen)[:k]
        out[b, :chosen.numel()] = chosen
    return out


def _reference(q, kv, entries, picks, sinks, rate, scale) -> torch.Tensor:
    out = []
    for b, seq_len in enumerate(SEQ_LENS):
        position = torch.tensor([seq_len - 1])
        start = max(0, seq_len - WINDOW)
        keys = kv[b][start:seq_len].float()
        compressed = visible = None
        if entries is not None:
            compressed = entries[b].float()
            count = compressed.shape[0]
            visible = entries_visible(position, count, rate) if picks is None else \
                selected_visible(picks[b:b + 1], count)
        out.append(attend(q[b:b + 1].float(), position, keys, torch.arange(start, seq_len),
                          compressed, visible, sinks, WINDOW, scale))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,splits", [("sliding", 1), ("hca", 1), ("csa", 1), ("csa", 4),
                                         ("hca", 2)])
def test_compressed_decode_matches_attend(dtype, kind, splits, gpu_bf16_rounding):
    gen = torch.Generator().manual_seed(hash((str(dtype), kind, splits)) % 1000)
    heads, dim, rate = 20, 32, {"sliding": 1, "hca": 8, "csa": 4}[kind]
    kv = [torch.randn(n, dim, generator=gen).to(dtype) for n in SEQ_LENS]
    window = _scatter(kv, BLOCK_SIZE, gen)
    _free_window_pages(window.tables)
    entries = picks = paged = None
    if kind != "sliding":
        entries = [torch.randn(n // rate, dim, generator=gen).to(dtype) for n in SEQ_LENS]
        paged = _scatter([e if e.shape[0] else torch.zeros(1, dim, dtype=dtype)
                          for e in entries], BLOCK_SIZE // rate, gen)
    if kind == "csa":
        picks = _picks([n // rate for n in SEQ_LENS], 8, gen)
    q = torch.randn(len(SEQ_LENS), heads, dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    scale = dim ** -0.5
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    ours = compressed_decode_attention(
        q.to(DEVICE), window.cache, window.tables, None if paged is None else paged.cache,
        None if paged is None else paged.tables, None if picks is None else picks.to(DEVICE),
        lens, max(SEQ_LENS), sinks.to(DEVICE), WINDOW, rate, BLOCK_SIZE, scale,
        num_splits=splits).cpu()
    ref = _reference(q, kv, entries, picks, sinks, rate, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not ours.isnan().any()
    error = (ours.float() - ref).abs().max().item()
    assert error < tol, f"max abs error {error:.2e} (relative {error / ref.abs().max():.2e})"


def _index_case(dtype: torch.dtype, heads: int, gen: torch.Generator):
    dim, rate = 16, 4
    keys = [torch.randn(n // rate, dim, generator=gen).to(dtype) for n in SEQ_LENS]
    paged = _scatter([k if k.shape[0] else torch.zeros(1, dim, dtype=dtype) for k in keys],
                     BLOCK_SIZE // rate, gen)
    q = torch.randn(len(SEQ_LENS), heads, dim, generator=gen).to(dtype)
    weights = torch.randn(len(SEQ_LENS), heads, generator=gen)
    return keys, paged, q, weights, rate, dim ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [16, 6])
def test_index_scores_match_the_indexer(dtype, heads, gpu_bf16_rounding):
    gen = torch.Generator().manual_seed(heads)
    keys, paged, q, weights, rate, scale = _index_case(dtype, heads, gen)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    width = max(SEQ_LENS) // rate
    ours = index_scores(q.to(DEVICE), weights.to(DEVICE), paged.cache, paged.tables, lens,
                        width, rate, BLOCK_SIZE, scale).cpu()
    for b, seq_len in enumerate(SEQ_LENS):
        ref = index_scores_reference(q[b:b + 1], weights[b:b + 1], torch.tensor([seq_len - 1]),
                                     keys[b], rate, scale)[0]
        count = ref.shape[0]
        torch.testing.assert_close(ours[b, :count], ref, rtol=1e-5, atol=1e-5)
        assert (ours[b, count:] == float("-inf")).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk_picks_the_indexers_entries(dtype, gpu_bf16_rounding):
    gen = torch.Generator().manual_seed(7)
    keys, paged, q, weights, rate, scale = _index_case(dtype, 16, gen)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    topk = 8
    ours = indexer_topk(q.to(DEVICE), weights.to(DEVICE), paged.cache, paged.tables, lens,
                        max(SEQ_LENS), rate, BLOCK_SIZE, topk, scale).cpu()
    assert ours.shape == (len(SEQ_LENS), topk)
    for b, seq_len in enumerate(SEQ_LENS):
        ref = select_topk(q[b:b + 1], weights[b:b + 1], torch.tensor([seq_len - 1]), keys[b],
                          rate, topk, scale)[0]
        padded = torch.cat([ref, ref.new_full((topk - ref.numel(),), -1)])
        assert sorted(ours[b].tolist()) == sorted(padded.tolist()), f"sequence {b}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk_without_ranking_where_k_covers_every_entry(dtype, gpu_bf16_rounding):
    """A bound of at most k entries (a short context class of the decode graphs): every entry
    a sequence has is picked, the same set as the indexer's top-k, in entry order."""
    gen = torch.Generator().manual_seed(8)
    keys, paged, q, weights, rate, scale = _index_case(dtype, 16, gen)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    topk = max(SEQ_LENS) // rate
    ours = indexer_topk(q.to(DEVICE), weights.to(DEVICE), paged.cache, paged.tables, lens,
                        max(SEQ_LENS), rate, BLOCK_SIZE, topk, scale).cpu()
    for b, seq_len in enumerate(SEQ_LENS):
        ref = select_topk(q[b:b + 1], weights[b:b + 1], torch.tensor([seq_len - 1]), keys[b],
                          rate, topk, scale)[0]
        count = seq_len // rate
        assert ours[b].tolist() == list(range(count)) + [-1] * (topk - count)
        assert sorted(ref[ref >= 0].tolist()) == list(range(count))
