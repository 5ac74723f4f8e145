"""DeepSeek-V4 decode attention: one query per sequence over its sliding window of K=V vectors
plus the compressed entries it sees, with a sink logit per head.

Every head attends the same keys (one shared K=V head, MQA), so a program serves BLOCK_H heads
of one sequence as the rows of one matrix and reads each key tile once for all of them, as the
MLA decode does. A program walks its split of two key lists with one fp32 online softmax:

- the window: keys [seq_len - window, seq_len) of the window pages, gathered through the
  window group's block table in BLOCK_N-token tiles; tiles before the window are never loaded
  (their pages may be freed, block 0);
- the entries: CSA's indexer picks (entry numbers, -1 none) or, with no picks (HCA), every
  entry w < seq_len // rate; entry w is row table[w*rate // bs] * (bs // rate) +
  (w*rate % bs) // rate of the entry tensor (models/deepseek_v4/paged_ops.PagedRows).

Keys are the values. The sink joins the softmax's denominator only: with one split the program
adds it itself; with several, the merge adds it once (base-2 log-sum-exp of each split).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda.kernels.decode_attention import (
    choose_num_splits,
    split_tiles,
    tile_slots,
)
from deepinfer.backends.cuda.settings import interpreted

_LOG2E = 1.0 / math.log(2.0)
_MIN_DOT = 16  # tl.dot needs every dimension >= 16: head rows are padded up to it
# Heads per program: at head_dim 512, 32 rows of query and fp32 accumulator fit in 8 warps'
# registers (the MLA decode's measurement at its 512-wide latent).
_MAX_BLOCK_H = 32


@triton.jit
def _online(acc, l_i, m_i, q, k, valid, qk_scale, PRECISION: tl.constexpr):
    """One key tile k [BLOCK_N, D] (the values too) into the running base-2 softmax."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf: shift by 0 instead (p and alpha are 0).
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - shift[:, None])
    alpha = tl.math.exp2(m_i - shift)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _entry_rows(Tables, ids, valid, BLOCK_SIZE: tl.constexpr, RATE: tl.constexpr):
    """Rows of entries `ids` in the paged entry tensor (the first source token's slot / rate)."""
    first = tl.where(valid, ids, 0).to(tl.int64) * RATE
    block = tl.load(Tables + first // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * (BLOCK_SIZE // RATE) + (first % BLOCK_SIZE) // RATE


@triton.jit
def _compressed_decode_kernel(
    Q, Win, WinTables, Ent, EntTables, Picks, SeqLens, Sinks, Out, Lse,
    stride_qb, stride_qh, stride_wt, stride_wb, stride_et, stride_eb, stride_pb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale, window,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, RATE: tl.constexpr, NUM_PICKS: tl.constexpr,
    ENTRIES: tl.constexpr, PICKED: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    tile_lo, tile_hi, key_lo = split_tiles(seq_len, tl.cdiv(seq_len, BLOCK_N), split, window,
                                           BLOCK_N, NUM_SPLITS, True)
    table = WinTables + b.to(tl.int64) * stride_wb
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (offs_n < seq_len) & (offs_n >= key_lo)
        slots = tile_slots(table, tile * BLOCK_N, offs_n, valid, BLOCK_N, BLOCK_SIZE)
        k = tl.load(Win + slots[:, None] * stride_wt + offs_d[None, :], mask=valid[:, None],
                    other=0.0)
        acc, l_i, m_i = _online(acc, l_i, m_i, q, k, valid, qk_scale, PRECISION)

    if ENTRIES:
        count = seq_len // RATE
        if PICKED:
            count = seq_len * 0 + NUM_PICKS  # a runtime int, as the other branch's
        per_split = tl.cdiv(tl.cdiv(count, BLOCK_N), NUM_SPLITS)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, tl.cdiv(count, BLOCK_N))
        ent_table = EntTables + b.to(tl.int64) * stride_eb
        for tile in range(lo, hi):
            idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ids = idx
            valid = idx < count
            if PICKED:
                ids = tl.load(Picks + b * stride_pb + idx, mask=valid, other=-1)
                valid = ids >= 0
            rows = _entry_rows(ent_table, ids, valid, BLOCK_SIZE, RATE)
            k = tl.load(Ent + rows[:, None] * stride_et + offs_d[None, :], mask=valid[:, None],
                        other=0.0)
            acc, l_i, m_i = _online(acc, l_i, m_i, q, k, valid, qk_scale, PRECISION)

    out = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    if NUM_SPLITS == 1:
        sink = tl.load(Sinks + heads, mask=head_ok, other=0.0) * 1.4426950408889634
        m_tot = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_tot)
        denominator = l_i * alpha + tl.math.exp2(sink - m_tot)
        tl.store(out, (acc * (alpha / denominator)[:, None]).to(Out.dtype.element_ty),
                 mask=head_ok[:, None])
    else:
        nonempty = l_i > 0.0
        acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(out, acc, mask=head_ok[:, None])
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _merge_with_sink_kernel(
    Partial, Lse, Sinks, Out, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_ob, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[b, h] = sum_s 2^lse_s o_s / (sum_s 2^lse_s + 2^sink): the splits' softmax, whose
    denominator the sink joins once. Empty splits carry lse = -inf (weight 0)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + splits)
    sink = tl.load(Sinks + h) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, 0), sink)
    weights = tl.math.exp2(lse - m)
    parts = tl.load(Partial + b * stride_pb + h * stride_ph + splits[:, None] * stride_ps
                    + offs_d[None, :])
    out = tl.sum(parts * weights[:, None], 0) / (tl.sum(weights, 0) + tl.math.exp2(sink - m))
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def _block_n(head_dim: int) -> int:
    """16 under the interpreter, so tests meet several tiles; 32 at V4's head_dim 512 keeps a
    key tile at 32 KiB (bf16)."""
    if interpreted():
        return 16
    return 64 if head_dim <= 128 else 32


