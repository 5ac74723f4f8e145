"""Paged decode attention: one new query token per sequence, split-K over the cached context.

Stage 1 runs one program per (sequence, KV head, split). It serves all G query heads that
share the KV head as the rows of one small matrix, so every K/V tile is read from memory once
per KV head instead of once per query head. Each split walks a contiguous run of BLOCK_N-token
tiles, gathered through the block table, with an fp32 online softmax, and leaves a partial
output and its log-sum-exp. Stage 2 merges the splits of each (sequence, query head).

Sliding window (window W > 0): the query at position p sees keys p - W < k <= p only. The
splits share out the window's tiles alone, so a long windowed sequence costs what its window
costs, and tiles wholly before the window are never loaded: their table entries may point at
the null block (block 0, junk), since the engine frees blocks that fall out of the window.

The launch is CUDA-graph safe: grid sizes and constexprs depend on shapes, num_splits and
whether a window is set; how the context is cut into splits is computed inside the kernel from
seq_lens.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.kernels.tiles import rows_per_program
from deepinfer.backends.cuda.settings import interpreted

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
# Query rows per program: tl.dot needs at least 16, padded rows are masked out.
_MIN_ROWS = 16
_MAX_SPLITS = 32
# A split shorter than this spends more on its merge than it saves in parallelism (H200: a
# 1K context ran fastest in 8 splits).
_MIN_TOKENS_PER_SPLIT = 128


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      programs_per_sm: int = 2,
                      min_tokens_per_split: int = _MIN_TOKENS_PER_SPLIT) -> int:
    """How many splits fill the GPU: about programs_per_sm programs per SM, a power of two
    <= 32.

    1 when batch * kv_heads programs already occupy every SM; fewer splits for short contexts.
    With a sliding window, max_seq_len is the window's length (the splits share out only it).
    """
    programs = max(1, batch * kv_heads)
    if programs >= num_sms:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(programs_per_sm * num_sms, programs))
    by_length = max(1, max_seq_len // min_tokens_per_split)
    by_length = 1 << (by_length.bit_length() - 1)  # round down to a power of two
    return max(1, min(wanted, by_length, _MAX_SPLITS))


@triton.jit
def _decode_split_kernel(
    Q, K, V, BlockTables, SeqLens, Out, Lse,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # keys the query sees, itself included; read only when SLIDING
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tile_lo, tile_hi, key_lo = split_tiles(seq_len, num_tiles, split, window, BLOCK_N,
                                           NUM_SPLITS, SLIDING)

    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    table = BlockTables + b.to(tl.int64) * stride_bt
    acc, lse = attend_tiles(q, table, K + kv_head * stride_kh, V + kv_head * stride_vh,
                            stride_kt, stride_vt, seq_len, key_lo, tile_lo, tile_hi, offs_d,
                            qk_scale, ROWS, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PRECISION, SLIDING)
    out = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if NUM_SPLITS > 1:
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def attend_tiles(q, table, k_base, v_base, stride_kt, stride_vt, seq_len, key_lo, tile_lo,
                 tile_hi, offs_d, qk_scale, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                 SLIDING: tl.constexpr):
    """The query rows q [ROWS, HEAD_DIM] over tiles [tile_lo, tile_hi) of one KV head's paged
    keys, fp32 online softmax in base 2: (normalised output, natural-log LSE per row). An empty
    split (tile_lo >= tile_hi) gives zeros and lse = -inf."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = offs_n < seq_len
        if SLIDING:  # keys before the window may sit in the null block: never load them
            valid = valid & (offs_n >= key_lo)
        slots = tile_slots(table, tile * BLOCK_N, offs_n, valid, BLOCK_N, BLOCK_SIZE)
        k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    nonempty = l_i > 0.0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    return acc, lse


@triton.jit
def split_tiles(seq_len, num_tiles, split, window, BLOCK_N: tl.constexpr,
                NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr):
    """This split's tiles [tile_lo, tile_hi) and the first key the query sees (key_lo).

    The splits cut up the tiles from the window's first one on, so split 0 always holds the
    tile of key_lo, a visible key (the merge relies on split 0 being non-empty).
    """
    first_tile = 0
    key_lo = 0
    if SLIDING:
        key_lo = tl.maximum(seq_len - window, 0)
        first_tile = key_lo // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    return tile_lo, tile_hi, key_lo


