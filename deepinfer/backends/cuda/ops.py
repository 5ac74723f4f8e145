"""ModelOps on the GPU: every op is one Triton kernel, rotary fused into the KV cache write.
Projections go to cuBLAS via torch, except one-token ones (batch-1 decode), which go to the
Triton GEMV (kernels/gemv.py): 9% less time over a decode step's weights on an H200."""
from __future__ import annotations

import math

import torch

from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.decode_attention import paged_decode_attention
from deepinfer.backends.cuda.kernels.gemv import gemv
from deepinfer.backends.cuda.kernels.kv_write import store_kv
from deepinfer.backends.cuda.kernels.norm import add_rms_norm, rms_norm
from deepinfer.backends.cuda.kernels.prefill_attention import paged_prefill_attention
from deepinfer.backends.cuda.kernels.rotary import apply_rotary_, rotary_store_kv_
from deepinfer.backends.cuda.step_inputs import AttentionMeta
from deepinfer.models.ops import ModelOps


class PagedKVCache:
    """All layers' K and V in one tensor [layers, 2, slots, kv_heads, head_dim]: layer-first, so
    a host page (one block of every layer) is 2 * layers contiguous chunks on the device."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.kv: torch.Tensor | None = None

    def allocate(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.kv = torch.zeros((self.num_layers, 2, num_slots, kv_heads, head_dim),
                              dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


class CUDAOps(ModelOps):
    def __init__(self, cache: PagedKVCache, head_dim: int, block_size: int = 0,
                 use_gemv: bool = True) -> None:
        self.cache = cache
        self.block_size = block_size
        self.scale = 1.0 / math.sqrt(head_dim)
        self.use_gemv = use_gemv  # off: every projection goes to cuBLAS (for comparison)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        apply_rotary_(q, k, positions, cos, sin)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: AttentionMeta) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, layer, meta)

    def rotary_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layer: int, meta: AttentionMeta) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        rotary_store_kv_(q, k, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, layer, meta)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_gemv and x.shape[0] == 1 and x.is_contiguous():
            return gemv(x, weight, bias)
        return super().linear(x, weight, bias)

    def _attend(self, q: torch.Tensor, layer: int, meta: AttentionMeta) -> torch.Tensor:
        """Attention over the layer's cache, which already holds this step's K and V."""
        k_cache, v_cache = self.cache.layer(layer)
        if meta.decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          self.block_size, self.scale, meta.num_splits)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_starts,
                                       meta.seq_lens, meta.max_query_len, self.block_size,
                                       self.scale)
