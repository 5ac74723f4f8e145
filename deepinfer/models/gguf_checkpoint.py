"""A converted GGUF folder's weights read from its source file, blocks kept as stored.

gguf_convert.py writes a dequantized safetensors copy (what transformers and backends without
GGUF kernels load) and keeps the source as model.gguf. A backend that runs some block types
natively (the CPU backend: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K) loads from the
source instead: those tensors arrive as GGUFTensor blocks, with llama.cpp's q/k row order
undone on whole rows, and the rest dequantized as the converter does.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch
from gguf import GGMLQuantizationType

from deepinfer.models.gguf_convert import indexed_plan
from deepinfer.models.gguf_folder import GGUF_FILE, GGUF_INDEX_FILE
from deepinfer.models.quant.tensors import GGUFTensor


def gguf_source(folder: str) -> str | None:
    """The folder's source GGUF, if it kept one (with the index of its tensors)."""
    path = os.path.join(folder, GGUF_FILE)
    indexed = os.path.isfile(os.path.join(folder, GGUF_INDEX_FILE))
    return path if indexed and os.path.isfile(path) else None


def gguf_kinds(folder: str) -> dict[str, str]:
    """HF tensor name -> "gguf:<type>" for quantized 2-D tensors, else "float"."""
    return {t.name: _kind(t.source.tensor_type, len(t.shape)) for t in indexed_plan(folder)}


def _kind(qtype: int, ndim: int) -> str:
    kind = GGMLQuantizationType(qtype)
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    return "float" if kind in floats or ndim != 2 else f"gguf:{kind.name}"


def iter_gguf(folder: str, packed_kinds: Iterable[str]
              ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(HF name, tensor): blocks as stored for the kinds in packed_kinds, else float32."""
    keep = frozenset(int(GGMLQuantizationType[k.removeprefix("gguf:")])
                     for k in packed_kinds if k.startswith("gguf:"))
    for tensor in indexed_plan(folder):
        yield tensor.name, tensor.packed(keep)
