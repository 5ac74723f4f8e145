"""The MLP of an MoE decoder layer: a router, routed experts (stacked per slot), optionally
shared experts that every token goes through (DeepSeek).

DeepSeek-V4 adds a clamp of every expert's activation (`swiglu_limit`, shared experts too) and
hash-routed layers, whose experts are a checkpoint table's row of each token id (`tid2eid`):
those layers need the step's token ids, forward(x, token_ids).

The router's scores pick k experts per token (ops.route); the runtime turns each route into a
physical slot and, under expert parallelism, exchanges tokens with the ranks that hold them;
ops.fused_experts computes the routes this rank's slots serve. Checkpoints name experts one by
one (`experts.{e}.gate_proj`, Mixtral's `w1/w3/w2`); each loads into every slot that holds a
replica of it on this rank, and nowhere on ranks that hold none. Where the ops fuse shared
experts (MoEOps.fuses_shared_experts) and no exchange runs, the shared experts are slots past
the routed ones instead of a dense MLP: every token's routes get one to each, of weight 1.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.models.decoder import GatedMLP
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.moe.routing import RouterSpec
from deepinfer.models.moe.runtime import ExpertRuntime
from deepinfer.models.ops import ModelOps
from deepinfer.models.quant.packed import FP8Experts
from deepinfer.models.traits import Float32Params
from deepinfer.models.weight_targets import SlotRows, Target

# checkpoint projection -> (our stacked weight, which half of w13: 0 gate, 1 up; None: w2)
EXPERT_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
               "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
_MOE_NAME = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate\.weight|"
                       r"gate\.e_score_correction_bias|gate\.tid2eid|"
                       r"experts\.(\d+)\.(\w+)\.weight|shared_experts\.(\w+)\.weight)$")


@dataclass(frozen=True)
class MoEDims:
    hidden_size: int
    intermediate_size: int  # per expert
    router: RouterSpec
    router_fp32: bool = False  # DeepSeek scores in float32 (weights and activations)
    score_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    shared_intermediate: int = 0  # shared experts' total width; 0 for none
    swiglu_limit: float | None = None  # DeepSeek-V4's activation clamp (experts.swiglu)
    hash_vocab: int = 0  # rows of a hash layer's token id -> experts table; 0: learned top-k


class ClampedSharedExperts(GatedMLP):
    """DeepSeek-V4's shared expert: the gated MLP with the experts' swiglu_limit clamp."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: ModelOps,
                 limit: float) -> None:
        super().__init__(hidden_size, intermediate_size, ops)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        gate_up = ops.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return ops.linear(ops.swiglu(gate_up, self.limit), self.down_proj.weight,
                          self.down_proj.bias)


