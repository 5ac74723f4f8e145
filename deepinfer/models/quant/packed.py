"""Modules that hold a quantized weight inside a model.

A PackedWeight takes the place of an nn.Linear's `weight` (or of an embedding table): the model
still calls ops.linear(x, self.proj.weight), and the backend's ops see the packed weight and
run their kernel for its format. Built on the meta device with the rest of the model; to_empty
allocates the buffers and the loader fills them with load_rows.
"""
from __future__ import annotations

from abc import ABCMeta, abstractmethod

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from deepinfer.models.quant.tensors import GGUFTensor, QuantizedTensor, RowScaledFP8



class PackedWeight(nn.Module, metaclass=ABCMeta):
    """A linear weight [N, K] kept quantized; `kind` names the format ("gguf:Q4_1", "fp8")."""

    kind: str

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = torch.Size(shape)

    @abstractmethod
    def load_rows(self, tensor: torch.Tensor | QuantizedTensor,
                  rows: tuple[int, int] | None) -> None:
        """Rows [start, end) of the weight (all of it for None) from a checkpoint tensor."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (the reference; backends without a kernel for the format)."""

    @abstractmethod
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [T, K] (an embedding table kept packed)."""

    @abstractmethod
    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Random weights for load_format="dummy" (benchmarks of a model shape)."""

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={tuple(self.shape)}"


class GGUFWeight(PackedWeight):
    """GGUF blocks as the file stores them: uint8 [N, K/values * block bytes] (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0; Q4_K, Q5_K, Q6_K)."""

    def __init__(self, shape: tuple[int, int], qtype: int) -> None:
        super().__init__(shape)
        kind = GGMLQuantizationType(qtype)
        values, nbytes = GGML_QUANT_SIZES[kind]
        self.qtype = qtype
        self.kind = f"gguf:{kind.name}"
        self.register_buffer("blocks", torch.empty(shape[0], shape[1] // values * nbytes,
                                                   dtype=torch.uint8))

    def load_rows(self, tensor: torch.Tensor | QuantizedTensor,
                  rows: tuple[int, int] | None) -> None:
        if not isinstance(tensor, GGUFTensor) or tensor.qtype != self.qtype:
            raise TypeError(f"a {self.kind} weight loads GGUF blocks of its own type, not "
                            f"{getattr(tensor, 'kind', tensor.dtype)}")
        start, end = rows or (0, self.shape[0])
        self.blocks[start:end].copy_(tensor.blocks)

    def dequantize(self) -> torch.Tensor:
        return GGUFTensor(self.blocks.cpu(), self.qtype, tuple(self.shape)).dequantize()

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        # Only a checkpoint's own blocks are kept packed: with load_format="dummy" there is
        # no checkpoint, so plan_packed never makes a GGUFWeight.
        raise ValueError("GGUF blocks come from a .gguf file; load_format='dummy' makes none")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1)).cpu()
        return GGUFTensor(rows, self.qtype, (rows.shape[0], self.shape[1])).dequantize()


class FP8Weight(PackedWeight):
    """float8_e4m3fn [N, K] with float32 scales per row and 128-column group [N, ceil(K/128)];
    loads DeepSeek's block-scaled tensors, or quantizes a float weight in DeepSeek's 128 x 128
    blocks (--quantization fp8). kernel_scale: the scales again in the layout a backend's GEMM
    reads, set by the backend once the weights are loaded (ModelOps.prepare_weights)."""

    kind = "fp8"
    group = 128

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__(shape)
        n, k = shape
        self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty(n, -(-k // self.group), dtype=torch.float32))
        self.kernel_scale: torch.Tensor | None = None

    def load_rows(self, tensor: torch.Tensor | QuantizedTensor,
                  rows: tuple[int, int] | None) -> None:
        if isinstance(tensor, torch.Tensor):
            tensor = RowScaledFP8.quantize(tensor, self.group, block_rows=self.group)
        if getattr(tensor, "kind", None) != "fp8":
            raise TypeError(f"an fp8 weight loads FP8 or float tensors, not {tensor.kind}")
        part = tensor.rows(0, tensor.shape[0])
        if part.group != self.group:  # other block widths: regrouped for the kernels
            part = RowScaledFP8.quantize(part.dequantize(), self.group)
        start, end = rows or (0, self.shape[0])
        self.weight[start:end].copy_(part.weight)
        self.scale[start:end].copy_(part.scale)
        self.kernel_scale = None  # made again from the new scales by prepare_weights

    def dequantize(self) -> torch.Tensor:
        return RowScaledFP8(self.weight, self.scale, self.group).dequantize()

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        w = torch.empty(self.shape, device=self.weight.device).normal_(0.0, std,
                                                                       generator=generator)
        self.load_rows(w, None)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        return RowScaledFP8(self.weight[ids], self.scale[ids], self.group).dequantize()


class PackedEmbedding(nn.Module):
    """An embedding table kept packed (a GGUF token_embd, tied to the LM head)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight = weight
        # An empty float buffer: model.to(dtype) converts it, so it carries the dtype the rows
        # are served in without a reference to the rest of the model.
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.lookup(ids).to(self.dtype_probe.dtype)
        return rows.view(*ids.shape, self.weight.shape[1])