@triton.jit
def tile_slots(table, start, offs_n, valid, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache slots of the tile's tokens, as int64 row indices into k_cache / v_cache."""
    if BLOCK_N <= BLOCK_SIZE:
        # The tile sits inside one KV block: one table lookup, then consecutive slots.
        block = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
        return block * BLOCK_SIZE + start % BLOCK_SIZE + tl.arange(0, BLOCK_N)
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * BLOCK_SIZE + (offs_n % BLOCK_SIZE)


@triton.jit
def _decode_merge_kernel(
    PartialOut, Lse, Out, heads,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]  # [BLOCK_H, 1]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    h3, d3 = h[:, :, None], offs_d[:, None, :]
    splits = tl.arange(0, NUM_SPLITS)[None, :]
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + splits, mask=h < heads, other=0.0)
    # Split 0 always holds the first tile (seq_len >= 1), so the max is finite.
    weights = tl.exp(lse - tl.max(lse, 1, keep_dims=True))
    parts = tl.load(PartialOut + b * stride_pb + h3 * stride_ph + splits[:, :, None] * stride_ps
                    + d3, mask=h3 < heads, other=0.0)
    out = tl.sum(parts * weights[:, :, None], 1) / tl.sum(weights, 1, keep_dims=True)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=h < heads)


class DecodeConfig(NamedTuple):
    block_n: int  # tokens per tile
    num_warps: int
    num_stages: int


def _config(head_dim: int) -> DecodeConfig:
    """64-token tiles keep enough bytes in flight on the GPU without spilling at D=128.
    32 under the interpreter, so that tests meet tiles both inside one block and across blocks.
    """
    if interpreted():
        return DecodeConfig(32, 4, 1)
    return DecodeConfig(64 if head_dim <= 128 else 32, 4, 3)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, num_splits: int, out: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q [B, Hq, D] (last dim contiguous), k_cache/v_cache [num_slots, Hk, D], block_tables int32
    [B, max_blocks], seq_lens int32 [B] (>= 1). window > 0 limits the query to its last
    `window` keys (itself included); 0 attends to the whole context. Returns out [B, Hq, D] in
    q's dtype.
    """
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale,
                         num_splits, out, _config(q.shape[-1]), window=window)


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  scale: float, num_splits: int, out: torch.Tensor | None,
                  cfg: DecodeConfig, window: int = 0) -> torch.Tensor:
    """paged_decode_attention with an explicit tile config (for tuning)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    _check(q, k_cache, v_cache, block_tables, num_splits, q_heads, kv_heads, out)
    check_window(window)
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits == 1:  # no merge: stage 1 normalises and writes out directly
        partial, lse = out, out
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        partial = torch.empty((batch, q_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        lse = torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        *part_strides, *lse_strides, scale * _LOG2E, window,
        GROUP=group, ROWS=max(_MIN_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        # Exact fp32 products for fp32 inputs (the default would round them to tf32).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SLIDING=window > 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(q.device),
    )
    if num_splits > 1:
        merge_splits(partial, lse, out)
    return out


def merge_heads_per_program(heads: int, num_splits: int, head_dim: int) -> int:
    return rows_per_program(heads, num_splits * head_dim)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h] = the LSE-weighted mean of partial[b, h, :] (fp32 [B, H, S, D], lse [B, H, S],
    S a power of two, split 0 never empty); shared with the MLA decode."""
    batch, heads, num_splits, head_dim = partial.shape
    block_h = merge_heads_per_program(heads, num_splits, head_dim)
    _decode_merge_kernel[(batch, triton.cdiv(heads, block_h))](
        partial, lse, out, heads, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits, BLOCK_H=block_h, num_warps=1, **launch_kwargs(out.device),
    )


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, num_splits: int, q_heads: int, kv_heads: int,
           out: torch.Tensor | None) -> None:
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    check_layout(q, k_cache, v_cache, block_tables, q_heads, kv_heads, out)


def check_window(window: int) -> None:
    """window is a launch-time int (a Python value, never a tensor: no sync)."""
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no window), got {window!r}")


def check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, q_heads: int, kv_heads: int,
                 out: torch.Tensor | None) -> None:
    """Shape and layout checks of both attention launchers. Nothing here may read tensor
    values: that would sync with the device and break graph capture."""
    head_dim = q.shape[-1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q needs a contiguous last dim and the caches must be contiguous")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError("out must have q's shape and a contiguous last dim")
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")
