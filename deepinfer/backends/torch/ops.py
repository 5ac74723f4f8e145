"""The reference ops in plain torch: ModelOps over the paged cache (paged_cache.py) and the
attention metadata built from each step (attention.py). A backend subclasses ReferenceOps and
overrides what it has kernels for; ReferenceMLAOps adds MLA attention the same way."""
from __future__ import annotations

import torch

from deepinfer.backends.torch.attention import PagedAttentionMeta, latent_attention, paged_attention
from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.models.mla_ops import MLAOps
from deepinfer.models.ops import ModelOps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # float32 accumulation, then cast back before the weight, as the reference models do.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    # Partial rotary: only the first `rot` dims rotate.
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


class ReferenceOps(ModelOps):
    """The five primitives in torch; attention reads PagedAttentionMeta."""

    def __init__(self, cache: PagedCache) -> None:
        self.cache = cache

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = cos[positions].unsqueeze(1).to(q.dtype)
        s = sin[positions].unsqueeze(1).to(q.dtype)
        return apply_rotary(q, c, s), apply_rotary(k, c, s)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: PagedAttentionMeta) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        return paged_attention(q, k, v, k_cache, v_cache, meta, layer)


class ReferenceMLAOps(MLAOps):
    """MLA attention over the paged cache; mixed into a ReferenceOps subclass."""

    cache: PagedCache

    def latent_attention(self, q: torch.Tensor, latent: torch.Tensor, layer: int,
                         meta: PagedAttentionMeta, value_dim: int, scale: float
                         ) -> torch.Tensor:
        (cache,) = self.cache.layer(layer)
        return latent_attention(q, latent, cache, meta, layer, value_dim, scale)
