"""Checkpoint tensors into a model's parameters. Each model maps its own checkpoint names
(`checkpoint_target`); this module only reads safetensors and copies."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn


@dataclass(frozen=True)
class SlotRows:
    """One expert slot of a stacked [S, ...] expert parameter, and rows [start, end) within it
    (None: all of them)."""

    slot: int
    rows: tuple[int, int] | None = None


# checkpoint name -> (parameter name, rows [start, end) of it, an expert slot's rows, or None
# for all of it); a list when the tensor has several places (an expert replicated on this
# rank), [] or None to skip
Target = tuple[str, tuple[int, int] | SlotRows | None]
Mapper = Callable[[str], Target | list[Target] | None]


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_mapped(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                mapper: Mapper) -> None:
    """Copy every mapped checkpoint tensor into its parameter (or its rows of a fused one);
    every parameter must be written, and every tensor must have a place."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            targets = mapper(name)
            for param_name, where in [targets] if isinstance(targets, tuple) else targets or []:
                if param_name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                dest = _destination(params[param_name], where)
                if dest.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape "
                                     f"{tuple(tensor.shape)}, the model expects "
                                     f"{tuple(dest.shape)}")
                dest.copy_(tensor)
                loaded.add(param_name)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


def _destination(param: torch.Tensor, where: tuple[int, int] | SlotRows | None) -> torch.Tensor:
    if isinstance(where, SlotRows):
        param, where = param[where.slot], where.rows
    return param if where is None else param[where[0]:where[1]]


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, made where the model lives: norm scales 1, the rest N(0, std).

    For benchmarks of a model shape (`load_format="dummy"`): the step costs the same as with
    the real checkpoint, and a 16 GB model needs no 16 GB download."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.dtype.is_floating_point:
                continue  # tables (a hash router's token -> experts): their modules fill them
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            elif param.dim() == 1:  # biases
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
        for module in model.modules():
            if hasattr(module, "init_dummy_table"):
                module.init_dummy_table(generator)
