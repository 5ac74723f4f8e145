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
