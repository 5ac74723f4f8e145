"""NeoX-style rotary embedding: q rotated in place; k rotated in place, or rotated straight into
its paged-cache slot together with v (the decode path: one kernel instead of two).

One program per token: it reads the token's cos/sin row once and rotates all of its q heads,
then all of its k heads, as [BLOCK_H, BLOCK_HALF] tiles of the two halves of the first `rot`
dims (dims >= rot are left alone, or copied unrotated into the cache). Math is fp32; the
reference rounds cos/sin to the activation dtype first, so bf16 results agree within bf16
rounding.

Qwen3's per-head q/k RMSNorm can run in the same pass (qk_norm, when the rotation covers the
whole head): each head's two halves are normalised, with norm.py's numerics, before they are
rotated. At batch 1 that is two ~2 us launches fewer per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs

# Elements of one half-tile: a token's heads are rotated in (unrolled) chunks of this many.
_TILE = 4096


@triton.jit
def _norm_halves(x1, x2, w_ptr, cols, col_mask, half, eps, dtype):
    """RMSNorm of each head (row) whose halves are x1 and x2, as norm.py computes it: fp32
    statistics, the normalised value rounded to the activation dtype, times the weight, rounded
    again (the rotation then reads what the separate norm kernel would have written)."""
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))[:, None]
    w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)
    y1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _rotate_heads(src, stride_h, dst, dst_stride_h, n_heads, cos1, cos2, sin1, sin2, cols, half,
                  norm_w, eps, BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr,
                  NORM: tl.constexpr):
    col_mask = cols < half
    for chunk in tl.static_range(CHUNKS):
        heads = chunk * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < n_heads) & col_mask
        p1 = src + heads * stride_h + cols
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            x1, x2 = _norm_halves(x1, x2, norm_w, cols, col_mask, half, eps,
                                  src.dtype.element_ty)
        # out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        d1 = dst + heads * dst_stride_h + cols
        tl.store(d1, (x1 * cos1 - x2 * sin1).to(dst.dtype.element_ty), mask=mask)
        tl.store(d1 + half, (x2 * cos2 + x1 * sin2).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(src, stride_h, dst, dst_stride_h, n_heads, lo, d,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CHUNKS: tl.constexpr):
    """dst[h, lo:d] = src[h, lo:d] for every head (v, and k's unrotated tail)."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_mask = (cols >= lo) & (cols < d)
    for chunk in tl.static_range(CHUNKS):
        heads = chunk * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < n_heads) & col_mask
        x = tl.load(src + heads * stride_h + cols, mask=mask, other=0.0)
        tl.store(dst + heads * dst_stride_h + cols, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, n_q, n_k, half,
                   sq_t, sq_h, sk_t, sk_h, s_cos, s_sin,
                   v_ptr, kc_ptr, vc_ptr, slot_ptr, d, sv_t, sv_h, sc_slot, sc_h,
                   qw_ptr, kw_ptr, eps,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   CHUNKS_Q: tl.constexpr, CHUNKS_K: tl.constexpr, STORE: tl.constexpr,
                   HAS_TAIL: tl.constexpr, BLOCK_HV: tl.constexpr, BLOCK_D: tl.constexpr,
                   CHUNKS_V: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_mask = cols < half
    cos_row = cos_ptr + pos * s_cos + cols
    sin_row = sin_ptr + pos * s_sin + cols
    cos1 = tl.load(cos_row, mask=col_mask, other=0.0)
    cos2 = tl.load(cos_row + half, mask=col_mask, other=0.0)
    sin1 = tl.load(sin_row, mask=col_mask, other=0.0)
    sin2 = tl.load(sin_row + half, mask=col_mask, other=0.0)
    q = q_ptr + t * sq_t
    _rotate_heads(q, sq_h, q, sq_h, n_q, cos1, cos2, sin1, sin2, cols, half, qw_ptr, eps,
                  BLOCK_HQ, CHUNKS_Q, NORM)
    k = k_ptr + t * sk_t
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # A padding row of a CUDA-graph batch (slot < 0) writes nothing: it gets no heads.
        # (Not a scalar bool &-ed into the masks: Triton's interpreter widens a scalar compare
        # to an int tensor, which 3.9 rejects as a mask.)
        live_k = tl.where(slot >= 0, n_k, 0)
        k_dst = kc_ptr + slot * sc_slot
        _rotate_heads(k, sk_h, k_dst, sc_h, live_k, cos1, cos2, sin1, sin2, cols, half,
                      kw_ptr, eps, BLOCK_HK, CHUNKS_K, NORM)
        if HAS_TAIL:
            _copy_heads(k, sk_h, k_dst, sc_h, live_k, 2 * half, d, BLOCK_HV, BLOCK_D, CHUNKS_V)
        _copy_heads(v_ptr + t * sv_t, sv_h, vc_ptr + slot * sc_slot, sc_h, live_k, 0, d,
                    BLOCK_HV, BLOCK_D, CHUNKS_V)
    else:
        _rotate_heads(k, sk_h, k, sk_h, n_k, cos1, cos2, sin1, sin2, cols, half,
                      kw_ptr, eps, BLOCK_HK, CHUNKS_K, NORM)


def _check(name: str, x: torch.Tensor, tokens: int, rot: int) -> None:
    if x.dim() != 3 or x.shape[0] != tokens or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T={tokens}, heads, D] with a contiguous last dim, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if rot > x.shape[-1]:
        raise ValueError(f"rotary dims {rot} exceed {name}'s head dim {x.shape[-1]}")


