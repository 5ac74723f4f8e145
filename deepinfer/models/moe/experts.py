"""The expert computation, reference definition (MoEOps.fused_experts calls it): every token
through its k experts' gated MLPs, weighted and summed.

Weights are stacked per expert slot: w13 [S, 2F, H] (gate rows, then up rows) and w2 [S, H, F].
A slot is a physical copy of an expert held on this rank; a route whose slot id is -1 is served
by another rank and contributes nothing here (its rank adds it in the combine).

DeepSeek-V4 bounds the activation (`swiglu_limit`): the gate is clamped from above only, the up
projection on both sides, before silu(gate) * up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit, silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            weights: torch.Tensor, slots: torch.Tensor,
                            swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, H], weights [T, k] float32, slots [T, k] int (-1: not here) -> [T, H] in x.dtype.
    swiglu_limit: the activation's clamp (see swiglu), None for none."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = slots.reshape(-1).long()
    for slot in torch.unique(flat[flat >= 0]).tolist():
        routes = (flat == slot).nonzero().squeeze(1)
        tokens = routes // slots.shape[1]
        gate, up = F.linear(x[tokens], w13[slot]).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, swiglu_limit), w2[slot])
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[routes, None])
    return out.to(x.dtype)