def _num_splits(q: torch.Tensor, head_blocks: int, keys: int) -> int:
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    return choose_num_splits(q.shape[0] * head_blocks, 1, keys, sms)


def compressed_decode_attention(q: torch.Tensor, window_kv: torch.Tensor,
                                window_tables: torch.Tensor, entries: torch.Tensor | None,
                                entry_tables: torch.Tensor | None, picks: torch.Tensor | None,
                                seq_lens: torch.Tensor, max_seq_len: int, sinks: torch.Tensor,
                                window: int, rate: int, block_size: int, scale: float,
                                num_splits: int | None = None) -> torch.Tensor:
    """q [B, H, D] (query b at position seq_lens[b] - 1); window_kv [slots, D] with
    window_tables [B, W]; entries [rows, D] with entry_tables [B, W'] (None: a sliding layer);
    picks [B, k] entry numbers (-1 none; None: every entry w < seq_len // rate); seq_lens
    int32 [B]; max_seq_len its largest value (sizes the splits); sinks fp32 [H]; num_splits
    (a power of two) overrides the split-K choice. Returns [B, H, D] in q's dtype."""
    batch, heads, head_dim = q.shape
    _check(q, window_kv, entries, head_dim)
    if picks is not None and picks.shape[1] == 0:  # no entry exists yet
        entries = picks = None
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_h = min(_MAX_BLOCK_H, max(_MIN_DOT, triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    visible = min(window, max_seq_len) + (0 if entries is None else (
        picks.shape[1] if picks is not None else max_seq_len // rate))
    splits = num_splits or _num_splits(q, head_blocks, visible)
    partial, lse = out, out
    if splits > 1:
        partial = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32,
                              device=q.device)
        lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    ent = entries if entries is not None else window_kv
    ent_tables = entry_tables if entry_tables is not None else window_tables
    pick_ids = picks if picks is not None else seq_lens
    _compressed_decode_kernel[(batch, head_blocks, splits)](
        q, window_kv, window_tables, ent, ent_tables, pick_ids, seq_lens, sinks, partial, lse,
        q.stride(0), q.stride(1), window_kv.stride(0), window_tables.stride(0), ent.stride(0),
        ent_tables.stride(0), pick_ids.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2) if splits > 1 else 0,
        lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
        scale * _LOG2E, window,
        HEADS=heads, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_N=_block_n(head_dim),
        BLOCK_SIZE=block_size, RATE=rate, NUM_PICKS=0 if picks is None else picks.shape[1],
        ENTRIES=entries is not None, PICKED=picks is not None, NUM_SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if head_dim > 128 else 4, num_stages=2)
    if splits > 1:
        _merge_with_sink_kernel[(batch, heads)](
            partial, lse, sinks, out, partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=splits, num_warps=4)
    return out


def _check(q: torch.Tensor, window_kv: torch.Tensor, entries: torch.Tensor | None,
           head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    tensors = [window_kv] + ([] if entries is None else [entries])
    if q.stride(-1) != 1 or not all(t.is_contiguous() for t in tensors):
        raise ValueError("q needs a contiguous last dim and the paged tensors must be "
                         "contiguous")
