"""MoEOps: the ops MoE layers (moe/layer.py) call, with reference definitions. A backend that
runs MoE models inherits it beside ModelOps and overrides what it has kernels for (the CUDA
backend's fused MoE, the Neuron backend's static-shape experts)."""
from __future__ import annotations

from typing import Any

import torch

from deepinfer.models.moe.experts import fused_experts_reference
from deepinfer.models.moe.routing import RouteCounts, RouterSpec, select_experts
from deepinfer.models.quant.packed import PackedWeight


class MoEOps:
    """Routing, the experts' computation and the exchange between ranks. Mixed into a
    ModelOps subclass: swiglu calls its silu_and_mul."""

    # fused_experts also runs a layer's shared experts: as slots past the routed ones that
    # every token takes with weight 1, where all of a layer's slots are on this rank (one
    # grouped pass instead of a dense MLP beside it; layer.shared_expert_slots).
    fuses_shared_experts: bool = False

    def swiglu(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """silu_and_mul with DeepSeek-V4's clamp: x [T, 2F] -> silu(min(gate, limit)) *
        clamp(up, -limit, limit); limit None: silu_and_mul(x)."""
        if limit is None:
            return self.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.silu_and_mul(torch.cat((gate.clamp(max=limit),
                                            up.clamp(min=-limit, max=limit)), dim=-1))

    def route(self, logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
              counts: RouteCounts | None = None, fixed_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32); the
        routes of real tokens are added to counts, if given. fixed_ids [T, k] (hash routing):
        the experts are these and the scores only weigh them."""
        weights, ids = select_experts(logits, spec, bias, fixed_ids)
        if counts is not None:
            counts.add(ids)
        return weights, ids

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor | PackedWeight,
                      w2: torch.Tensor | PackedWeight, weights: torch.Tensor,
                      slots: torch.Tensor, capacity: int | None = None,
                      swiglu_limit: float | None = None) -> torch.Tensor:
        """sum over k of weights[t, k] * down(silu(gate) * up)(x[t]) by the expert in slot
        slots[t, k] of this rank (w13 [S, 2F, H] gate rows then up rows, w2 [S, H, F]);
        slot -1 routes are served elsewhere and skipped. Returns [T, H] in x.dtype.
        capacity: static-shape backends compute at most `capacity` routes per slot, in a
        grouped layout of that size; the caller guarantees that no slot overflows it. None: no
        limit. The reference (and every dynamic-shape backend) ignores it.
        swiglu_limit (DeepSeek-V4): silu(min(gate, limit)) * clamp(up, -limit, limit) instead
        of silu(gate) * up; None: no clamp. Packed experts (FP8Experts, a backend that runs
        fp8): the reference dequantizes them."""
        w13, w2 = (w.dequantize().to(device=x.device, dtype=x.dtype)
                   if isinstance(w, PackedWeight) else w for w in (w13, w2))
        return fused_experts_reference(x, w13, w2, weights, slots, swiglu_limit)

    def expert_exchange(self, group: Any, rank: int, world_size: int,
                        slots_per_rank: int) -> Any | None:
        """The exchange of this backend's MoE layers (AllGatherExchange's run signature), used
        on one rank as on many; None (the default): the runtime's all-gather and all-to-all
        exchanges under expert parallel, none on one rank. Static-shape backends return one
        whose shapes never depend on the routing (neuron/moe.py's StaticMoEExchange)."""
        return None
