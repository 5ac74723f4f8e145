"""The MLP of an MoE decoder layer: a router, routed experts (stacked per slot), optionally
shared experts that every token goes through (DeepSeek).

The router's scores pick k experts per token (ops.route); the runtime turns each route into a
physical slot and, under expert parallelism, exchanges tokens with the ranks that hold them;
ops.fused_experts computes the routes this rank's slots serve. Checkpoints name experts one by
one (`experts.{e}.gate_proj`, Mixtral's `w1/w3/w2`); each loads into every slot that holds a
replica of it on this rank, and nowhere on ranks that hold none.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.models.decoder import GatedMLP
from deepinfer.models.moe.routing import RouterSpec
from deepinfer.models.moe.runtime import ExpertRuntime
from deepinfer.models.ops import ModelOps
from deepinfer.models.weights import SlotRows, Target

# checkpoint projection -> (our stacked weight, which half of w13: 0 gate, 1 up; None: w2)
EXPERT_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
               "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
_MOE_NAME = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate\.weight|"
                       r"gate\.e_score_correction_bias|experts\.(\d+)\.(\w+)\.weight|"
                       r"shared_experts\.(\w+)\.weight)$")


@dataclass(frozen=True)
class MoEDims:
    hidden_size: int
    intermediate_size: int  # per expert
    router: RouterSpec
    router_fp32: bool = False  # DeepSeek scores in float32 (weights and activations)
    score_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    shared_intermediate: int = 0  # shared experts' total width; 0 for none


class MoEBlock(nn.Module):
    def __init__(self, dims: MoEDims, layer: int, ops: ModelOps, runtime: ExpertRuntime) -> None:
        super().__init__()
        self.dims, self.layer, self.ops, self.runtime = dims, layer, ops, runtime
        # Kept in float32 whatever the model's dtype (the runner restores them after its cast):
        # a bf16 correction bias would pick different experts than the checkpoint's.
        self.fp32_params = ("gate", "e_score_correction_bias") if dims.router_fp32 else ()
        h, f, slots = dims.hidden_size, dims.intermediate_size, runtime.slots_per_rank
        self.gate = nn.Parameter(torch.empty(dims.router.num_experts, h))
        if dims.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(dims.router.num_experts))
        self.w13 = nn.Parameter(torch.empty(slots, 2 * f, h))
        self.w2 = nn.Parameter(torch.empty(slots, h, f))
        self.shared_experts = GatedMLP(h, dims.shared_intermediate, ops) \
            if dims.shared_intermediate else None
        runtime.add_block(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.route(self._router_logits(x), self.dims.router,
                                      getattr(self, "e_score_correction_bias", None),
                                      self.runtime.counts(self.layer))
        out = self.runtime.run(self.layer, x, weights, ids, self._compute)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.dims.router_fp32:
            return self.ops.linear(x.float(), self.gate.float())
        return self.ops.linear(x, self.gate)

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                 capacity: int | None = None) -> torch.Tensor:
        if capacity is None:  # an ops class whose fused_experts predates `capacity` still works
            return self.ops.fused_experts(x, self.w13, self.w2, weights, slots)
        return self.ops.fused_experts(x, self.w13, self.w2, weights, slots, capacity=capacity)

    # ---- weights -------------------------------------------------------------------------
    def expert_targets(self, prefix: str, expert: int, proj: str) -> list[Target]:
        """A checkpoint tensor of one expert -> every local slot that holds it."""
        name, half = EXPERT_PROJ[proj]
        f = self.dims.intermediate_size
        rows = None if half is None else (half * f, (half + 1) * f)
        return [(f"{prefix}.{name}", SlotRows(slot, rows))
                for slot in self.runtime.local_slots_of(self.layer, expert)]

    @torch.no_grad()
    def move_experts(self, sources: torch.Tensor, runtime: ExpertRuntime) -> None:
        """EPLB: this rank's slots take the weights of the given old physical slots."""
        for weight in (self.w13, self.w2):
            everything = runtime.gather_slots(weight.data)
            weight.data.copy_(everything[sources.to(everything.device)])


def moe_checkpoint_target(layers: nn.ModuleList, name: str) -> list[Target] | None:
    """A checkpoint name (without "model.") of an MoE layer's tensor -> its places in our
    model (possibly none: an expert no slot of this rank holds); None if not such a name."""
    match = _MOE_NAME.match(name)
    if match is None or not isinstance(layers[int(match.group(1))].mlp, MoEBlock):
        return None
    index, what, expert, proj, shared = match.groups()
    block: MoEBlock = layers[int(index)].mlp
    prefix = f"layers.{index}.mlp"
    if what == "gate.weight":
        return [(f"{prefix}.gate", None)]
    if what == "gate.e_score_correction_bias":
        return [(f"{prefix}.e_score_correction_bias", None)]
    if expert is not None:
        return block.expert_targets(prefix, int(expert), proj)
    if shared in ("gate_proj", "up_proj"):
        rows = block.shared_experts.fused_rows(0 if shared == "gate_proj" else 1)
        return [(f"{prefix}.shared_experts.gate_up_proj.weight", rows)]
    return [(f"{prefix}.shared_experts.{shared}.weight", None)]
