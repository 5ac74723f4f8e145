"""Checkpoint tensors that arrive quantized, as the weight loader yields them.

Each knows its logical [N, K] shape, can give a range of its rows (fused projections take the
rows of several checkpoint tensors) and can dequantize itself (the reference, and the path of a
backend that does not run the format natively).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

FP8_MAX = 448.0  # the largest float8_e4m3fn value


@dataclass(frozen=True)
class GGUFTensor:
    """A weight as a .gguf file stores it: rows of quantized blocks (uint8 [N, row_bytes])."""

    blocks: torch.Tensor
    qtype: int  # GGMLQuantizationType
    shape: tuple[int, int]

    @property
    def kind(self) -> str:
        return f"gguf:{GGMLQuantizationType(self.qtype).name}"

    def rows(self, start: int, end: int) -> "GGUFTensor":
        return GGUFTensor(self.blocks[start:end], self.qtype, (end - start, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        array = gguf_dequantize(self.blocks.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(self.shape)


@dataclass(frozen=True)
class FP8BlockTensor:
    """DeepSeek's FP8 weight: float8_e4m3fn [N, K] and one inverse scale per block of
    block[0] rows x block[1] columns (`weight_scale_inv` [ceil(N/b0), ceil(K/b1)])."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = (128, 128)

    kind = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def row_scales(self) -> torch.Tensor:
        """float32 [N, ceil(K/b1)]: each row's scale per column group, so rows can be cut and
        fused at any offset."""
        n = self.weight.shape[0]
        return self.scale_inv.float().repeat_interleave(self.block[0], dim=0)[:n].contiguous()

    def rows(self, start: int, end: int) -> "RowScaledFP8":
        return RowScaledFP8(self.weight[start:end], self.row_scales()[start:end], self.block[1])

    def dequantize(self) -> torch.Tensor:
        return RowScaledFP8(self.weight, self.row_scales(), self.block[1]).dequantize()


@dataclass(frozen=True)
class RowScaledFP8:
    """float8_e4m3fn [N, K] with float32 scales [N, ceil(K/group)]: the layout the FP8 kernels
    read (w[n, k] = weight[n, k] * scale[n, k // group])."""

    weight: torch.Tensor
    scale: torch.Tensor
    group: int = 128

    kind = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def rows(self, start: int, end: int) -> "RowScaledFP8":
        return RowScaledFP8(self.weight[start:end], self.scale[start:end], self.group)

    def dequantize(self) -> torch.Tensor:
        k = self.weight.shape[1]
        scale = self.scale.float().repeat_interleave(self.group, dim=1)[:, :k]
        return self.weight.float() * scale

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = 128, block_rows: int = 1
                 ) -> "RowScaledFP8":
        """A float weight [N, K] to FP8, one scale (amax / 448) per block of block_rows rows
        (from row 0) and `group` columns, spread to every row of its block. block_rows = group
        is DeepSeek's checkpoint format, which `--quantization fp8` writes at load."""
        n, k = weight.shape
        rows = -(-n // block_rows) * block_rows
        w = torch.nn.functional.pad(weight.float(), (0, -k % group, 0, rows - n))
        blocks = w.view(rows // block_rows, block_rows, -1, group)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [row blocks, groups]
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale = scale.repeat_interleave(block_rows, dim=0)[:n].contiguous()
        return cls(q.view(rows, -1)[:n, :k].contiguous(), scale, group)


QuantizedTensor = GGUFTensor | FP8BlockTensor | RowScaledFP8
QUANTIZED_TYPES = (GGUFTensor, FP8BlockTensor, RowScaledFP8)


def narrow(tensor: torch.Tensor | QuantizedTensor, axis: int, start: int, end: int
           ) -> torch.Tensor | QuantizedTensor:
    """Part [start, end) of a 2-D checkpoint tensor along `axis`. Packed rows stay packed; FP8
    columns too (codes and their scales as they are) where the part starts on a scale block;
    other packed columns are dequantized first."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(axis, start, end - start)
    if axis == 0:
        return tensor.rows(start, end)
    if isinstance(tensor, FP8BlockTensor) and start % tensor.block[1] == 0:
        b = tensor.block[1]
        return FP8BlockTensor(tensor.weight[:, start:end],
                              tensor.scale_inv[:, start // b:-(-end // b)], tensor.block)
    return tensor.dequantize().narrow(axis, start, end - start)
