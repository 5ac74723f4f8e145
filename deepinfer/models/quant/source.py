"""Where a model's weights are read from, and what kind each checkpoint tensor is.

An HF folder's safetensors (float, or FP8 with block scales), or, for a converted GGUF folder
on a backend that runs GGUF blocks, the kept source file. `quantization="none"` always reads
the safetensors and dequantizes whatever is quantized.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from deepinfer.models.gguf_checkpoint import gguf_kinds, gguf_source, iter_gguf
from deepinfer.models.quant.tensors import QuantizedTensor
from deepinfer.models.weights import checkpoint_kinds, iter_checkpoint


@dataclass(frozen=True)
class CheckpointSource:
    path: str
    from_gguf: bool
    fp8_block: tuple[int, int] = (128, 128)

    def kinds(self) -> dict[str, str]:
        return gguf_kinds(self.path) if self.from_gguf else checkpoint_kinds(self.path)

    def tensors(self, packed_kinds: Iterable[str]
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        if self.from_gguf:
            return iter_gguf(self.path, packed_kinds)
        return iter_checkpoint(self.path, self.fp8_block)


def checkpoint_source(path: str, config: Any, mode: str, runs: Iterable[str]
                      ) -> CheckpointSource:
    gguf = mode != "none" and gguf_source(path) is not None
    native = gguf and any(kind.startswith("gguf:") for kind in runs)
    return CheckpointSource(path, native, _fp8_block(config))


def _fp8_block(config: Any) -> tuple[int, int]:
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    if quant and quant.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config {quant.get('quant_method')!r} is not supported; "
                         f"FP8 checkpoints with block scales (quant_method 'fp8') are")
    block = quant.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])
