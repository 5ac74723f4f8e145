"""Scatter of the new tokens' K and V into the paged cache: k_cache[slot_mapping[t]] = k[t].

One program per token copies its [kv_heads, head_dim] rows of K and of V. A negative slot (a
padding token of a CUDA-graph batch) is masked off, with no branch on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_heads, d,
                     sk_t, sk_h, sv_t, sv_h, sc_slot, sc_h,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    # A negative slot zeroes the head bound, masking the whole tile. (Not `& (slot >= 0)`:
    # Triton's interpreter widens a scalar compare to an int tensor, which 3.9 rejects as a mask.)
    live_heads = tl.where(slot >= 0, n_heads, 0)
    mask = (heads < live_heads) & (cols < d)
    dst = slot * sc_slot + heads * sc_h + cols
    k = tl.load(k_ptr + t * sk_t + heads * sk_h + cols, mask=mask)
    v = tl.load(v_ptr + t * sv_t + heads * sv_h + cols, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if x.dim() != 3 or tuple(x.shape[1:]) != shape[1:] or x.shape[0] != shape[0] \
            or x.stride(-1) != 1:
        raise ValueError(f"{name} must be {list(shape)} with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] (strided views fine) into caches [num_slots, Hk, D] (contiguous) at the
    int32/int64 slots slot_mapping [T]; negative slots are skipped."""
    if slot_mapping.dim() != 1 or (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1):
        raise ValueError("slot_mapping must be a contiguous 1-D tensor (the kernel reads it "
                         "as a flat array)")
    tokens = slot_mapping.shape[0]
    heads, d = k_cache.shape[1:]
    _check("k", k, (tokens, heads, d))
    _check("v", v, (tokens, heads, d))
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or \
            k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(d)
    # 2 warps for 8 heads of 128 (two 16-byte vectors per thread per tensor): fastest on an H200.
    warps = max(1, min(8, block_h * block_d // 512))
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slot_mapping, heads, d,
                                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                k_cache.stride(0), k_cache.stride(1),
                                BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)
