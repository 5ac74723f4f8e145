"""MLAOps: multi-head latent attention, the attention of DeepSeek-V2/V3 (deepseek_v3.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class MLAOps(ABC):
    """Mixed into a ModelOps subclass by a backend that runs MLA models."""

    @abstractmethod
    def latent_attention(self, q: torch.Tensor, latent: torch.Tensor, layer: int, meta: Any,
                         value_dim: int, scale: float) -> torch.Tensor:
        """MLA (weight-absorbed): write latent [T, L] into layer's paged cache; every head of
        q [T, H, L] attends the shared latents causally (scores over all L dims, values their
        first value_dim dims). Returns [T, H, value_dim]."""

    def mla_latent(self, kv: torch.Tensor, k_pe: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """The step's latent cache rows [T, L + R] from kv_a_proj's output kv [T, L + R]: its
        c_kv [T, L] RMS-normalized by weight, then the rotated rope key k_pe [T, R] (a backend
        whose rotary rotates in place may normalize c_kv where it lies and return kv)."""
        lora = kv.shape[-1] - k_pe.shape[-1]
        return torch.cat((self.rms_norm(kv[:, :lora].contiguous(), weight, eps), k_pe), dim=-1)

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, layer: int, meta: Any,
                      scale: float) -> torch.Tensor:
        """One MLA layer's attention from its parts: q_nope [T, H, N], rotated q_pe [T, H, R],
        the step's latent rows [T, L + R], kv_b_proj's halves w_uk [H, N, L] and w_uv
        [H, L, V]. Returns the heads' values [T, H, V]. Here in the absorbed form (W_UK folded
        into the query, W_UV applied after latent_attention); a backend may expand a long
        prefill into per-head keys and values instead (fewer FLOPs a pair)."""
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat((q_latent, q_pe), dim=-1)
        out = self.latent_attention(query, latent, layer, meta, w_uk.shape[-1], scale)
        return torch.einsum("thl,hlv->thv", out, w_uv)