class MoEBlock(Float32Params, nn.Module):
    # Stacked expert weights a checkpoint's FP8 experts (or --quantization fp8) keep packed
    # (quant/plan.py): w13 and w2 are then FP8Experts modules, passed to ops the same way.
    packable_experts = ("w13", "w2")

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
        if dims.hash_vocab:
            # A parameter (not a buffer) so load_mapped fills it; integer, so no dtype cast
            # touches it.
            self.tid2eid = nn.Parameter(torch.zeros(dims.hash_vocab, dims.router.top_k,
                                                    dtype=torch.int64), requires_grad=False)
        # Shared experts as slots past the routed ones where the ops run them so (0: apart).
        self.shared_slots = shared_expert_slots(dims, ops, runtime)
        self.w13 = nn.Parameter(torch.empty(slots + self.shared_slots, 2 * f, h))
        self.w2 = nn.Parameter(torch.empty(slots + self.shared_slots, h, f))
        self.shared_experts = None if self.shared_slots else self._shared(dims, ops)
        runtime.add_block(self)

    @torch.no_grad()
    def init_dummy_table(self, generator: torch.Generator) -> None:
        """load_format="dummy": k distinct random experts per token id (init_dummy_weights
        leaves integer tables to their module)."""
        if not self.dims.hash_vocab:
            return
        rows, k = self.tid2eid.shape
        noise = torch.rand(rows, self.dims.router.num_experts, generator=generator,
                           device=self.tid2eid.device)
        self.tid2eid.copy_(noise.argsort(dim=1)[:, :k])

    @staticmethod
    def _shared(dims: MoEDims, ops: ModelOps) -> GatedMLP | None:
        h, width = dims.hidden_size, dims.shared_intermediate
        if not width:
            return None
        if dims.swiglu_limit is None:
            return GatedMLP(h, width, ops)
        return ClampedSharedExperts(h, width, ops, dims.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; token_ids [T], the step's input ids: read by hash-routed layers only."""
        weights, ids = self._route(x, token_ids)
        out = self.runtime.run(self.layer, x, weights, ids, self._compute)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _route(self, x: torch.Tensor, token_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        args = (self._router_logits(x), self.dims.router,
                getattr(self, "e_score_correction_bias", None), self.runtime.counts(self.layer))
        if not self.dims.hash_vocab:  # ops whose route() predates fixed_ids still work
            return self.ops.route(*args)
        if token_ids is None:
            raise ValueError(f"MoE layer {self.layer} routes by token id: pass the step's "
                             f"token_ids to forward()")
        return self.ops.route(*args, fixed_ids=self.tid2eid[token_ids.long()])

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.dims.router_fp32:
            return self.ops.linear(x.float(), self.gate.float())
        return self.ops.linear(x, self.gate)

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                 capacity: int | None = None) -> torch.Tensor:
        # Optional arguments only when set: an ops class whose fused_experts predates
        # `capacity` or `swiglu_limit` still serves the models that use neither.
        extra: dict = {} if capacity is None else {"capacity": capacity}
        if self.dims.swiglu_limit is not None:
            extra["swiglu_limit"] = self.dims.swiglu_limit
        if self.shared_slots:
            weights, slots = self._with_shared_routes(weights, slots)
        return self.ops.fused_experts(x, self.w13, self.w2, weights, slots, **extra)

    def _with_shared_routes(self, weights: torch.Tensor, slots: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's routes plus one of weight 1 to each shared-expert slot."""
        first = self.runtime.slots_per_rank
        shared = torch.arange(first, first + self.shared_slots, dtype=slots.dtype,
                              device=slots.device).expand(slots.shape[0], -1)
        return (torch.cat((weights, torch.ones(shared.shape, dtype=weights.dtype,
                                               device=weights.device)), dim=1),
                torch.cat((slots, shared), dim=1))

    # ---- weights -------------------------------------------------------------------------
    def shared_targets(self, prefix: str, proj: str) -> list[Target]:
        """A shared-expert tensor (width shared_slots x F) -> its F-wide part in each
        shared-expert slot: gate and up rows, down columns."""
        name, half = EXPERT_PROJ[proj]
        f, first = self.dims.intermediate_size, self.runtime.slots_per_rank
        rows = None if half is None else (half * f, (half + 1) * f)
        axis = 1 if half is None else 0
        return [(f"{prefix}.{name}", SlotRows(first + i, rows, (axis, i * f, (i + 1) * f)))
                for i in range(self.shared_slots)]

    def expert_targets(self, prefix: str, expert: int, proj: str) -> list[Target]:
        """A checkpoint tensor of one expert -> every local slot that holds it."""
        name, half = EXPERT_PROJ[proj]
        f = self.dims.intermediate_size
        rows = None if half is None else (half * f, (half + 1) * f)
        return [(f"{prefix}.{name}", SlotRows(slot, rows))
                for slot in self.runtime.local_slots_of(self.layer, expert)]

    @torch.no_grad()
    def move_experts(self, sources: torch.Tensor, runtime: ExpertRuntime) -> None:
        """EPLB: this rank's slots take the weights of the given old physical slots (FP8
        experts: their codes and scales, as they are)."""
        for weight in (self.w13, self.w2):
            for tensor in _slot_tensors(weight):
                everything = runtime.gather_slots(tensor)
                tensor.copy_(everything[sources.to(everything.device)])


def shared_expert_slots(dims: MoEDims, ops: ModelOps, runtime: ExpertRuntime) -> int:
    """How many expert slots a layer's shared experts take in the routed experts' stacks: their
    width in experts, where the ops run shared experts in the fused pass (MoEOps
    .fuses_shared_experts), every slot is on this rank (no exchange) and the width is whole
    experts; else 0 (a dense MLP beside the experts)."""
    f, width = dims.intermediate_size, dims.shared_intermediate
    fuses = isinstance(ops, MoEOps) and ops.fuses_shared_experts and runtime.num_ranks == 1
    return width // f if fuses and width and width % f == 0 else 0


def _slot_tensors(weight: nn.Parameter | FP8Experts) -> tuple[torch.Tensor, ...]:
    """The [S, ...] tensors of a stacked expert weight. FP8 codes travel as bytes: the
    collectives (gloo) have no float8 types."""
    if isinstance(weight, FP8Experts):
        return weight.weight.view(torch.uint8), weight.scale
    return (weight.data,)


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
    if what == "gate.tid2eid":
        return [(f"{prefix}.tid2eid", None)]
    if expert is not None:
        return block.expert_targets(prefix, int(expert), proj)
    if block.shared_slots:
        return block.shared_targets(prefix, shared)
    if shared in ("gate_proj", "up_proj"):
        rows = block.shared_experts.fused_rows(0 if shared == "gate_proj" else 1)
        return [(f"{prefix}.shared_experts.gate_up_proj.weight", rows)]
    return [(f"{prefix}.shared_experts.{shared}.weight", None)]
