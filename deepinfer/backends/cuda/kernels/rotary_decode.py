"""Decode attention with the rotary (and Qwen3's q/k norm), the KV write and the split merge in
one kernel.

At batch 1 a decode layer's attention is three latency-bound launches: rotary + KV write
(rotary.py), the split-K pass and the merge of its splits (decode_attention.py). Each moves a few
kilobytes, so each costs its launch and ramp, ~2-4 us, 48 times a step. Here one program per
(sequence, KV head, split), as in decode_attention.py, also:

- rotates its GROUP query rows in registers (q itself is left as it was);
- if its tiles hold the new token (one split per KV head does), rotates that token's k and
  writes k and v into their cache slot, then syncs its threads, so its own tile loop reads the
  new key like any other. No other program reads that slot: only the split holding the last
  tile sees the new token;
- writes its partial output, then takes a ticket from a per-(sequence, KV head) counter; the
  last split to finish merges all of them and puts the counter back to 0 for the next layer
  (the "serial split-K" pattern). Nothing then has to run between this kernel and o_proj.

Measured on an H200 (moe_engine_bench.py, Qwen3-30B-A3B shape, context 512, three builds in one
run): batch 1 371 tok/s with the three kernels, 369 with this one (PDL already hides most of the
small kernels' launches: within noise); batch 32 1980 -> 2015-2047 tok/s. Prefetching o_proj
into L2 from spare programs of this kernel was tried too and gained nothing (362 tok/s).

Numerics follow rotary.py, norm.py and decode_attention.py: the rotated q and k are rounded to
the activation dtype before they are used, so the outputs agree with the unfused path within
one rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.decode_attention import (
    _LOG2E,
    _MIN_ROWS,
    _check,
    _config,
    attend_tiles,
    check_window,
    merge_splits,
    split_tiles,
)
from deepinfer.backends.cuda.kernels.pdl import launch_kwargs


@triton.jit
def _norm_weights(norm_w, offs_d, HEAD_DIM: tl.constexpr):
    """A q/k norm's weight [HEAD_DIM] and its rotate_half partner, in float32: written by no
    kernel, so the caller loads them before its PDL wait."""
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    return (tl.load(norm_w + offs_d).to(tl.float32)[None, :],
            tl.load(norm_w + partner).to(tl.float32)[None, :])


@triton.jit
def _rope_rows(src, stride_h, heads, row_ok, offs_d, cos, sin, w, wp, eps,
               HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """Rows `heads` of src [*, HEAD_DIM] rotated NeoX-style by cos/sin [HEAD_DIM] (after their
    per-row RMSNorm with weight w and its partner wp when NORM), rounded to src's dtype:
    rotary.py's numerics."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = (offs_d + half) % HEAD_DIM  # rotate_half pairs dim d with d +- half
    ptrs = src + heads[:, None] * stride_h
    x = tl.load(ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    xp = tl.load(ptrs + partner[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    dtype = src.dtype.element_ty
    if NORM:
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / HEAD_DIM + eps))[:, None]
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
    return (x * cos[None, :] + sign * xp * sin[None, :]).to(dtype)


@triton.jit
def _store_new_kv(Kn, Vn, KC, VC, slot, kv_head, stride_knh, stride_vnh, stride_kt, stride_kh,
                  stride_vt, stride_vh, offs_d, cos, sin, kw, kwp, eps,
                  HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """The new token's rotated k and its v into cache slot `slot` of this KV head."""
    one = tl.arange(0, 1)
    k = _rope_rows(Kn, stride_knh, kv_head + one, one < 1, offs_d, cos, sin, kw, kwp, eps,
                   HEAD_DIM, NORM)
    tl.store(KC + slot * stride_kt + kv_head * stride_kh + offs_d[None, :], k)
    v = tl.load(Vn + kv_head * stride_vnh + offs_d)
    tl.store(VC + slot * stride_vt + kv_head * stride_vh + offs_d, v)


@triton.jit
def _merge_group(Partial, Lse, Out, heads, row_ok, offs_d,
                 stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, b,
                 NUM_SPLITS: tl.constexpr):
    """Out rows `heads` = the LSE-weighted mean of their splits (decode_attention's merge).
    Loads bypass L1 (.cg): other programs wrote these partials."""
    splits = tl.arange(0, NUM_SPLITS)
    lse = tl.load(Lse + b * stride_lb + heads[:, None] * stride_lh + splits[None, :],
                  mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    weights = tl.exp(lse - tl.max(lse, 1)[:, None])  # split 0 is never empty: finite max
    parts = tl.load(Partial + b * stride_pb + heads[:, None, None] * stride_ph
                    + splits[None, :, None] * stride_ps + offs_d[None, None, :],
                    mask=row_ok[:, None, None], other=0.0, cache_modifier=".cg")
    out = tl.sum(parts * weights[:, :, None], 1) / tl.sum(weights, 1)[:, None]
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _rotary_decode_kernel(
    Q, Kn, Vn, Pos, Cos, Sin, QNorm, KNorm, eps, Slots,
    KC, VC, BlockTables, SeqLens, Partial, Lse, Out, Counters,
    stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    qk_scale, window, n_kv,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, NORM: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    qw, qwp, kw, kwp = 0.0, 0.0, 0.0, 0.0
    if NORM:  # Qwen3's q/k norm weights: requested before the wait, as the GEMV's weights
        qw, qwp = _norm_weights(QNorm, offs_d, HEAD_DIM)
        kw, kwp = _norm_weights(KNorm, offs_d, HEAD_DIM)
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
    pos = tl.load(Pos + b).to(tl.int64)
    cos = tl.load(Cos + pos * stride_cos + offs_d).to(tl.float32)
    sin = tl.load(Sin + pos * stride_cos + offs_d).to(tl.float32)

    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    q = _rope_rows(Q + b * stride_qb, stride_qh, heads, row_ok, offs_d, cos, sin, qw, qwp, eps,
                   HEAD_DIM, NORM)
    slot = tl.load(Slots + b).to(tl.int64)
    last_tile = num_tiles - 1
    if (last_tile >= tile_lo) & (last_tile < tile_hi) & (slot >= 0):
        _store_new_kv(Kn + b * stride_knb, Vn + b * stride_vnb, KC, VC, slot, kv_head,
                      stride_knh, stride_vnh, stride_kt, stride_kh, stride_vt, stride_vh,
                      offs_d, cos, sin, kw, kwp, eps, HEAD_DIM, NORM)
        tl.debug_barrier()  # the tile loop's threads read the slot just written

    table = BlockTables + b.to(tl.int64) * stride_bt
    acc, lse = attend_tiles(q, table, KC + kv_head * stride_kh, VC + kv_head * stride_vh,
                            stride_kt, stride_vt, seq_len, key_lo, tile_lo, tile_hi, offs_d,
                            qk_scale, ROWS, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PRECISION, SLIDING)
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(Partial + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                 + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)
        if MERGE:
            # Every thread's stores are issued before the ticket; acq_rel at GPU scope
            # publishes them to, and acquires the others' for, the program that merges.
            tl.debug_barrier()
            counter = Counters + b * n_kv + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:
                _merge_group(Partial, Lse, Out, heads, row_ok, offs_d, stride_pb, stride_ph,
                             stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, b,
                             NUM_SPLITS)
                tl.atomic_xchg(counter, 0)


class SplitCounters:
    """Split-K tickets: one int32 per output tile that splits meet on (here a (sequence, KV
    head); fp8_skinny.py: a weight-row tile), zero between launches (the program that merges
    resets its own). Allocated outside graph capture; a launch needing more than it holds while
    capturing merges in a separate kernel instead (fp8_skinny: runs unsplit)."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None

    def get(self, n: int, device: torch.device) -> torch.Tensor | None:
        if self._counts is not None and self._counts.numel() >= n:
            return self._counts
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        self._counts = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        return self._counts


def rotary_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, block_size: int, scale: float,
                            num_splits: int, counters: SplitCounters, window: int = 0,
                            qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                            ) -> torch.Tensor:
    """One decode token per sequence: rotary_store_kv_ then paged_decode_attention, in one
    kernel. q [B, Hq, D], k/v [B, Hk, D] (strided views of the fused qkv output are fine) are
    not modified; cos/sin [max_positions, D] (the rotation covers the head); positions,
    slot_mapping (-1: padding, nothing written), seq_lens [B]; qk_norm = (q weight, k weight,
    eps) or None. Returns out [B, Hq, D] in q's dtype."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    _check_inputs(q, k, v, cos, sin, positions, slot_mapping, qk_norm)
    _check(q, k_cache, v_cache, block_tables, num_splits, q_heads, kv_heads, None)
    check_window(window)
    out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    ticket_counts = counters.get(batch * kv_heads, q.device) if num_splits > 1 else None
    partial, lse = _split_buffers(out, num_splits)
    cfg = _config(head_dim)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    _rotary_decode_kernel[(batch, kv_heads, num_splits)](
        q, k, v, positions, cos, sin, q_norm, k_norm, float(eps), slot_mapping,
        k_cache, v_cache, block_tables, seq_lens, partial, lse, out,
        ticket_counts if ticket_counts is not None else seq_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), scale * _LOG2E, window, kv_heads,
        GROUP=q_heads // kv_heads,
        ROWS=max(_MIN_ROWS, triton.next_power_of_2(q_heads // kv_heads)),
        HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SLIDING=window > 0,
        NORM=qk_norm is not None, MERGE=ticket_counts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(q.device),
    )
    if num_splits > 1 and ticket_counts is None:
        merge_splits(partial, lse, out)
    return out


def _split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [B, Hq, S, D] and their LSEs [B, Hq, S] (unused at one split)."""
    batch, q_heads, head_dim = out.shape
    if num_splits == 1:  # the kernel writes out directly; these only lend it strides
        return out.unsqueeze(2), out
    return (torch.empty((batch, q_heads, num_splits, head_dim), dtype=torch.float32,
                        device=out.device),
            torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=out.device))


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                  qk_norm: tuple | None) -> None:
    batch, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{batch}, Hk, {d}]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dim")
    if cos.shape[-1] != d or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [max_positions, {d}] alike with a contiguous last "
                         f"dim, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.shape != (batch,) or (batch > 1 and x.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{batch}]")
    if qk_norm is not None and any(w.shape != (d,) or not w.is_contiguous() or
                                   w.dtype != q.dtype for w in qk_norm[:2]):
        raise ValueError(f"q/k norm weights must be contiguous [{d}] in {q.dtype}")