def _heads_block(heads: int, block_half: int) -> int:
    return max(1, min(triton.next_power_of_2(heads), _TILE // block_half))


def _check_tables(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if positions.dim() != 1 or (positions.numel() > 1 and positions.stride(0) != 1):
        raise ValueError("positions must be a contiguous 1-D tensor (the kernel reads it as a "
                         "flat array)")
    if cos.dim() != 2 or sin.shape != cos.shape or cos.shape[-1] % 2:
        raise ValueError(f"cos/sin must be [max_positions, even rot], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin must have a contiguous last dim")


def _check_norm(qk_norm: tuple, q: torch.Tensor, rot: int) -> None:
    d = q.shape[-1]
    if rot != d:
        raise ValueError(f"a fused q/k norm needs the rotation to cover the head ({rot} of {d} "
                         f"dims): use rms_norm first")
    for name, w in zip("qk", qk_norm[:2]):
        if w.shape != (d,) or not w.is_contiguous() or w.dtype != q.dtype:
            raise ValueError(f"{name} norm weight must be contiguous [{d}] in {q.dtype}, got "
                             f"{tuple(w.shape)} {w.dtype}")


def _launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, store: tuple | None, qk_norm: tuple | None = None) -> None:
    _check_tables(positions, cos, sin)
    tokens, rot = positions.shape[0], cos.shape[-1]
    _check("q", q, tokens, rot)
    _check("k", k, tokens, rot)
    if qk_norm is not None:
        _check_norm(qk_norm, q, rot)
    if tokens == 0:
        return
    half, d = rot // 2, k.shape[-1]
    block_half, block_d = triton.next_power_of_2(half), triton.next_power_of_2(d)
    block_hq, block_hk = _heads_block(q.shape[1], block_half), _heads_block(k.shape[1], block_half)
    block_hv = max(1, min(triton.next_power_of_2(k.shape[1]), _TILE // block_d))
    v, k_cache, v_cache, slots = store if store is not None else (k, k, k, positions)
    # 4 warps for 32 heads of 64-dim halves: on an H200, 2-4 warps beat 8 by ~10%.
    warps = max(1, min(8, block_hq * block_half // 512))
    qw, kw, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    _rotary_kernel[(tokens,)](q, k, positions, cos, sin, q.shape[1], k.shape[1], half,
                              q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), sin.stride(0),
                              v, k_cache, v_cache, slots, d, v.stride(0), v.stride(1),
                              k_cache.stride(0), k_cache.stride(1), qw, kw, float(eps),
                              BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
                              CHUNKS_Q=triton.cdiv(q.shape[1], block_hq),
                              CHUNKS_K=triton.cdiv(k.shape[1], block_hk),
                              STORE=store is not None, HAS_TAIL=rot < d, BLOCK_HV=block_hv,
                              BLOCK_D=block_d, CHUNKS_V=triton.cdiv(k.shape[1], block_hv),
                              NORM=qk_norm is not None, num_warps=warps, **launch_kwargs(q.device))


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (strided views are fine) by the rows
    cos[positions], sin[positions] of float32 tables [max_positions, rot], rot <= D even."""
    _launch(q, k, positions, cos, sin, None)


def rotary_store_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """Rotate q in place; write rotated k and v [T, Hk, D] into the caches [num_slots, Hk, D]
    at slot_mapping [T] (negative slots are skipped). k itself is left as it was. With
    qk_norm = (q weight [D], k weight [D], eps), q and k are RMS-normalised per head first (q in
    place too), as rms_norm would."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != positions.shape[0] or \
            (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1):
        raise ValueError("slot_mapping must be a contiguous 1-D tensor, one slot a token")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or \
            k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(f"k_cache and v_cache must be contiguous [slots, {k.shape[1]}, "
                         f"{k.shape[2]}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _check("v", v, positions.shape[0], 0)
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
    _launch(q, k, positions, cos, sin, (v, k_cache, v_cache, slot_mapping), qk_norm)
