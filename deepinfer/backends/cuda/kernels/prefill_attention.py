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

Split-K (num_splits > 1, full attention only): a few new tokens over a long cached prefix (a
prefix-cache hit's last chunk: 128 tokens over 32K) make a grid of one program per query head,
too few for the GPU's SMs, each walking the whole context. Then every query tile's keys are cut
into num_splits runs, one program each, which leave a partial output and its log-sum-exp; the
decode kernel's merge combines them (choose_prefill_splits says when).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.backends.cuda.kernels.decode_attention import (
    check_layout,
    check_window,
    merge_splits,
    tile_slots,
)
from deepinfer.backends.cuda.kernels.online_softmax import softmax_tile
from deepinfer.backends.cuda.settings import interpreted

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_MAX_SPLITS = 32


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tile shapes by head size and dtype: large tiles for the tensor cores on Hopper; small
    ones under the interpreter, where each tile costs host time and tests want many edges."""
    if interpreted():
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
    Q, K, V, KDesc, VDesc, BlockTables, QueryStarts, SeqLens, Out, Lse,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # keys each query sees, itself included; read only when SLIDING
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, SLIDING: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2) % NUM_SPLITS
    # The last query tiles see the most keys: start them first so the grid's tail is short.
    m_block = tl.num_programs(2) // NUM_SPLITS - 1 - tl.program_id(2) // NUM_SPLITS
    # Rows count from query_starts[0]: q and out may start mid-step (a step's later sequences).
    q_start = tl.load(QueryStarts + seq) - tl.load(QueryStarts)
    q_len = tl.load(QueryStarts + seq + 1) - tl.load(QueryStarts + seq)
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
                                full_lo, qk_scale, offs_d, True, True, True, BLOCK_N,
                                BLOCK_SIZE, USE_TMA, PRECISION)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, full_lo, full_hi, qk_scale,
                                offs_d, False, True, True, BLOCK_N, BLOCK_SIZE, USE_TMA,
                                PRECISION)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, full_hi, hi, qk_scale,
                                offs_d, True, True, True, BLOCK_N, BLOCK_SIZE, USE_TMA,
                                PRECISION)
    else:
        lo = 0
        if NUM_SPLITS > 1:  # this split's run of the tile's key tiles (may be empty)
            per = tl.cdiv(tl.cdiv(hi, BLOCK_N), NUM_SPLITS) * BLOCK_N
            lo = split * per
            hi = tl.minimum(lo + per, hi)
        band = (pos, seq_len, 0, 0)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, lo,
                                tl.minimum(full_hi, hi), qk_scale, offs_d, False, False, False,
                                BLOCK_N, BLOCK_SIZE, USE_TMA, PRECISION)
        # A split past a row's own position leaves that row without a key: the -inf-safe path.
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kv, table, band, tl.maximum(full_hi, lo), hi,
                                qk_scale, offs_d, True, False, NUM_SPLITS > 1, BLOCK_N,
                                BLOCK_SIZE, USE_TMA, PRECISION)
    if SLIDING or NUM_SPLITS > 1:  # a row may have seen no key (or be past the last query)
        seen = l_i > 0.0
        l_i = tl.where(seen, l_i, 1.0)
    acc = acc / l_i[:, None]
    out = Out + rows[:, None] * stride_ot + head * stride_oh + split * stride_os
    tl.store(out + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if NUM_SPLITS > 1:
        lse = tl.where(seen, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + rows * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _attend(acc, l_i, m_i, q, kv, table, band, lo, hi, qk_scale, offs_d,
            MASKED: tl.constexpr, SLIDING: tl.constexpr, EMPTY_ROWS: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_TMA: tl.constexpr,
            PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi); MASKED applies the causal and length masks, and
    with SLIDING the window's. EMPTY_ROWS: a row may have seen no key yet. band: (row
    positions, seq_len, first key any row sees, window)."""
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
        seen = offs_n[None, :] <= pos[:, None]
        if SLIDING:
            seen = seen & (offs_n[None, :] > pos[:, None] - window)
        # EMPTY_ROWS: a row may have seen no key yet (its band or split starts further on).
        p, alpha, m_i, l_i = softmax_tile(s, seen, m_i, l_i, qk_scale, MASKED, EMPTY_ROWS)
        v = _kv_tile(v_base, v_desc, table, start, offs_n, kv_ok, col, stride_vt, offs_d,
                     MASKED, BLOCK_N, BLOCK_SIZE, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
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


def choose_prefill_splits(num_seqs: int, q_heads: int, max_query_len: int, max_seq_len: int,
                          num_sms: int, head_dim: int = 128,
                          dtype: torch.dtype = torch.bfloat16) -> int:
    """Key splits that give a prefill step about two programs per SM: a power of two <= 32, 1
    when its query tiles already fill the GPU or its contexts are short (a split of fewer
    keys than min_keys_per_split() costs more in its merge than it gains)."""
    programs = q_heads * num_seqs * triton.cdiv(max(max_query_len, 1),
                                                _config(head_dim, dtype).block_m)
    if programs >= num_sms:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    by_length = max(1, max_seq_len // min_keys_per_split())
    by_length = 1 << (by_length.bit_length() - 1)  # round down to a power of two
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def min_keys_per_split() -> int:
    """1K keys: a 128-token chunk over 32K keys runs 16 splits, 0.19 ms a layer on the H200
    against 0.91 unsplit. Under the interpreter, one tile, so that small tests split."""
    return 32 if interpreted() else 1024


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, block_size: int,
                            scale: float, out: torch.Tensor | None = None,
                            window: int = 0, num_splits: int = 1) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V.

    q [T, Hq, D] (last dim contiguous); k_cache/v_cache [num_slots, Hk, D] already hold every
    token's K/V, new ones included; block_tables int32 [N, max_blocks]; query_starts int32
    [N + 1] cumulative, row query_starts[0] being q's and out's row 0 (so a step's later
    sequences run on slices of its q and out); seq_lens int32 [N] (cached prefix + new
    tokens). window > 0 limits each query to its last `window` keys (itself included); 0 is
    plain causal. num_splits > 1 (a power of two, full attention only) cuts each query tile's
    keys into that many programs and merges them. Returns [T, Hq, D].
    """
    return launch_prefill(q, k_cache, v_cache, block_tables, query_starts, seq_lens,
                          max_query_len, block_size, scale, out, _config(q.shape[-1], q.dtype),
                          window=window, num_splits=num_splits)


def launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                   max_query_len: int, block_size: int, scale: float, out: torch.Tensor | None,
                   cfg: PrefillConfig, window: int = 0, num_splits: int = 1) -> torch.Tensor:
    """paged_prefill_attention with an explicit tile config (for tuning)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    check_layout(q, k_cache, v_cache, block_tables, q_heads, kv_heads, out)
    check_window(window)
    _check_splits(num_splits, window)
    if out is None:
        out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    use_tma = _tma_ok(k_cache, v_cache, block_size, cfg)
    k_desc, v_desc = k_cache, v_cache  # stand-ins the kernel never reads without TMA
    if use_tma:
        k_desc, v_desc = _descriptor(k_cache, cfg.block_n), _descriptor(v_cache, cfg.block_n)
    target, lse, split_stride, lse_strides = out, out, 0, (0, 0)
    if num_splits > 1:
        target = torch.empty((tokens, q_heads, num_splits, head_dim), dtype=torch.float32,
                             device=q.device)
        lse = torch.empty((tokens, q_heads, num_splits), dtype=torch.float32, device=q.device)
        split_stride, lse_strides = target.stride(2), (lse.stride(0), lse.stride(1))
    grid = (q_heads, num_seqs, triton.cdiv(max_query_len, cfg.block_m) * num_splits)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, query_starts, seq_lens, target, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        target.stride(0), target.stride(1), split_stride, *lse_strides, scale * _LOG2E, window,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, USE_TMA=use_tma,
        # Exact fp32 products for fp32 inputs (the default would round them to tf32).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SLIDING=window > 0, NUM_SPLITS=num_splits, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        merge_splits(target, lse, out)
    return out


def _check_splits(num_splits: int, window: int) -> None:
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_splits > 1 and window:
        raise ValueError("split-K prefill covers full attention only (window must be 0)")


def _tma_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
            cfg: PrefillConfig) -> bool:
    """Bulk tensor copies (Hopper and later) need each key tile inside one block and
    16-byte aligned rows; other cases gather the tile slot by slot."""
    if cfg.block_n > block_size:
        return False
    if interpreted():
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
