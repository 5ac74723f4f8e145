"""The CPU backend's model ops: the torch references (backends/torch/ops.py), with float32
norms, rotary and decode attention in single C++ calls where the extension built (kernels.py),
and GGUF weights kept packed."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from deepinfer.backends.cpu import decode_plan
from deepinfer.backends.cpu.kernels import (
    GGUF_KINDS,
    INTERLEAVE,
    MAX_GEMV_ROWS,
    extension,
    fusable,
    gguf_linear,
    interleaves,
    native_bf16_gemm,
)
from deepinfer.backends.torch.attention import PagedAttentionMeta, attend_cached
from deepinfer.backends.torch.ops import ReferenceMLAOps, ReferenceOps
from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.models.deepseek_v4.ops import DeepSeekV4Ops
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.ops import QKNorm
from deepinfer.models.quant.packed import GGUFParts, GGUFWeight, PackedWeight

log = logging.getLogger(__name__)
Rotary = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (positions, cos, sin)


class CPUOps(ReferenceMLAOps, MoEOps, DeepSeekV4Ops, ReferenceOps):
    """The reference ops, every family's; GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights and the
    k-quants Q4_K/Q5_K/Q6_K stay packed (gguf_kernels.cpp, gguf_kquants.cpp)."""

    def __init__(self, cache: PagedCache) -> None:
        super().__init__(cache)
        self.kernels = _load_kernels()
        # GGUF blocks stay packed only where their kernels built.
        self.packed_kinds = GGUF_KINDS if self.kernels is not None else ()
        # A prefill's GGUF GEMMs in bfloat16 where the CPU has it (kernels.native_bf16_gemm).
        self.bf16_gemm = native_bf16_gemm()
        # decode_plan.build's plan per decoder stack (None: the stack runs layer by layer),
        # with the cache tensors it was built over.
        self._plans: dict[int, tuple[Any, tuple[torch.Tensor, ...]]] = {}

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """GGUF weights the batch-1 GEMV reads faster with their rows interleaved are stored so
        (the same bytes, reordered in place: gguf_rows8.cpp)."""
        if self.kernels is None:
            return
        for module in model.modules():
            if isinstance(module, GGUFWeight) and interleaves(module):
                module.interleave_rows(INTERLEAVE)
        self._plans.clear()  # a plan holds the weights it was built over

    def decoder_layers(self, layers: Sequence[torch.nn.Module], positions: torch.Tensor,
                       hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step (up to MAX_GEMV_ROWS sequences, one token each) through a plain llama
        stack in float32: the layers' native ops called from C++ (decode_plan.py), the same
        results as layer by layer. A subclass may override any of those ops, so it runs its
        layers itself."""
        if hidden.shape[0] > MAX_GEMV_ROWS or hidden.dtype != torch.float32 or \
                self.kernels is None or type(self) is not CPUOps or len(meta.groups) != 1:
            return None
        group = meta.groups[0]
        plan = self._plan(layers) if group.decode_slots is not None else None  # decode only
        if plan is None:
            return None
        return plan.run(hidden, positions, cos, sin, group.slot_mapping, group.decode_slots,
                        group.decode_lens)

    def _plan(self, layers: Sequence[torch.nn.Module]) -> Any | None:
        cache = self.cache.layer(0)
        built = self._plans.get(id(layers))
        if built is None or any(a is not b for a, b in zip(built[1], cache)):
            built = self._plans[id(layers)] = (decode_plan.build(self.kernels, layers,
                                                                 self.cache), cache)
        return built[0]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if fusable(self.kernels, x, weight):
            return self.kernels.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if fusable(self.kernels, x, residual, weight):
            return self.kernels.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layer: int, meta: Any, qk_norm: QKNorm | None = None
                         ) -> torch.Tensor:
        if qk_norm is not None or not fusable(self.kernels, cos, sin) or \
                not _rows_contiguous(q, k, tokens=MAX_GEMV_ROWS):
            return super().rotary_attention(q, k, v, positions, cos, sin, layer, meta, qk_norm)
        if type(self).attention is not CPUOps.attention:  # a subclass attends its own way
            self.kernels.rotary(q, k, positions, cos, sin)  # in place, as the seam allows
            return self.attention(q, k, v, layer, meta)
        return self._attend(q, k, v, layer, meta, rotary=(positions, cos, sin))

    def packed_linear(self, x: torch.Tensor, weight: PackedWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, GGUFParts) and self.kernels is not None:  # each type's rows
            y = torch.cat([self.packed_linear(x, part) for part in weight.parts], dim=-1)
            return y if bias is None else y + bias
        if not isinstance(weight, GGUFWeight) or self.kernels is None:
            return super().packed_linear(x, weight, bias)
        if x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS and fusable(self.kernels, x):
            # decode: the common call
            y = self.kernels.gemv(x, weight.blocks, weight.qtype, bool(weight.interleaved))
        else:
            y = gguf_linear(x.reshape(-1, x.shape[-1]), weight.blocks, weight.qtype,
                            weight.shape[1], self.bf16_gemm, bool(weight.interleaved)
                            ).to(x.dtype).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    def gated_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
        if gate_up_bias is None and down_bias is None and isinstance(gate_up, GGUFWeight) and \
                isinstance(down, GGUFWeight) and x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS \
                and fusable(self.kernels, x):  # a decode step: one call for the three
            return self.kernels.gguf_mlp(x, gate_up.blocks, gate_up.qtype,
                                         bool(gate_up.interleaved), down.blocks, down.qtype,
                                         bool(down.interleaved))
        return super().gated_mlp(x, gate_up, down, gate_up_bias, down_bias)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: PagedAttentionMeta) -> torch.Tensor:
        return self._attend(q, k, v, layer, meta)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: PagedAttentionMeta, rotary: Rotary | None = None) -> torch.Tensor:
        """A float32 decode step in one C++ call (q and k rotated first with `rotary`, in
        place); anything else through the reference attention."""
        k_cache, v_cache = self.cache.layer(layer)
        g = meta.groups[meta.group_of[layer]]
        if g.decode_slots is not None and fusable(self.kernels, k_cache, v_cache) and \
                q.dtype == k.dtype == v.dtype == torch.float32:
            scale = q.shape[-1] ** -0.5
            if rotary is not None:
                return self.kernels.rotary_decode_attention(
                    q, k, v, *rotary, k_cache, v_cache, g.slot_mapping, g.decode_slots,
                    g.decode_lens, scale)
            return self.kernels.decode_attention(q.contiguous(), k, v, k_cache, v_cache,
                                                 g.slot_mapping, g.decode_slots,
                                                 g.decode_lens, scale)
        if rotary is not None:
            self.kernels.rotary(q, k, *rotary)
        k_cache.index_copy_(0, g.slot_mapping, k)
        v_cache.index_copy_(0, g.slot_mapping, v)
        return attend_cached(q, k, v, k_cache, v_cache, g, meta, None)


def _rows_contiguous(*tensors: torch.Tensor, tokens: int) -> bool:
    """float32 [T <= tokens, H, D] with each row contiguous (q, k and v of a fused qkv output)
    for the C++ rotary; more tokens (a prefill) take the torch ops, which use every core."""
    for t in tensors:
        if t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] > tokens or \
                t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    return True


def _load_kernels():
    """The C++ kernels, or None (torch ops and dequantized GGUF weights) where they do not
    build; said once."""
    try:
        return extension()
    except RuntimeError as exc:
        log.warning("%s", exc)
        return None
