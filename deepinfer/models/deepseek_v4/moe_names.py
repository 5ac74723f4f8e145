"""DeepSeek-V4's MoE checkpoint names -> the names models/moe/layer.py loads
(`layers.{i}.mlp.gate.weight`, `.mlp.experts.{e}.w1.weight`, ...).

Two spellings reach us:
- DeepSeek's own, in the released checkpoints and in what transformers' save_pretrained writes
  back: `layers.{i}.ffn.gate.weight`, `.ffn.gate.bias` (the score correction bias),
  `.ffn.gate.tid2eid` (hash layers' token id -> experts table), `.ffn.experts.{e}.w1|w3|w2.weight`
  (gate, up, down) and `.ffn.shared_experts.w1|w3|w2.weight`;
- transformers' modules (a state_dict): `layers.{i}.mlp.gate.weight`,
  `.mlp.gate.e_score_correction_bias`, `.mlp.gate.tid2eid`, every expert in one tensor,
  `.mlp.experts.gate_up_proj [E, 2F, H]` (gate rows then up rows) and
  `.mlp.experts.down_proj [E, H, F]`, and `.mlp.shared_experts.gate_proj|up_proj|down_proj.weight`.

`moe_tensors` renames the first and unpacks the second, one tensor per expert, so that every
expert loads into the slots that hold it (moe_checkpoint_target), as for the other families.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from deepinfer.models.moe.layer import moe_checkpoint_target
from deepinfer.models.weight_targets import Target

_DEEPSEEK = re.compile(r"(.*\blayers\.\d+\.)ffn\.(gate\.weight|gate\.bias|gate\.tid2eid|"
                       r"experts\.\d+\.w[123]\.weight|shared_experts\.w[123]\.weight)$")
_PACKED = re.compile(r"(.*\blayers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_SHARED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_name(name: str) -> str:
    """A DeepSeek-spelled MoE tensor name -> the transformers spelling layer.py reads (routed
    experts keep w1/w2/w3, which it knows); any other name unchanged."""
    match = _DEEPSEEK.match(name)
    if match is None:
        return name
    prefix, rest = match.groups()
    if rest == "gate.bias":
        rest = "gate.e_score_correction_bias"
    elif rest.startswith("shared_experts."):
        proj = rest.split(".")[1]
        rest = f"shared_experts.{_SHARED[proj]}.weight"
    return f"{prefix}mlp.{rest}"


def moe_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint with its MoE tensors renamed (moe_name) and transformers' packed experts
    split one per expert; every other tensor passes through as it is."""
    for name, tensor in weights:
        packed = _PACKED.match(name)
        if packed is None:
            yield moe_name(name), tensor
        else:
            yield from _unpack(packed.group(1), packed.group(2), tensor)


def _unpack(prefix: str, what: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """gate_up_proj [E, 2F, H] -> each expert's gate_proj and up_proj [F, H];
    down_proj [E, H, F] -> each expert's down_proj [H, F]."""
    for expert, weight in enumerate(tensor.unbind(0)):
        if what == "down_proj":
            yield f"{prefix}{expert}.down_proj.weight", weight
        else:
            gate, up = weight.chunk(2, dim=0)
            yield f"{prefix}{expert}.gate_proj.weight", gate
            yield f"{prefix}{expert}.up_proj.weight", up


def moe_target(layers: nn.ModuleList, name: str) -> list[Target] | None:
    """A name from moe_tensors (with or without "model.") -> its places in the model's MoE
    layers (each layer's MoEBlock is its `mlp`); None if not an MoE tensor."""
    return moe_checkpoint_target(layers, name.removeprefix("model."))
