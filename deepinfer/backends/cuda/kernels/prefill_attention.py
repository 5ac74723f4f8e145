"""Paged prefill attention: new tokens of many sequences packed back to back, causal over each
sequence's cached prefix plus the new tokens, K/V read through the block table.

Flash-attention-2 forward: one program per (query head, sequence, BLOCK_M new tokens), fp32
online softmax in base 2. Key tiles wholly below the tile's first query position run without
any mask; only the few tiles that cross the causal diagonal (or the end of the sequence) pay
for masking, and tiles wholly above it are never visited. Where a key tile lies inside one KV
block (BLOCK_N <= block_size) on Hopper or later, K/V tiles arrive as TMA bulk copies of
consecutive slots (about 15% faster on an H200); otherwise they are gathered slot by slot.

Sliding window (window W > 0): the query at position p sees keys p - W < k <= p only. A query
tile then visits the key tiles from the one holding its first row's first visible key on; the
tiles every row sees whole run unmasked, the few at either edge of the band are masked. Keys
before the tile's band are never loaded: their blocks may be the null block (junk).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.backends.cuda.kernels.decode_attention import (check_layout, check_window,
                                                              tile_slots)

_LOG2E = 1.0 / math.log(2.0)


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tile shapes by head size and dtype: large tiles for the tensor cores on Hopper; small
    ones under the interpreter, where each tile costs host time and tests want many edges."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return PrefillConfig(16, 32, 4, 1)
    if dtype == torch.float32:  # twice the bytes per element: halve the tiles
        return PrefillConfig(64, 32, 4, 2)
    if head_dim <= 128:
        # H200, D=128 bf16, 8K causal with TMA: ~465 TFLOP/s (3 stages ~460, BLOCK_N=128 with
        # 8 warps ~430, 8 warps on these tiles ~355).
        return PrefillConfig(128, 64, 4, 2)
    return PrefillConfig(64, 32, 4, 2)


@triton.jit
def _prefill_kernel(
    Q, K, V, KDesc, VDesc, BlockTables, QueryStarts, SeqLens, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_ot, stride_oh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # keys each query sees, itself included; read only when SLIDING
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, SLIDING: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    # The last query tiles see the most keys: start them first so the grid's tail is short.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(QueryStarts + seq)
    q_len = tl.load(QueryStarts + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    first_pos = seq_len - q_len + m_block * BLOCK_M  # absolute position of the tile's row 0
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    pos = first_pos + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    kv_head = head // GROUP
    kv = (K + kv_head * stride_kh, V + kv_head * stride_vh, KDesc, VDesc, kv_head * HEAD_DIM,
          stride_kt, stride_vt)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys below full_hi are visible to every row of the tile and all lie inside seq_len.
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    if SLIDING:
        # Row 0 sees keys from key_lo on; the last row (at hi - 1) from hi - window on: keys
        # from full_lo to full_hi are seen by every row. Tiles before key_lo's are skipped.
        key_lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.maximum(full_hi, full_lo)
        band = (pos, seq_len, key_lo, window)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, key_lo // BLOCK_N * BLOCK_N,
                                full_lo, qk_scale, offs_d, True, True, BLOCK_N, BLOCK_SIZE,
                                USE_TMA, PRECISION)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, full_lo, full_hi, qk_scale,
                                offs_d, False, True, BLOCK_N, BLOCK_SIZE, USE_TMA, PRECISION)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, full_hi, hi, qk_scale,
                                offs_d, True, True, BLOCK_N, BLOCK_SIZE, USE_TMA, PRECISION)
    else:
        band = (pos, seq_len, 0, 0)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, 0, full_hi, qk_scale,
                                offs_d, False, False, BLOCK_N, BLOCK_SIZE, USE_TMA, PRECISION)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, full_hi, hi, qk_scale,
                                offs_d, True, False, BLOCK_N, BLOCK_SIZE, USE_TMA, PRECISION)
    if SLIDING:  # rows past the last query may see no key at all; they are not stored
        l_i = tl.where(row_ok, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attend(acc, l_i, m_i, q, kv, table, band, lo, hi, qk_scale, offs_d,
            MASKED: tl.constexpr, SLIDING: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi); MASKED applies the causal and length masks, and
    with SLIDING the window's. band: (row positions, seq_len, first key any row sees, window)."""
    k_base, v_base, k_desc, v_desc, col, stride_kt, stride_vt = kv
    pos, seq_len, key_lo, window = band
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < seq_len
        if SLIDING:  # keys no row sees may lie in the null block: keep their junk out
            kv_ok = kv_ok & (offs_n >= key_lo)
        k = _kv_tile(k_base, k_desc, table, start, offs_n, kv_ok, col, stride_kt, offs_d,
                     MASKED, BLOCK_N, BLOCK_SIZE, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            seen = offs_n[None, :] <= pos[:, None]
            if SLIDING:
                seen = seen & (offs_n[None, :] > pos[:, None] - window)
            s = tl.where(seen, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
            if SLIDING:
                # A row may have seen no key yet (its band starts further on): subtract 0
                # rather than -inf, so that exp2 gives 0, not NaN.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s - m_ref[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_ref = m_new
            s = s * qk_scale - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_base, v_desc, table, start, offs_n, kv_ok, col, stride_vt, offs_d,
                     MASKED, BLOCK_N, BLOCK_SIZE, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _kv_tile(base, desc, table, start, offs_n, kv_ok, col, stride_t, offs_d,
             MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             USE_TMA: tl.constexpr):
    """The [BLOCK_N, D] K or V tile of keys start .. start + BLOCK_N - 1.

    Slots past seq_len may hold anything, NaN too: masked tiles zero them, since even a zero
    softmax weight times NaN poisons the sum.
    """
    if USE_TMA:
        # The tile lies inside one block, on consecutive slots: one bulk tensor copy.
        row0 = tl.load(table + start // BLOCK_SIZE) * BLOCK_SIZE + start % BLOCK_SIZE
        tile = desc.load([row0, col])
        if MASKED:
            tile = tl.where(kv_ok[:, None], tile, 0.0)
    else:
        ptrs = base + tile_slots(table, start, offs_n, kv_ok, BLOCK_N, BLOCK_SIZE)[:, None] \
            * stride_t + offs_d[None, :]
        if MASKED:
            tile = tl.load(ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, block_size: int,
                            scale: float, out: torch.Tensor | None = None,
                            window: int = 0) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V.

    q [T, Hq, D] (last dim contiguous); k_cache/v_cache [num_slots, Hk, D] already hold every
    token's K/V, new ones included; block_tables int32 [N, max_blocks]; query_starts int32
    [N + 1] cumulative; seq_lens int32 [N] (cached prefix + new tokens). window > 0 limits each
    query to its last `window` keys (itself included); 0 is plain causal. Returns [T, Hq, D].
    """
    return launch_prefill(q, k_cache, v_cache, block_tables, query_starts, seq_lens,
                          max_query_len, block_size, scale, out, _config(q.shape[-1], q.dtype),
                          window=window)


def launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                   max_query_len: int, block_size: int, scale: float, out: torch.Tensor | None,
                   cfg: PrefillConfig, window: int = 0) -> torch.Tensor:
    """paged_prefill_attention with an explicit tile config (for tuning)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    check_layout(q, k_cache, v_cache, block_tables, q_heads, kv_heads, out)
    check_window(window)
    if out is None:
        out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    use_tma = _tma_ok(k_cache, v_cache, block_size, cfg)
    k_desc, v_desc = k_cache, v_cache  # stand-ins the kernel never reads without TMA
    if use_tma:
        k_desc, v_desc = _descriptor(k_cache, cfg.block_n), _descriptor(v_cache, cfg.block_n)
    grid = (q_heads, num_seqs, triton.cdiv(max_query_len, cfg.block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, query_starts, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * _LOG2E, window,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, USE_TMA=use_tma,
        # Exact fp32 products for fp32 inputs (the default would round them to tf32).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SLIDING=window > 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _tma_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
            cfg: PrefillConfig) -> bool:
    """Bulk tensor copies (Hopper and later) need each key tile inside one block and
    16-byte aligned rows; other cases gather the tile slot by slot."""
    if cfg.block_n > block_size:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if not k_cache.is_cuda or torch.cuda.get_device_capability(k_cache.device)[0] < 9:
        return False
    row_bytes = k_cache.stride(0) * k_cache.element_size()
    return row_bytes % 16 == 0 and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0


def _descriptor(cache: torch.Tensor, block_n: int) -> TensorDescriptor:
    """The cache as a 2D [num_slots, kv_heads * D] tensor, read in [block_n, D] boxes."""
    slots, kv_heads, head_dim = cache.shape
    flat = cache.view(slots, kv_heads * head_dim)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_n, head_dim])
