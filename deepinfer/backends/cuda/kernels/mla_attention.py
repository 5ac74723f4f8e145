"""Paged MLA attention: DeepSeek-V2/V3 multi-head latent attention in the weight-absorbed form.

An MLA layer caches one row per token, latent_cache [num_slots, L + R]: the compressed KV
c_t (kv_lora_rank L values) followed by the shared rotary key k_pe_t (qk_rope_head_dim R
values). With W_UK absorbed into the query and W_UV applied after attention, every query head
attends one shared latent "KV head":

    score(h, t) = scale * (q[h, :L] . c_t + q[h, L:] . k_pe_t),    value(t) = c_t,

and the output is [.., H, L]. L + R (576 in DeepSeek) is no power of two, so every dot product
is cut into its L part and its R part (R padded to 16 lanes for the tensor cores).

- paged_mla_decode: one query per sequence. A program serves up to 32 heads of one sequence as
  the rows of one matrix, so each latent tile is read once for all of them: a token costs
  (L + R) * elem bytes, not that per head, which is the point of MLA. Split-K over the context,
  merged by LSE as in decode_attention.
- paged_mla_prefill: new tokens packed back to back, causal over the cached prefix and
  themselves, one program per (head, sequence, BLOCK_M tokens).
- store_latent: rows into their slots; slot -1 (padding of a CUDA-graph batch) writes nothing.

Launches are CUDA-graph safe: grids and constexprs depend on shapes and num_splits only.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    merge_splits,
    split_tiles,
    tile_slots,
)
from deepinfer.backends.cuda.kernels.online_softmax import softmax_tile
from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.backends.cuda.kernels.prefill_attention import PrefillConfig
from deepinfer.backends.cuda.settings import interpreted

_LOG2E = 1.0 / math.log(2.0)
# tl.dot needs every dimension >= 16: head rows and the rotary part are padded up to it.
_MIN_DOT = 16
# Heads per decode program: at L = 512 64 rows of query and fp32 accumulator spill a little in
# 8 warps, but each key tile then serves twice the heads of 32, which wins at 128 heads
# (bench_mla_decode.py --sweep; docs/benchmarks.md). Fewer heads take one program.
_MAX_BLOCK_H = 64


@triton.jit
def _mla_decode_split_kernel(
    Q, QR, Cache, BlockTables, SeqLens, Out, Lse,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_ct, stride_bt, stride_ob, stride_oh,
    stride_os,
    stride_lb, stride_lh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    seq_len = tl.load(SeqLens + b)
    tile_lo, tile_hi, _ = split_tiles(seq_len, tl.cdiv(seq_len, BLOCK_N), split, 0, BLOCK_N,
                                      NUM_SPLITS, False)
    q_l, q_r = _load_q(Q + b * stride_qb + heads * stride_qh,
                       QR + b * stride_rb + heads * stride_rh, head_ok, LORA, ROPE, BLOCK_R)
    # Every head's query sits at the sequence's last position: the causal mask is the length.
    pos = tl.full([BLOCK_H], 0, tl.int32) + seq_len - 1
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA], tl.float32)
    table = BlockTables + b.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_latent(
        acc, l_i, m_i, q_l, q_r, Cache, stride_ct, table, pos, seq_len, tile_lo * BLOCK_N,
        tile_hi * BLOCK_N, qk_scale, True, LORA, ROPE, BLOCK_R, BLOCK_N, BLOCK_SIZE, PRECISION)

    # An empty split (tile_lo >= tile_hi) leaves l_i == 0: write zeros and lse = -inf.
    nonempty = l_i > 0.0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    offs_l = tl.arange(0, LORA)
    out = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_l[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=head_ok[:, None])
    if NUM_SPLITS > 1:
        lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0)))
                       * 0.6931471805599453, float("-inf"))
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _mla_prefill_kernel(
    Q, QR, Cache, BlockTables, QueryStarts, SeqLens, Out,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_ct, stride_bt, stride_ot, stride_oh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
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
    rows = (q_start + offs_m).to(tl.int64)
    q_l, q_r = _load_q(Q + rows * stride_qt + head * stride_qh,
                       QR + rows * stride_rt + head * stride_rh, row_ok, LORA, ROPE, BLOCK_R)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LORA], tl.float32)
    # Keys below full_hi are visible to every row of the tile and all lie inside seq_len.
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    acc, l_i, m_i = _attend_latent(acc, l_i, m_i, q_l, q_r, Cache, stride_ct, table, pos,
                                   seq_len, 0, full_hi, qk_scale, False, LORA, ROPE, BLOCK_R,
                                   BLOCK_N, BLOCK_SIZE, PRECISION)
    acc, l_i, m_i = _attend_latent(acc, l_i, m_i, q_l, q_r, Cache, stride_ct, table, pos,
                                   seq_len, full_hi, hi, qk_scale, True, LORA, ROPE, BLOCK_R,
                                   BLOCK_N, BLOCK_SIZE, PRECISION)
    acc = acc / l_i[:, None]
    offs_l = tl.arange(0, LORA)
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_l[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _load_q(row_ptrs, rope_ptrs, row_ok, LORA: tl.constexpr, ROPE: tl.constexpr,
            BLOCK_R: tl.constexpr):
    """The query rows' latent part [ROWS, L] and rotary part [ROWS, BLOCK_R] (two tensors, or
    two column ranges of one)."""
    offs_l = tl.arange(0, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    q_l = tl.load(row_ptrs[:, None] + offs_l[None, :], mask=row_ok[:, None], other=0.0)
    q_r = tl.load(rope_ptrs[:, None] + offs_r[None, :],
                  mask=row_ok[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    return q_l, q_r


@triton.jit
def _attend_latent(acc, l_i, m_i, q_l, q_r, Cache, stride_ct, table, pos, seq_len, lo, hi,
                   qk_scale, MASKED: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Online softmax of the query rows (at positions pos) over key tiles [lo, hi); MASKED
    applies the causal and length masks. The latent part of each tile serves as keys and as
    values: it is read once."""
    offs_l = tl.arange(0, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r[None, :] < ROPE
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < seq_len
        rows = Cache + tile_slots(table, start, offs_n, kv_ok, BLOCK_N, BLOCK_SIZE)[:, None] \
            * stride_ct
        # Slots past seq_len may hold anything, NaN too: masked tiles zero them, since even a
        # zero softmax weight times NaN poisons the sum.
        if MASKED:
            c = tl.load(rows + offs_l[None, :], mask=kv_ok[:, None], other=0.0)
            k_pe = tl.load(rows + LORA + offs_r[None, :], mask=kv_ok[:, None] & r_ok, other=0.0)
        else:
            c = tl.load(rows + offs_l[None, :])
            k_pe = tl.load(rows + LORA + offs_r[None, :], mask=r_ok, other=0.0)
        s = tl.dot(q_l, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_r, tl.trans(k_pe), s, input_precision=PRECISION)
        seen = offs_n[None, :] <= pos[:, None]
        p, alpha, m_i, l_i = softmax_tile(s, seen, m_i, l_i, qk_scale, MASKED, False)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_i


@triton.jit
def _store_latent_kernel(Latent, Cache, SlotMapping, stride_lt, stride_ct,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # A negative slot zeroes the row's width, masking every column. (Not `& (slot >= 0)`:
    # Triton's interpreter widens a scalar compare to an int tensor, which 3.9 rejects as a mask.)
    mask = cols < tl.where(slot >= 0, WIDTH, 0)
    row = tl.load(Latent + t * stride_lt + cols, mask=mask)
    tl.store(Cache + slot * stride_ct + cols, row.to(Cache.dtype.element_ty), mask=mask)


def choose_mla_num_splits(batch: int, heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits for paged_mla_decode: one program per SM and >= 256 tokens a split. An MLA
    program carries all its heads' work per tile, twice or more a GQA program's, so it wants
    fewer, longer splits (H200, H=16, L=512: B=1 x 4K ran fastest in 16 splits, 32 x 4K in 8,
    128 x 4K in 2)."""
    return choose_num_splits(batch, triton.cdiv(heads, _MAX_BLOCK_H), max_seq_len, num_sms,
                             programs_per_sm=1, min_tokens_per_split=256)


def _interpreted() -> bool:
    return interpreted()


def _decode_config(kv_lora_rank: int) -> DecodeConfig:
    """Tiles of keys per decode program. 8 under the interpreter, so that tests meet tiles
    both inside one block and across blocks."""
    if _interpreted():
        return DecodeConfig(8, 4, 1)
    if kv_lora_rank >= 256:
        # H200, H=16, L=512 bf16: 64-key tiles in 8 warps (198 registers, no spill) were the
        # fastest or within 5% of it from B=1 to B=128 x 4K; 4 warps at 64 keys spill.
        return DecodeConfig(64, 8, 2)
    return DecodeConfig(64, 4, 2)


def _prefill_config(kv_lora_rank: int) -> PrefillConfig:
    """The [BLOCK_M, L] fp32 accumulator lives in registers: fewer rows for wide latents."""
    if _interpreted():
        return PrefillConfig(16, 8, 4, 1)
    if kv_lora_rank >= 256:
        # H200, H=16, L=512, 1 x 4K bf16, absorbed FLOPs: 295 TFLOP/s, though it spills a
        # little; 32-key tiles ran at 200, and 32 rows in 8 warps (no spill) at 100.
        return PrefillConfig(64, 64, 8, 2)
    return PrefillConfig(64, 32, 4, 2)


def paged_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float, num_splits: int,
                     kv_lora_rank: int, out: torch.Tensor | None = None,
                     q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """MLA of one (absorbed) query token per sequence over its paged latent context.

    q [B, H, L + R], or q [B, H, L] and its rotary part q_pe [B, H, R] apart (no copy to join
    them; last dims contiguous), latent_cache [num_slots, L + R], block_tables int32
    [B, max_blocks], seq_lens int32 [B] (>= 1), num_splits a power of two (from
    choose_mla_num_splits). Returns out [B, H, L] in q's dtype.
    """
    return launch_mla_decode(q, latent_cache, block_tables, seq_lens, block_size, scale,
                             num_splits, kv_lora_rank, out, _decode_config(kv_lora_rank), q_pe)


def launch_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, block_size: int, scale: float, num_splits: int,
                      kv_lora_rank: int, out: torch.Tensor | None, cfg: DecodeConfig,
                      q_pe: torch.Tensor | None = None,
                      max_block_h: int = _MAX_BLOCK_H) -> torch.Tensor:
    """paged_mla_decode with an explicit tile config and most heads a program (for tuning)."""
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    q_l, q_r = _query_parts(q, q_pe, kv_lora_rank)
    rope = _check(q_l, q_r, latent_cache, block_tables, kv_lora_rank, out)
    batch, heads, _ = q.shape
    if out is None:
        out = torch.empty((batch, heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits == 1:  # no merge: the split kernel normalises and writes out directly
        partial, lse = out, out
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        partial = torch.empty((batch, heads, num_splits, kv_lora_rank), dtype=torch.float32,
                              device=q.device)
        lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    block_h = min(max_block_h, max(_MIN_DOT, triton.next_power_of_2(heads)))
    _mla_decode_split_kernel[(batch, triton.cdiv(heads, block_h), num_splits)](
        q_l, q_r, latent_cache, block_tables, seq_lens, partial, lse,
        q_l.stride(0), q_l.stride(1), q_r.stride(0), q_r.stride(1), latent_cache.stride(0),
        block_tables.stride(0), *part_strides, *lse_strides, scale * _LOG2E,
        HEADS=heads, BLOCK_H=block_h, LORA=kv_lora_rank, ROPE=rope,
        BLOCK_R=max(_MIN_DOT, rope), BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, PRECISION=_precision(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(q.device),
    )
    if num_splits > 1:
        merge_splits(partial, lse, out)
    return out


def paged_mla_prefill(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_starts: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                      block_size: int, scale: float, kv_lora_rank: int,
                      out: torch.Tensor | None = None,
                      q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA of packed (absorbed) new tokens over their sequences' paged latents.

    q [T, H, L + R], or q [T, H, L] and q_pe [T, H, R] apart (last dims contiguous);
    latent_cache [num_slots, L + R] already holds every token's row, new ones included;
    block_tables int32 [N, max_blocks]; query_starts int32 [N + 1] cumulative; seq_lens int32
    [N] (cached prefix + new tokens). Query token j of sequence i sits at position seq_lens[i] -
    query_len_i + j. Returns [T, H, L].
    """
    return launch_mla_prefill(q, latent_cache, block_tables, query_starts, seq_lens,
                              max_query_len, block_size, scale, kv_lora_rank, out,
                              _prefill_config(kv_lora_rank), q_pe)


def launch_mla_prefill(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                       query_starts: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                       block_size: int, scale: float, kv_lora_rank: int,
                       out: torch.Tensor | None, cfg: PrefillConfig,
                       q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """paged_mla_prefill with an explicit tile config (for tuning)."""
    q_l, q_r = _query_parts(q, q_pe, kv_lora_rank)
    rope = _check(q_l, q_r, latent_cache, block_tables, kv_lora_rank, out)
    tokens, heads, _ = q.shape
    if out is None:
        out = torch.empty((tokens, heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    grid = (heads, num_seqs, triton.cdiv(max_query_len, cfg.block_m))
    _mla_prefill_kernel[grid](
        q_l, q_r, latent_cache, block_tables, query_starts, seq_lens, out,
        q_l.stride(0), q_l.stride(1), q_r.stride(0), q_r.stride(1), latent_cache.stride(0),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * _LOG2E,
        LORA=kv_lora_rank, ROPE=rope, BLOCK_R=max(_MIN_DOT, rope), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, PRECISION=_precision(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def store_latent(latent: torch.Tensor, latent_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """latent_cache[slot_mapping[t]] = latent[t] for latent [T, L + R] (rows may be strided, the
    last dim contiguous); negative slots (padding) are skipped, with no branch on the host."""
    if slot_mapping.dim() != 1 or (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1):
        raise ValueError("slot_mapping must be a contiguous 1-D tensor (the kernel reads it "
                         "as a flat array)")
    width = latent_cache.shape[-1]
    if latent_cache.dim() != 2 or not latent_cache.is_contiguous():
        raise ValueError("latent_cache must be a contiguous [num_slots, L + R] tensor")
    if latent.dim() != 2 or tuple(latent.shape) != (slot_mapping.shape[0], width) \
            or latent.stride(-1) != 1:
        raise ValueError(f"latent must be [{slot_mapping.shape[0]}, {width}] with a contiguous "
                         f"last dim, got shape {tuple(latent.shape)} strides {latent.stride()}")
    if latent.shape[0] == 0:
        return
    block = triton.next_power_of_2(width)
    _store_latent_kernel[(latent.shape[0],)](
        latent, latent_cache, slot_mapping, latent.stride(0), latent_cache.stride(0),
        WIDTH=width, BLOCK=block, num_warps=max(1, min(4, block // 256)))


def _precision(q: torch.Tensor) -> str:
    """Exact fp32 products for fp32 inputs (the default would round them to tf32)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _query_parts(q: torch.Tensor, q_pe: torch.Tensor | None, kv_lora_rank: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent part, rotary part) of the query: q and q_pe as given, or q's two column ranges."""
    if q_pe is not None:
        return q, q_pe
    return q[..., :kv_lora_rank], q[..., kv_lora_rank:]


def _check(q_l: torch.Tensor, q_r: torch.Tensor, latent_cache: torch.Tensor,
           block_tables: torch.Tensor, kv_lora_rank: int, out: torch.Tensor | None) -> int:
    """Shape and layout checks of both MLA launchers; returns the rotary width R. Nothing here
    may read tensor values: that would sync with the device and break graph capture."""
    lora, rope = kv_lora_rank, q_r.shape[-1]
    if lora < _MIN_DOT or lora & (lora - 1):
        raise ValueError(f"kv_lora_rank must be a power of two >= 16, got {lora}")
    if rope < 1 or rope & (rope - 1):
        raise ValueError(f"the rotary width q.shape[-1] - kv_lora_rank must be a power of two, "
                         f"got {rope}")
    if q_l.dim() != 3 or q_l.shape[-1] != lora or q_l.stride(-1) != 1 or q_r.stride(-1) != 1:
        raise ValueError(f"q must be [tokens, heads, {lora} + R] (or [tokens, heads, {lora}] "
                         f"with q_pe [tokens, heads, R]) with contiguous last dims")
    if q_r.shape[:2] != q_l.shape[:2] or q_r.dtype != q_l.dtype:
        raise ValueError(f"q_pe {tuple(q_r.shape)} {q_r.dtype} does not match q "
                         f"{tuple(q_l.shape)} {q_l.dtype}")
    if latent_cache.dim() != 2 or latent_cache.shape[1] != lora + rope \
            or not latent_cache.is_contiguous():
        raise ValueError(f"latent_cache must be a contiguous [num_slots, {lora + rope}] tensor")
    if latent_cache.dtype != q_l.dtype:
        raise ValueError(f"q is {q_l.dtype} but latent_cache is {latent_cache.dtype}")
    if out is not None and (tuple(out.shape) != (*q_l.shape[:2], lora) or out.stride(-1) != 1):
        raise ValueError(f"out must be {[*q_l.shape[:2], lora]} with a contiguous last dim")
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")
    return rope
