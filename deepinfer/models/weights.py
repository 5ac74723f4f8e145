"""Checkpoint tensors into a model's parameters. Each model maps its own checkpoint names
(`checkpoint_target`); this module only reads safetensors and copies."""
from __future__ import annotations

import glob
import os
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

# checkpoint name -> (parameter name, rows [start, end) of it or None for all), None to skip
Target = tuple[str, tuple[int, int] | None]
Mapper = Callable[[str], Target | None]


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
            target = mapper(name)
            if target is None:
                continue
            param_name, rows = target
            if param_name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            dest = params[param_name] if rows is None else params[param_name][rows[0]:rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(param_name)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, made where the model lives: norm scales 1, the rest N(0, std).

    For benchmarks of a model shape (`load_format="dummy"`): the step costs the same as with
    the real checkpoint, and a 16 GB model needs no 16 GB download."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            elif param.dim() == 1:  # biases
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
