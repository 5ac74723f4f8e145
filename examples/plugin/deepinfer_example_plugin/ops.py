"""The example backend's ModelOps: DeepInfer's reference torch ops (`ReferenceOps`, and
`ReferenceMLAOps` for DeepSeek-V3's latent attention), with its own norms and activation in
their place. A device backend writes each op it has a kernel for the same way; the ones it
leaves are the references. It declares the op families it runs by the mixins it inherits:
MLA here, not MoE (`MoEOps`) nor DeepSeek-V4 (`DeepSeekV4Ops`), so DeepInfer refuses those
models on this backend at load with a message naming the missing mixin."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.backends.torch.ops import ReferenceMLAOps, ReferenceOps


class ExampleOps(ReferenceMLAOps, ReferenceOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # float32 statistics, rounded to x's dtype before the weight, as the reference models.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
        return weight * normed

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
