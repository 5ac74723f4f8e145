"""Checkpoint tensors into a model's parameters. Each model maps its own checkpoint names
(`checkpoint_target`); this module only reads safetensors and copies.

FP8 weights (float8_e4m3fn with a `weight_scale_inv` of one scale per block, DeepSeek's release
format) come out of iter_checkpoint as one FP8BlockTensor each. A destination that keeps them
packed (a PackedWeight, models/quant) takes them as they are; a plain parameter gets them
dequantized.
"""
from __future__ import annotations

import glob
import os
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from deepinfer.models.quant.packed import PackedWeight
from deepinfer.models.quant.tensors import (
    QUANTIZED_TYPES,
    FP8BlockTensor,
    QuantizedTensor,
    narrow,
)
from deepinfer.models.weight_targets import Mapper, SlotRows


class Embedding(nn.Embedding):
    """nn.Embedding without the random init: models are built on the meta device and their
    weights then come from the checkpoint (or init_dummy_weights). On the meta device that
    init is normal_, whose reference implementation imports torch._dynamo: seconds of every
    process start (each rank, and the API process that reads a checkpoint's KV spec)."""

    def reset_parameters(self) -> None:
        pass


# The names an FP8 weight's block scales go by: DeepSeek's, and compressed-tensors'.
_SCALE_SUFFIXES = ("_scale_inv", "_scale")


def _files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _index(path: str) -> dict[str, tuple[str, str]]:
    """Every tensor's name -> (file, safetensors dtype), from the headers alone."""
    index = {}
    for file in _files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                index[name] = (file, f.get_slice(name).get_dtype())
    return index


def _scale_name(name: str, index: dict[str, tuple[str, str]]) -> str | None:
    """The block-scale tensor of an FP8 weight, if `name` is one."""
    if not index[name][1].startswith("F8"):
        return None
    return next((name + s for s in _SCALE_SUFFIXES if name + s in index), None)


def _get(f, file: str, index: dict[str, tuple[str, str]], name: str) -> torch.Tensor:
    """A tensor from the open file, or from the one its index names (a scale saved in
    another shard than its weight)."""
    if index[name][0] == file:
        return f.get_tensor(name)
    with safe_open(index[name][0], framework="pt") as g:
        return g.get_tensor(name)


def checkpoint_kinds(path: str) -> dict[str, str]:
    """Every checkpoint tensor (scales folded into their weights) -> "fp8" or "float"."""
    index = _index(path)
    scales = {_scale_name(n, index) for n in index} - {None}
    return {n: "fp8" if _scale_name(n, index) else "float" for n in index if n not in scales}


def iter_checkpoint(path: str, fp8_block: tuple[int, int] = (128, 128)
                    ) -> Iterator[tuple[str, torch.Tensor | FP8BlockTensor]]:
    index = _index(path)
    scales = {_scale_name(n, index) for n in index} - {None}
    for file in _files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in scales:
                    continue
                scale = _scale_name(name, index)
                if scale is None:
                    yield name, f.get_tensor(name)
                    continue
                yield name, FP8BlockTensor(f.get_tensor(name), _get(f, file, index, scale),
                                           fp8_block)


def load_mapped(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                mapper: Mapper) -> None:
    """Copy every mapped checkpoint tensor into its parameter (or its rows of a fused one);
    every parameter must be written, and every tensor must have a place."""
    params: dict[str, torch.Tensor | PackedWeight] = dict(model.named_parameters())
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedWeight)}
    # A packed weight made of packed parts (GGUFParts) loads them itself.
    parts = {f"{n}.{sub}" for n, m in packed.items() for sub, _ in m.named_modules() if sub}
    params.update((n, m) for n, m in packed.items() if n not in parts)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            targets = mapper(name)
            for param_name, where in [targets] if isinstance(targets, tuple) else targets or []:
                if param_name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                _copy(name, tensor, params[param_name], where)
                loaded.add(param_name)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


def _copy(name: str, tensor: torch.Tensor | QuantizedTensor, param: torch.Tensor | PackedWeight,
          where: tuple[int, int] | SlotRows | None) -> None:
    if isinstance(where, SlotRows) and where.source is not None:
        tensor = narrow(tensor, *where.source)
    if isinstance(param, PackedWeight):
        _check_shape(name, tensor.shape, param.part_shape(where))
        param.load_rows(tensor, where)
        return
    dest = _destination(param, where)
    _check_shape(name, tensor.shape, dest.shape)
    dest.copy_(tensor.dequantize() if isinstance(tensor, QUANTIZED_TYPES) else tensor)


def _check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model "
                         f"expects {tuple(expected)}")


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
            if isinstance(module, PackedWeight):
                module.init_dummy(generator, std)
