"""Which of a model's weights stay packed, and the swap of those into PackedWeight modules.

The plan is made on the meta-device model before its memory exists: every checkpoint tensor's
kind ("float", "gguf:Q4_1", "fp8") is mapped through the model's own checkpoint names onto its
parameters. A linear or embedding weight (or an MoE layer's stacked experts, FP8 only) stays
packed when all of its sources share one kind that the backend runs, or (a fused linear
weight) when they are GGUF types the backend runs, each row range in its own (GGUFParts);
everything else is dequantized as it loads. With `quantization="fp8"` the float linear
weights and experts of the decoder layers are quantized to FP8 at load as well.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

import torch
from gguf import GGMLQuantizationType
from torch import nn

from deepinfer.core.config import QUANTIZATION_MODES
from deepinfer.models.quant.packed import (
    FP8Experts,
    FP8Weight,
    GGUFParts,
    GGUFWeight,
    PackedEmbedding,
    PackedWeight,
    gguf_parts_kind,
    parse_gguf_parts,
)
from deepinfer.models.weight_targets import Mapper


def plan_packed(model: nn.Module, kinds: Mapping[str, str], mapper: Mapper,
                runs: Iterable[str], mode: str = "auto") -> dict[str, str]:
    """Parameter name -> the packed kind it is held in."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    runs = set(runs)
    if mode == "none":
        return {}
    if mode == "fp8" and "fp8" not in runs:
        raise ValueError("quantization 'fp8' needs a backend with FP8 kernels (nvidia); this "
                         "backend runs " + (", ".join(sorted(runs)) or "no packed weights"))
    sources = _sources(kinds, mapper)
    plan = {}
    for name, module in _packable(model):
        found = {kind for _, kind in sources.get(name, [])}
        kind = next(iter(found)) if len(found) == 1 else None
        stacked = not isinstance(module, (nn.Linear, nn.Embedding))  # experts: FP8 only
        parts = _gguf_parts(sources.get(name, []), module, runs) if len(found) > 1 else None
        if kind not in (None, "float") and kind in runs and (kind == "fp8" or not stacked):
            plan[name] = kind
        elif parts is not None:
            plan[name] = gguf_parts_kind(parts)
        elif mode == "fp8" and not isinstance(module, nn.Embedding) \
                and name.startswith("layers."):
            plan[name] = "fp8"
    return plan


def _sources(kinds: Mapping[str, str], mapper: Mapper) -> dict[str, list[tuple[Any, str]]]:
    """Parameter name -> (where, kind) of each checkpoint tensor that loads into it."""
    found: dict[str, list[tuple[Any, str]]] = defaultdict(list)
    for name, kind in kinds.items():
        targets = mapper(name)
        for param, where in [targets] if isinstance(targets, tuple) else targets or []:
            found[param].append((where, kind))
    return found


def _gguf_parts(sources: list[tuple[Any, str]], module: nn.Module, runs: set[str]
                ) -> list[tuple[int, int, int]] | None:
    """A fused linear weight loaded from GGUF tensors of several block types the backend
    runs, as (start, end, qtype) row ranges (neighbours of one type merged); else None."""
    if not isinstance(module, nn.Linear) or \
            not all(isinstance(w, tuple) and k.startswith("gguf:") and k in runs
                    for w, k in sources):
        return None
    parts: list[tuple[int, int, int]] = []
    for (start, end), kind in sorted(sources):
        qtype = int(GGMLQuantizationType[kind.removeprefix("gguf:")])
        if parts and parts[-1][1] != start:
            return None  # rows no tensor loads, or loaded twice
        if parts and parts[-1][2] == qtype:
            parts[-1] = (parts[-1][0], end, qtype)
        else:
            parts.append((start, end, qtype))
    covered = parts and parts[0][0] == 0 and parts[-1][1] == module.weight.shape[0]
    return parts if covered else None


def _packable(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """(parameter name, its module): linear and embedding weights, and the stacked expert
    weights a module lists in `packable_experts`."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            yield f"{name}.weight", module
        for attr in getattr(module, "packable_experts", ()):
            yield f"{name}.{attr}", module


def apply_plan(model: nn.Module, plan: Mapping[str, str],
               make: Callable[[str, tuple[int, ...]], PackedWeight] | None = None) -> None:
    """Swap each planned weight for its PackedWeight (an embedding for a PackedEmbedding)."""
    make = make or packed_weight
    for name, kind in plan.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        weight = make(kind, tuple(getattr(owner, attr).shape))
        if isinstance(owner, nn.Embedding):
            parent_name, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, PackedEmbedding(weight))
        else:
            del owner._parameters[attr]
            setattr(owner, attr, weight)  # registered as a submodule: its buffers load and move


def packed_weight(kind: str, shape: tuple[int, ...]) -> PackedWeight:
    if kind == "fp8":
        return FP8Experts(shape) if len(shape) == 3 else FP8Weight(shape)
    parts = parse_gguf_parts(kind)
    if parts is not None:
        return GGUFParts(shape, parts)
    if kind.startswith("gguf:"):  # a type the backend's packed_kinds lists
        return GGUFWeight(shape, int(GGMLQuantizationType[kind.removeprefix("gguf:")]))
    raise ValueError(f"no packed weight for {kind!r}")


def cast_unpacked(model: nn.Module, dtype: torch.dtype) -> None:
    """model.to(dtype) but for packed weights, whose dtypes are their format (float8 codes
    and float32 scales stay as they are)."""
    for module in model.modules():
        if isinstance(module, PackedWeight):
            continue
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_floating_point():
                    if isinstance(tensor, nn.Parameter):
                        tensor.data = tensor.data.to(dtype)
                    else:
                        table[name] = tensor.to(dtype)
