"""Modules that hold a quantized weight inside a model.

A PackedWeight takes the place of an nn.Linear's `weight` (or of an embedding table, or of an
MoE layer's stacked experts): the model still calls ops.linear(x, self.proj.weight) (or
ops.fused_experts), and the backend's ops see the packed weight and run their kernel for its
format. Built on the meta device with the rest of the model; to_empty
allocates the buffers and the loader fills them with load_rows.
"""
from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Iterable, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from deepinfer.models.quant.tensors import GGUFTensor, QuantizedTensor, RowScaledFP8

if TYPE_CHECKING:
    from deepinfer.models.weight_targets import SlotRows


class PackedWeight(nn.Module, metaclass=ABCMeta):
    """A linear weight [N, K] kept quantized (FP8Experts: an MoE layer's stacked experts);
    `kind` names the format ("gguf:Q4_1", "fp8")."""

    kind: str

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = torch.Size(shape)

    @abstractmethod
    def load_rows(self, tensor: torch.Tensor | QuantizedTensor,
                  rows: tuple[int, int] | None) -> None:
        """Rows [start, end) of the weight (all of it for None) from a checkpoint tensor."""

    def part_shape(self, rows: tuple[int, int] | None) -> tuple[int, ...]:
        """The shape of the checkpoint tensor that load_rows takes for these rows."""
        start, end = rows or (0, self.shape[0])
        return end - start, self.shape[1]

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
    Q5_0, Q5_1, Q8_0; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). A backend may store the same bytes with
    the rows interleaved in groups (interleave_rows; `interleaved` says the group, 0 for the file's
    layout): block b of a group's rows side by side, in 2-byte units, so that one vector lane
    follows one row (the CPU's batch-1 GEMV, backends/cpu/gguf_rows8.cpp)."""

    def __init__(self, shape: tuple[int, int], qtype: int) -> None:
        super().__init__(shape)
        kind = GGMLQuantizationType(qtype)
        values, nbytes = GGML_QUANT_SIZES[kind]
        self.qtype, self.block_bytes = qtype, nbytes
        self.kind = f"gguf:{kind.name}"
        self.interleaved = 0
        self.register_buffer("blocks", torch.empty(shape[0], shape[1] // values * nbytes,
                                                   dtype=torch.uint8))

    def load_rows(self, tensor: torch.Tensor | QuantizedTensor,
                  rows: tuple[int, int] | None) -> None:
        if not isinstance(tensor, GGUFTensor) or tensor.qtype != self.qtype:
            raise TypeError(f"a {self.kind} weight loads GGUF blocks of its own type, not "
                            f"{getattr(tensor, 'kind', tensor.dtype)}")
        self.interleave_rows(0)  # rows land in the file's layout; a backend interleaves again
        start, end = rows or (0, self.shape[0])
        self.blocks[start:end].copy_(tensor.blocks)

    def interleave_rows(self, group: int) -> None:
        """Store the blocks with the rows interleaved in groups of `group` (0: the file's
        layout), in place: [N/g, g, B, S/2, 2] 2-byte units -> [N/g, B, S/2, g, 2]."""
        if group == self.interleaved:
            return
        file_layout = self.file_blocks()
        if group:
            units = file_layout.view(-1, group, self._num_blocks(), self.block_bytes // 2, 2)
            file_layout = units.permute(0, 2, 3, 1, 4).reshape(self.blocks.shape)
        self.blocks.copy_(file_layout)
        self.interleaved = group

    def file_blocks(self, groups: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks in the file's layout: every row, or (interleaved) the rows of these row
        groups."""
        g = self.interleaved
        if not g:
            return self.blocks
        units = self.blocks.view(-1, self._num_blocks(), self.block_bytes // 2, g, 2)
        if groups is not None:
            units = units[groups]
        return units.permute(0, 3, 1, 2, 4).reshape(-1, self.blocks.shape[1])

    def _num_blocks(self) -> int:
        return self.blocks.shape[1] // self.block_bytes

    def dequantize(self) -> torch.Tensor:
        return GGUFTensor(self.file_blocks().cpu(), self.qtype, tuple(self.shape)).dequantize()

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        # Only a checkpoint's own blocks are kept packed: with load_format="dummy" there is
        # no checkpoint, so plan_packed never makes a GGUFWeight.
        raise ValueError("GGUF blocks come from a .gguf file; load_format='dummy' makes none")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        ids, g = ids.reshape(-1), self.interleaved
        if g:  # each id's row group, restored; then the id's row in it
            groups = self.file_blocks(ids // g)
            rows = groups[torch.arange(ids.numel(), device=ids.device) * g + ids % g]
        else:
            rows = self.blocks.index_select(0, ids)
        rows = rows.cpu()
        return GGUFTensor(rows, self.qtype, (rows.shape[0], self.shape[1])).dequantize()


class GGUFParts(PackedWeight):
    """A fused weight whose row ranges come from GGUF tensors of different block types (a
    Q4_K_M file's q|k|v: q and k in Q4_K, v in Q6_K), each range kept as a GGUFWeight of its
    own type: a projection is their GEMVs side by side. `parts`: (start, end, qtype) row
    ranges covering the weight in order; the kind names them, as gguf_parts_kind writes it."""

    def __init__(self, shape: tuple[int, int], parts: Sequence[tuple[int, int, int]]) -> None:
        super().__init__(shape)
        if [p[0] for p in parts[1:]] != [p[1] for p in parts[:-1]] or not parts \
                or parts[0][0] != 0 or parts[-1][1] != shape[0]:
            raise ValueError(f"parts {list(parts)} do not cover rows [0, {shape[0]}) in order")
        self.bounds = [(start, end) for start, end, _ in parts]
        self.parts = nn.ModuleList(GGUFWeight((end - start, shape[1]), qtype)
                                   for start, end, qtype in parts)
        self.kind = gguf_parts_kind(parts)

    def load_rows(self, tensor: torch.Tensor | QuantizedTensor,
                  rows: tuple[int, int] | None) -> None:
        for (start, end), part in zip(self.bounds, self.parts):
            if rows is not None and start <= rows[0] and rows[1] <= end:
                part.load_rows(tensor, None if rows == (start, end) else
                               (rows[0] - start, rows[1] - start))
                return
        raise ValueError(f"rows {rows} are not within one part of {self.kind}")

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        raise ValueError("GGUF blocks come from a .gguf file; load_format='dummy' makes none")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a fused weight of several GGUF types is not an embedding table")


def gguf_parts_kind(parts: Sequence[tuple[int, int, int]]) -> str:
    """"gguf:Q4_K[0:576]+Q6_K[576:768]": the row ranges of a GGUFParts and their types."""
    return "gguf:" + "+".join(f"{GGMLQuantizationType(q).name}[{start}:{end}]"
                              for start, end, q in parts)


def parse_gguf_parts(kind: str) -> list[tuple[int, int, int]] | None:
    """gguf_parts_kind's inverse (None for any other kind)."""
    if not kind.startswith("gguf:") or "[" not in kind:
        return None
    parts = []
    for item in kind.removeprefix("gguf:").split("+"):
        name, _, span = item.partition("[")
        start, end = span.removesuffix("]").split(":")
        parts.append((int(start), int(end), int(GGMLQuantizationType[name])))
    return parts


def gguf_block_kinds(kinds: Iterable[str]) -> set[str]:
    """The GGUF block types ("gguf:<type>") that packed weights of these kinds load."""
    out = set()
    for kind in kinds:
        parts = parse_gguf_parts(kind)
        out.update([kind] if parts is None else
                   (f"gguf:{GGMLQuantizationType(q).name}" for _, _, q in parts))
    return out


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
        part = fp8_rows(tensor, self.group)
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


class FP8Experts(PackedWeight):
    """An MoE layer's stacked expert weights [S, N, K] (w13 or w2, one row block per expert
    slot) in FP8: float8_e4m3fn codes and float32 scales [S, N, ceil(K/128)], FP8Weight's
    layout for each slot, which the fused MoE kernels read as they are. Checkpoints name
    experts one by one: each expert's tensor (or its gate or up half) loads into rows of one
    slot (weights.SlotRows). EPLB moves slots as they are, codes and scales."""

    kind = "fp8"
    group = 128

    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__(shape)
        s, n, k = shape
        self.register_buffer("weight", torch.empty(s, n, k, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty(s, n, -(-k // self.group),
                                                  dtype=torch.float32))

    def part_shape(self, where: SlotRows) -> tuple[int, ...]:
        start, end = where.rows or (0, self.shape[1])
        return end - start, self.shape[2]

    def load_rows(self, tensor: torch.Tensor | QuantizedTensor, where: SlotRows) -> None:
        self._store(where.slot, where.rows, fp8_rows(tensor, self.group))

    def _store(self, slot: int, rows: tuple[int, int] | None, part: RowScaledFP8) -> None:
        start, end = rows or (0, self.shape[1])
        self.weight[slot, start:end].copy_(part.weight)
        self.scale[slot, start:end].copy_(part.scale)

    def dequantize(self) -> torch.Tensor:
        s, n, k = self.shape
        flat = RowScaledFP8(self.weight.reshape(s * n, k), self.scale.reshape(s * n, -1),
                            self.group)
        return flat.dequantize().view(s, n, k)

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        for slot in range(self.shape[0]):  # a slot at a time: one slot's float32 at most
            w = torch.empty(self.shape[1:], device=self.weight.device)
            self._store(slot, None, fp8_rows(w.normal_(0.0, std, generator=generator),
                                             self.group))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("expert weights are not an embedding table")


def fp8_rows(tensor: torch.Tensor | QuantizedTensor, group: int) -> RowScaledFP8:
    """A checkpoint tensor as FP8 rows with `group`-column scales: FP8 as it is (regrouped if
    its blocks are another width), anything else (float, a GGUF quant) quantized in
    DeepSeek's group x group blocks (--quantization fp8)."""
    if not isinstance(tensor, torch.Tensor) and tensor.kind != "fp8":
        tensor = tensor.dequantize()  # another format (a GGUF quant) requantized to FP8
    if isinstance(tensor, torch.Tensor):
        return RowScaledFP8.quantize(tensor, group, block_rows=group)
    part = tensor.rows(0, tensor.shape[0])
    if part.group != group:  # other block widths: regrouped for the kernels
        part = RowScaledFP8.quantize(part.dequantize(), group)
    return part


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
