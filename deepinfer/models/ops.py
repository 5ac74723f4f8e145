"""The operations every model family asks of its backend.

Models are plain torch modules; everything that depends on the KV layout or on a kernel goes
through these ops, so one model definition runs on every backend. A backend implements the five
primitives. The composites (a projection, the gated MLP, rotary followed by attention) have
reference definitions here; a backend overrides one where it has a better kernel, e.g. the CUDA
backend's one-token GEMV and its rotary fused into the KV cache write.

Ops only some families call are mixins beside those families: MoEOps (models/moe/ops.py),
MLAOps (models/mla_ops.py), DeepSeekV4Ops (models/deepseek_v4/ops.py). A backend declares the
ones it runs by inheriting them; a model names the ones it needs in its ModelTraits.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from deepinfer.core.accelerator import ParallelContext
from deepinfer.models.quant.packed import PackedWeight


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm of q and k before the rotation (Qwen3): weights [head_dim]."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


class ModelOps(ABC):
    """The primitives (abstract) and composites every family calls."""

    # The ranks MoE layers spread their experts over (set by the runner before the model is
    # built); None: one rank holds every expert.
    parallel: ParallelContext | None = None
    # The packed weight kinds (models/quant: "gguf:Q4_1", "fp8") packed_linear runs; the
    # loader keeps those packed and dequantizes every other quantized weight.
    packed_kinds: tuple[str, ...] = ()

    # ---- primitives: every backend implements these -------------------------------------
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, float32 statistics."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (rms_norm(x + residual), x + residual)."""

    @abstractmethod
    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]; cos/sin tables [max_len, rotary_dim] (NeoX halves)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2F] -> silu(x[:, :F]) * x[:, F:]."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: Any) -> torch.Tensor:
        """Write k, v [T, Hk, D] into layer's paged cache; attend q [T, Hq, D] causally over
        each sequence's cached prefix plus its new tokens. Returns [T, Hq, D]."""

    # ---- composites: reference definitions, overridden where a better kernel exists -------
    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ weight[N, K].T (+ bias); a packed weight goes to packed_linear."""
        if isinstance(weight, PackedWeight):
            return self.packed_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def decoder_layers(self, layers: Sequence[torch.nn.Module], positions: torch.Tensor,
                       hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A backend's own run of a whole decoder stack for this step: (hidden, residual)
        after the last layer, as the layers one by one would give them; or None, and the
        model runs its layers. The reference runs none."""
        return None

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Called once the model's weights are loaded (and again after weights move): a backend
        lays out again what its kernels read. The reference reads the weights as loaded."""

    def packed_linear(self, x: torch.Tensor, weight: PackedWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ a quantized weight (one of packed_kinds), in x.dtype; the reference
        dequantizes it."""
        w = weight.dequantize().to(device=x.device, dtype=x.dtype)
        return F.linear(x, w, bias)

    def gated_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up), gate and up one fused projection [2F, K]: the dense MLP of
        llama and DeepSeek."""
        hidden = self.silu_and_mul(self.linear(x, gate_up, gate_up_bias))
        return self.linear(hidden, down, down_bias)

    def rotary_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layer: int, meta: Any, qk_norm: QKNorm | None = None
                         ) -> torch.Tensor:
        """attention() over q and k after rotary(), and after qk_norm's per-head RMSNorm of
        each if given; q and k may be changed in place."""
        if qk_norm is not None:
            q = self.rms_norm(q, qk_norm.q_weight, qk_norm.eps)
            k = self.rms_norm(k, qk_norm.k_weight, qk_norm.eps)
        q, k = self.rotary(q, k, positions, cos, sin)
        return self.attention(q, k, v, layer, meta)
