"""The small set of operations a model asks of its backend.

Models are plain torch modules; everything that depends on the KV layout or on a kernel goes
through these ops, so one model definition runs on every backend. A backend implements the five
primitives. The composites (a projection; rotary followed by attention; MoE routing and the
expert computation) have reference definitions here; a backend overrides one where it has a
better kernel, e.g. the CUDA backend's one-token GEMV, its rotary fused into the KV cache write
and its fused MoE.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from deepinfer.core.accelerator import ParallelContext
from deepinfer.models.deepseek_v4.attention import rope as v4_rope
from deepinfer.models.deepseek_v4.attention import v4_rms_norm
from deepinfer.models.deepseek_v4.decode_compress import decode_compress
from deepinfer.models.deepseek_v4.paged_ops import (DecodeLens, DecodeTarget, PagedRows,
                                                    decode_attention_reference,
                                                    indexer_topk_reference)
from deepinfer.models.moe.experts import fused_experts_reference
from deepinfer.models.moe.routing import RouteCounts, RouterSpec, select_experts
from deepinfer.models.quant.packed import PackedWeight


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm of q and k before the rotation (Qwen3): weights [head_dim]."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


class ModelOps(ABC):
    # The ranks MoE layers spread their experts over (set by the runner before the model is
    # built); None: one rank holds every expert.
    parallel: ParallelContext | None = None
    # The packed weight kinds (models/quant: "gguf:Q4_1", "fp8") packed_linear runs; the
    # loader keeps those packed and dequantizes every other quantized weight.
    packed_kinds: tuple[str, ...] = ()

    # ---- primitives: every backend implements these -------------------------------------
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, float32 statistics."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (rms_norm(x + residual), x + residual)."""

    @abstractmethod
    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]; cos/sin tables [max_len, rotary_dim] (NeoX halves)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2F] -> silu(x[:, :F]) * x[:, F:]."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: Any) -> torch.Tensor:
        """Write k, v [T, Hk, D] into layer's paged cache; attend q [T, Hq, D] causally over
        each sequence's cached prefix plus its new tokens. Returns [T, Hq, D]."""

    def latent_attention(self, q: torch.Tensor, latent: torch.Tensor, layer: int, meta: Any,
                         value_dim: int, scale: float) -> torch.Tensor:
        """MLA (weight-absorbed): write latent [T, L] into layer's paged cache; every head of
        q [T, H, L] attends the shared latents causally (scores over all L dims, values their
        first value_dim dims). Returns [T, H, value_dim]."""
        raise NotImplementedError(f"{type(self).__name__} has no MLA attention")

    # ---- composites: reference definitions, overridden where a better kernel exists -------
    def hyper_collapse(self, logits: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor,
                       base: torch.Tensor, iters: int, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V4's mHC collapse from its gate logits float32 [T, (2+N)N]: the pre, post
        and comb gates (comb through Sinkhorn's `iters` normalisations) and the block's input
        sum_j pre_j * streams_j -> (input [T, H], post [T, N], comb [T, N, N]) (reference:
        deepseek_v4/hyper.collapse_gates)."""
        from deepinfer.models.deepseek_v4.hyper import collapse_gates

        return collapse_gates(logits, streams, scale, base, iters, eps)

    def hyper_update(self, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     block_output: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4's mHC update: new streams [T, N, H] = post * block_output + comb^T @
        streams, in the streams' dtype (reference: deepseek_v4/hyper.update_streams)."""
        from deepinfer.models.deepseek_v4.hyper import update_streams

        return update_streams(streams, post, comb, block_output)

    def v4_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
        """DeepSeek-V4's norms over the last dim, in x's dtype: with a float32 weight, weight
        times the float32 normalized x, rounded once; without, x times its reciprocal rms
        rounded to x's dtype (reference: deepseek_v4/attention.py)."""
        return v4_rms_norm(x, weight, eps)

    def interleaved_rope(self, x: torch.Tensor, positions: torch.Tensor,
                         inv_freq: torch.Tensor, scaling: float,
                         inverse: bool = False) -> torch.Tensor:
        """DeepSeek-V4's rope: the trailing 2 * len(inv_freq) channels of x [T, ..., D] rotated
        in interleaved pairs at positions [T], cos/sin rounded to x's dtype (inverse: sin
        negated); a new tensor (reference: deepseek_v4/attention.rope)."""
        return v4_rope(x, positions, inv_freq, scaling, inverse)

    def compressor_decode(self, comp: Any, kv: torch.Tensor, gate: torch.Tensor,
                          positions: torch.Tensor, target: DecodeTarget) -> None:
        """One DeepSeek-V4 compressor (deepseek_v4/compressor.Compressor) at a decode step:
        kv, gate [B, width] projected rows of the tokens at positions [B] advance each
        sequence's state slot; a token that closes its window writes the pooled, normed,
        roped entry, and one that ends a page the carry-over (reference:
        deepseek_v4/decode_compress.py)."""
        decode_compress(comp, kv, gate, positions, target)

    def compressed_decode_attention(self, q: torch.Tensor, window: PagedRows,
                                    entries: PagedRows | None, picks: torch.Tensor | None,
                                    lens: DecodeLens, sinks: torch.Tensor, sliding_window: int,
                                    scale: float) -> torch.Tensor:
        """DeepSeek-V4 decode attention, one query per sequence q [B, H, D] (roped; keys are
        the values): softmax over its last `sliding_window` K=V vectors in `window`, the
        compressed entries it sees in `entries` (picks [B, k] entry numbers, -1 none; None:
        every entry w < seq_len // rate) and one sink logit per head. Returns [B, H, D]."""
        return decode_attention_reference(q, window, entries, picks, lens, sinks,
                                          sliding_window, scale)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: PagedRows,
                     lens: DecodeLens, topk: int, scale: float) -> torch.Tensor:
        """DeepSeek-V4's Lightning indexer for one query per sequence: index queries
        q [B, heads, d], head weights [B, heads] fp32, paged index keys -> the top
        min(topk, most entries) entry numbers [B, k] by sum_h w * ReLU(q_h . key) * scale
        over the entries the query sees, -1 past a sequence's count."""
        return indexer_topk_reference(q, weights, keys, lens, topk, scale)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ weight[N, K].T (+ bias); a packed weight goes to packed_linear."""
        if isinstance(weight, PackedWeight):
            return self.packed_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def decoder_layers(self, layers: Sequence[torch.nn.Module], positions: torch.Tensor,
                       hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A backend's own run of a whole decoder stack for this step: (hidden, residual)
        after the last layer, as the layers one by one would give them; or None, and the
        model runs its layers. The reference runs none."""
        return None

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Called once the model's weights are loaded (and again after weights move): a backend
        lays out again what its kernels read. The reference reads the weights as loaded."""

    def packed_linear(self, x: torch.Tensor, weight: PackedWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ a quantized weight (one of packed_kinds), in x.dtype; the reference
        dequantizes it."""
        w = weight.dequantize().to(device=x.device, dtype=x.dtype)
        return F.linear(x, w, bias)

    def gated_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up), gate and up one fused projection [2F, K]: the dense MLP of
        llama and DeepSeek."""
        hidden = self.silu_and_mul(self.linear(x, gate_up, gate_up_bias))
        return self.linear(hidden, down, down_bias)

    def rotary_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layer: int, meta: Any, qk_norm: QKNorm | None = None
                         ) -> torch.Tensor:
        """attention() over q and k after rotary(), and after qk_norm's per-head RMSNorm of
        each if given; q and k may be changed in place."""
        if qk_norm is not None:
            q = self.rms_norm(q, qk_norm.q_weight, qk_norm.eps)
            k = self.rms_norm(k, qk_norm.k_weight, qk_norm.eps)
        q, k = self.rotary(q, k, positions, cos, sin)
        return self.attention(q, k, v, layer, meta)

    def swiglu(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """silu_and_mul with DeepSeek-V4's clamp: x [T, 2F] -> silu(min(gate, limit)) *
        clamp(up, -limit, limit); limit None: silu_and_mul(x)."""
        if limit is None:
            return self.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.silu_and_mul(torch.cat((gate.clamp(max=limit),
                                            up.clamp(min=-limit, max=limit)), dim=-1))

    def route(self, logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
              counts: RouteCounts | None = None, fixed_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32); the
        routes of real tokens are added to counts, if given. fixed_ids [T, k] (hash routing):
        the experts are these and the scores only weigh them."""
        weights, ids = select_experts(logits, spec, bias, fixed_ids)
        if counts is not None:
            counts.add(ids)
        return weights, ids

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor | PackedWeight,
                      w2: torch.Tensor | PackedWeight, weights: torch.Tensor,
                      slots: torch.Tensor, capacity: int | None = None,
                      swiglu_limit: float | None = None) -> torch.Tensor:
        """sum over k of weights[t, k] * down(silu(gate) * up)(x[t]) by the expert in slot
        slots[t, k] of this rank (w13 [S, 2F, H] gate rows then up rows, w2 [S, H, F]);
        slot -1 routes are served elsewhere and skipped. Returns [T, H] in x.dtype.
        capacity: static-shape backends compute at most `capacity` routes per slot, in a
        grouped layout of that size; the caller guarantees that no slot overflows it. None: no
        limit. The reference (and every dynamic-shape backend) ignores it.
        swiglu_limit (DeepSeek-V4): silu(min(gate, limit)) * clamp(up, -limit, limit) instead
        of silu(gate) * up; None: no clamp. Packed experts (FP8Experts, a backend that runs
        fp8): the reference dequantizes them."""
        w13, w2 = (w.dequantize().to(device=x.device, dtype=x.dtype)
                   if isinstance(w, PackedWeight) else w for w in (w13, w2))
        return fused_experts_reference(x, w13, w2, weights, slots, swiglu_limit)

    def expert_exchange(self, group: Any, rank: int, world_size: int,
                        slots_per_rank: int) -> Any | None:
        """The exchange of this backend's MoE layers (AllGatherExchange's run signature), used
        on one rank as on many; None (the default): the runtime's all-gather and all-to-all
        exchanges under expert parallel, none on one rank. Static-shape backends return one
        whose shapes never depend on the routing (neuron/moe.py's StaticMoEExchange)."""
        return None
