"""The small set of operations a model asks of its backend.

Models are plain torch modules; everything that depends on the KV layout or on a kernel goes
through this protocol, so one model definition runs on every backend.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch


class ModelOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (rms_norm(x + residual), x + residual)."""
        ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]; cos/sin tables [max_len, rotary_dim] (NeoX halves)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2F] -> silu(x[:, :F]) * x[:, F:]."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: Any) -> torch.Tensor:
        """Write k, v [T, Hk, D] into layer's paged cache; attend q [T, Hq, D] causally over
        each sequence's cached prefix plus its new tokens. Returns [T, Hq, D]."""
        ...
