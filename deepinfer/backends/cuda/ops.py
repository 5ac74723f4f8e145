"""ModelOps on the GPU: every op is one Triton kernel, rotary fused into the KV cache write.
Sliding-window layers pass their window to the attention kernels; MLA layers attend a paged
latent cache with the MLA kernels.
A prompt's only chunk with no cached prefix (one sequence, full attention) goes to torch's SDPA
(cuDNN's fused attention, then FlashAttention; DEEPINFER_CUDA_SDPA_PREFILL names the backends in
order, 0 for the Triton kernel, the baseline): on an H200, 8K tokens at D=128 with GQA took
cuDNN 1.01 ms a layer, the paged kernel 1.18 and FlashAttention 1.71.
Projections go to cuBLAS via torch, except one-token ones (batch-1 decode), which go to the
Triton GEMV (kernels/gemv.py): 9% less time over a decode step's weights on an H200. FP8
weights (DeepSeek's block-scaled checkpoints, or --quantization fp8) stay FP8 and go to
kernels/fp8_gemm.py: a weight-only GEMV for decode, a block-scaled tensor-core GEMM for more
tokens (cuBLAS through torch's scaled_mm where it takes block scales; DEEPINFER_CUDA_FP8_CUBLAS=0
for the Triton GEMM, the baseline)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from deepinfer.backends.cuda.kernels import moe_router
from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from deepinfer.backends.cuda.kernels.fp8_gemm import (
    GEMV_AUTO_M,
    Scaled,
    cublas_block_scaled,
    cublas_weight_scale,
    fp8_gemm,
    fp8_linear,
)
from deepinfer.backends.cuda.kernels.fp8_skinny import SKINNY_MAX_M, fp8_skinny
from deepinfer.backends.cuda.kernels.fused_moe import fused_experts
from deepinfer.backends.cuda.kernels.gemv import gemv
from deepinfer.backends.cuda.kernels.kv_write import store_kv
from deepinfer.backends.cuda.kernels.mla_attention import (
    paged_mla_decode,
    paged_mla_prefill,
    store_latent,
)
from deepinfer.backends.cuda.kernels.mla_prefill import (
    expanded_dims_ok,
    expanded_prefill_pays,
    mla_expanded_prefill,
)
from deepinfer.backends.cuda.kernels.norm import add_rms_norm, rms_norm
from deepinfer.backends.cuda.kernels.prefill_attention import (
    choose_prefill_splits,
    paged_prefill_attention,
)
from deepinfer.backends.cuda.kernels.rotary import apply_rotary_, rotary_store_kv_
from deepinfer.backends.cuda.kernels.rotary_decode import SplitCounters, rotary_decode_attention
from deepinfer.backends.cuda.settings import cuda_settings, interpreted
from deepinfer.backends.cuda.step_inputs import AttentionMeta, LayerGroupMeta, layer_meta
from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.models.deepseek_v4.ops import DeepSeekV4Ops
from deepinfer.models.deepseek_v4.paged_ops import DecodeLens, DecodeTarget, PagedRows
from deepinfer.models.mla_ops import MLAOps
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.moe.routing import RouteCounts, RouterSpec
from deepinfer.models.ops import ModelOps, QKNorm
from deepinfer.models.quant.packed import FP8Experts, FP8Weight, PackedWeight


def sdpa_backends(names: str) -> tuple:
    """DEEPINFER_CUDA_SDPA_PREFILL's SDPA backends in order ("" the default: cuDNN, then
    FlashAttention; "0": none, every prefill on the Triton kernel)."""
    from torch.nn.attention import SDPBackend

    if names.strip() == "0":
        return ()
    wanted = [n.strip().upper() for n in (names or "CUDNN_ATTENTION,FLASH_ATTENTION").split(",")]
    unknown = [n for n in wanted if n and not hasattr(SDPBackend, n)]
    if unknown:
        raise ValueError(f"DEEPINFER_CUDA_SDPA_PREFILL: no SDPA backend {unknown[0]!r} (say "
                         "CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION or 0)")
    return tuple(getattr(SDPBackend, n) for n in wanted if n)


SDPA_MIN_TOKENS = 1024  # below it the paged kernel is as fast: few key tiles, and no gather


class CUDAOps(MoEOps, MLAOps, DeepSeekV4Ops, ModelOps):
    """Every family's ops on Triton kernels (and cuBLAS through torch)."""

    packed_kinds = ("fp8",)

    def __init__(self, cache: PagedCache, use_gemv: bool = True, num_sms: int = 8,
                 expanded_context_limit: int | None = None) -> None:
        self.cache = cache
        self.num_sms = num_sms  # sizes split-K where a step has too few programs for the GPU
        self.use_gemv = use_gemv  # off: every projection goes to cuBLAS (for comparison)
        self.split_counters = SplitCounters()  # the one-kernel decode's merge tickets
        # DEEPINFER_CUDA_FUSED_DECODE=0: rotary + KV write, then split-K attention, then the
        # merge, as three kernels (the baseline the one-kernel decode is measured against).
        self.fused_decode = cuda_settings().fused_decode
        self.sdpa_backends = sdpa_backends(cuda_settings().sdpa_prefill)
        self.fp8_cublas = cuda_settings().fp8_cublas
        # FP8 projections of 2..SKINNY_MAX_M tokens (decode batches) on the skinny GEMM;
        # DEEPINFER_CUDA_FP8_SKINNY=0: on the prefill GEMM, the baseline it is measured against.
        self.fp8_skinny_max = SKINNY_MAX_M if cuda_settings().fp8_skinny else GEMV_AUTO_M
        self.skinny_counters = SplitCounters()  # the skinny GEMM's split tickets
        # Called with a layer's index before the layer reads or writes its KV (set while a
        # step runs behind a layer-by-layer HiCache load: the layer waits for its pages).
        self.layer_gate: Callable[[int], None] | None = None
        # DEEPINFER_CUDA_FUSED_SHARED_EXPERTS=1: shared experts as slots of the fused MoE
        # instead of a dense MLP beside it (measured against it; off by default).
        self.fuses_shared_experts = cuda_settings().fused_shared_experts
        # DEEPINFER_CUDA_MLA_EXPANDED_PREFILL=0: every MLA prefill in the absorbed form.
        self.mla_expanded_prefill = cuda_settings().mla_expanded_prefill
        # What an expanded prefill decompresses at once: the step's token budget, whose fresh
        # prompt the KV pool's sizing step runs, so those buffers are in the measured peak
        # (None: the whole context). A longer context goes in pieces of half as many rows.
        self.expanded_context_limit = expanded_context_limit

    def _layer_kv(self, layer: int) -> tuple[torch.Tensor, ...]:
        if self.layer_gate is not None:
            self.layer_gate(layer)
        return self.cache.layer(layer)

    def _window(self, layer: int) -> int:
        return self.cache.spec.layers[layer].sliding_window or 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        apply_rotary_(q, k, positions, cos, sin)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: AttentionMeta | LayerGroupMeta) -> torch.Tensor:
        meta = layer_meta(meta, layer)
        k_cache, v_cache = self._layer_kv(layer)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, layer, meta)

    def latent_attention(self, q: torch.Tensor, latent: torch.Tensor, layer: int,
                         meta: AttentionMeta, value_dim: int, scale: float) -> torch.Tensor:
        (cache,) = self._layer_kv(layer)
        store_latent(latent, cache, meta.slot_mapping)
        return self._latent_kernels(q, None, cache, meta, value_dim, scale)

    def _latent_kernels(self, q: torch.Tensor, q_pe: torch.Tensor | None, cache: torch.Tensor,
                        meta: AttentionMeta, lora: int, scale: float) -> torch.Tensor:
        """The absorbed kernels over the layer's latents: the decode kernel for a decode step,
        else the prefill kernel (q joined, or its latent part with q_pe apart)."""
        bs = self.cache.block_size
        if meta.decode:
            return paged_mla_decode(q, cache, meta.block_tables, meta.seq_lens, bs, scale,
                                    meta.num_splits, lora, q_pe=q_pe)
        return paged_mla_prefill(q, cache, meta.block_tables, meta.query_starts, meta.seq_lens,
                                 meta.max_query_len, bs, scale, lora, q_pe=q_pe)

    def mla_latent(self, kv: torch.Tensor, k_pe: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """kv itself, c_kv normalized where it lies, when k_pe is kv's rotary columns (rotary()
        rotates in place): no copy of c_kv and no joined copy of the row."""
        lora = kv.shape[-1] - k_pe.shape[-1]
        if k_pe.data_ptr() != kv[:, lora:].data_ptr() or k_pe.stride() != kv.stride():
            return super().mla_latent(kv, k_pe, weight, eps)
        rms_norm(kv[:, :lora], weight, eps, out=kv[:, :lora])
        return kv

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, layer: int, meta: AttentionMeta,
                      scale: float) -> torch.Tensor:
        """The absorbed form with the query's two parts read where they are (no joined copy);
        a prefill whose attended pairs repay decompressing its context runs expanded
        (kernels/mla_prefill.py), a mixed step's leading decodes staying absorbed."""
        (cache,) = self._layer_kv(layer)
        store_latent(latent, cache, meta.slot_mapping)
        bs, lora = self.cache.block_size, w_uk.shape[-1]
        if not self._expands(q_nope, q_pe, w_uv, meta):  # never a decode step
            return self._absorbed(q_nope, q_pe, w_uk, w_uv, lambda q_latent:
                                  self._latent_kernels(q_latent, q_pe, cache, meta, lora, scale))
        n = meta.num_decodes
        out = torch.empty(q_nope.shape[:2] + (w_uv.shape[-1],), dtype=q_nope.dtype,
                          device=q_nope.device)
        if n:  # unsplit, as the absorbed prefill kernel takes them: one kernel variant for
            # any number of decodes (a split count per count compiles new ones mid-serving)
            out[:n] = self._absorbed(q_nope[:n], q_pe[:n], w_uk, w_uv, lambda q_latent:
                                     paged_mla_decode(q_latent, cache, meta.block_tables[:n],
                                                      meta.seq_lens[:n], bs, scale, 1, lora,
                                                      q_pe=q_pe[:n]))
        mla_expanded_prefill(q_nope[n:], q_pe[n:], cache, w_uk, w_uv, meta.block_tables[n:],
                             meta.query_starts[n:], meta.seq_lens[n:], meta.prefill_seq_lens,
                             meta.max_query_len, bs, scale, out=out[n:],
                             piece_tokens=self.expanded_context_limit)
        return out

    @staticmethod
    def _absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor:
        """W_UK into the query's latent part, attend (the rotary part read from q_pe), W_UV
        out of the latent values."""
        return torch.einsum("thl,hlv->thv", attend(torch.einsum("thn,hnl->thl", q_nope, w_uk)),
                            w_uv)

    def _expands(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uv: torch.Tensor,
                 meta: AttentionMeta) -> bool:
        """An eager prefill step (its host sizes known), in the kernel's dims, where expanding
        saves FLOPs (under the interpreter, in CI: whenever it can run, so that the path meets
        transformers in the engine tests)."""
        if not (self.mla_expanded_prefill and isinstance(meta, AttentionMeta) and not meta.decode
                and meta.prefill_seq_lens):
            return False
        nope, rope, value, lora = q_nope.shape[-1], q_pe.shape[-1], w_uv.shape[-1], w_uv.shape[1]
        if not expanded_dims_ok(nope, rope, value):
            return False
        return interpreted() or expanded_prefill_pays(
            meta.prefill_pairs, sum(meta.prefill_seq_lens), q_nope.shape[1], lora, nope, rope,
            value)

    def rotary_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layer: int, meta: AttentionMeta | LayerGroupMeta,
                         qk_norm: QKNorm | None = None) -> torch.Tensor:
        """Rotary (and Qwen3's q/k norm, when it covers the head) fused into the KV write, and
        at decode into the attention too (rotary_decode.py)."""
        meta = layer_meta(meta, layer)
        fused_norm = None
        if qk_norm is not None and cos.shape[-1] == q.shape[-1] and \
                qk_norm.q_weight.dtype == qk_norm.k_weight.dtype == q.dtype:
            fused_norm = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
        elif qk_norm is not None:
            q = self.rms_norm(q, qk_norm.q_weight, qk_norm.eps)
            k = self.rms_norm(k, qk_norm.k_weight, qk_norm.eps)
        k_cache, v_cache = self._layer_kv(layer)
        if meta.decode and self.fused_decode and cos.shape[-1] == q.shape[-1]:
            # Decode: rotary, KV write, attention and split merge in one kernel.
            return rotary_decode_attention(
                q, k, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping,
                meta.block_tables, meta.seq_lens, self.cache.block_size,
                1.0 / math.sqrt(q.shape[-1]), meta.num_splits, self.split_counters,
                window=self._window(layer), qk_norm=fused_norm)
        rotary_store_kv_(q, k, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping,
                         fused_norm)
        return self._attend(q, layer, meta)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, PackedWeight) and self.use_gemv and x.shape[0] == 1 \
                and x.is_contiguous():
            return gemv(x, weight, bias)
        return super().linear(x, weight, bias)

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """FP8 weights get their scales in cuBLAS's layout, where scaled_mm takes them, and the
        skinny GEMM its split tickets (before any CUDA graph is captured)."""
        fp8 = [m for m in model.modules() if isinstance(m, FP8Weight) and m.weight.is_cuda]
        if fp8:
            self.skinny_counters.get(max(w.shape[0] for w in fp8), fp8[0].weight.device)
        if fp8 and self.fp8_cublas and cublas_block_scaled(fp8[0].weight.device):
            for weight in fp8:
                weight.kernel_scale = cublas_weight_scale(weight.scale, weight.shape[1])

    def packed_linear(self, x: torch.Tensor, weight: PackedWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, FP8Weight) and self._on_triton(x):
            return self._fp8_linear(x, weight, bias)
        return super().packed_linear(x, weight, bias)

    def _fp8_linear(self, x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None,
                    silu: bool = False) -> torch.Tensor:
        """One row: the weight-only GEMV; a decode batch: the skinny GEMM; more: the prefill
        GEMM. silu: x is a gate/up output and silu(gate) * up is projected (more than one row)."""
        w, scale = weight.weight, weight.scale
        if GEMV_AUTO_M < x.shape[0] <= self.fp8_skinny_max:
            return fp8_skinny(x, w, scale, bias, self.skinny_counters, self.num_sms, silu=silu)
        if silu:
            return fp8_gemm(x, w, scale, bias, kernel_scale=weight.kernel_scale, silu=True)
        return fp8_linear(x, w, scale, bias, kernel_scale=weight.kernel_scale)

    def gated_mlp(self, x: torch.Tensor, gate_up: torch.Tensor | PackedWeight,
                  down: torch.Tensor | PackedWeight, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
        """An FP8 down projection of more than one token (the skinny or the prefill GEMM, both
        w8a8) quantizes silu(gate) * up straight from the gate/up output: one kernel instead of
        SiLU-and-mul, then the quantization of its 16-bit output."""
        if not (isinstance(down, FP8Weight) and x.shape[0] > GEMV_AUTO_M and self._on_triton(x)):
            return super().gated_mlp(x, gate_up, down, gate_up_bias, down_bias)
        return self._fp8_linear(self.linear(x, gate_up, gate_up_bias), down, down_bias, silu=True)

    def route(self, logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
              counts: RouteCounts | None = None, fixed_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax and sigmoid routers, groups, bias and counting in one kernel (moe_router.py)
        instead of 6-12; sqrtsoftplus and hash routing: the reference."""
        if fixed_ids is None and moe_router.takes(spec, logits.shape[-1]) \
                and self._on_triton(logits):
            return moe_router.route_topk(logits, spec, bias, counts)
        return super().route(logits, spec, bias, counts, fixed_ids)

    @staticmethod
    def _on_triton(x: torch.Tensor) -> bool:
        return x.is_cuda or interpreted()

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, slots: torch.Tensor,
                      capacity: int | None = None, swiglu_limit: float | None = None
                      ) -> torch.Tensor:
        # No capacity: shapes are dynamic. FP8 experts go to the kernels as codes and scales.
        w13, w2 = (Scaled(w.weight, w.scale) if isinstance(w, FP8Experts) else w
                   for w in (w13, w2))
        return fused_experts(x, w13, w2, weights, slots, swiglu_limit=swiglu_limit)

    def _attend(self, q: torch.Tensor, layer: int, meta: AttentionMeta) -> torch.Tensor:
        """Attention over the layer's cache, which already holds this step's K and V. A mixed
        step's leading decodes go to the decode kernel (the prefill kernel would spend a
        BLOCK_M-row tile on each one-token query), the rest to the prefill kernel."""
        k_cache, v_cache = self._layer_kv(layer)
        bs, scale, window = self.cache.block_size, 1.0 / math.sqrt(q.shape[-1]), self._window(layer)
        if meta.decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          bs, scale, meta.num_splits, window=window)
        if self._fresh_prompt(q, meta, window):
            return self._sdpa_prefill(q, k_cache, v_cache, meta.slot_mapping, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n, seqs = meta.num_decodes, meta.seq_lens.shape[0]
        if n:
            splits = choose_num_splits(n, k_cache.shape[1], meta.max_seq_len, self.num_sms)
            paged_decode_attention(q[:n], k_cache, v_cache, meta.block_tables[:n],
                                   meta.seq_lens[:n], bs, scale, splits, out=out[:n],
                                   window=window)
        if n < seqs:
            splits = 1 if window else choose_prefill_splits(
                seqs - n, q.shape[1], meta.max_query_len, meta.max_seq_len, self.num_sms,
                q.shape[-1], q.dtype)
            paged_prefill_attention(q[n:], k_cache, v_cache, meta.block_tables[n:],
                                    meta.query_starts[n:], meta.seq_lens[n:],
                                    meta.max_query_len, bs, scale, out=out[n:], window=window,
                                    num_splits=splits)
        return out

    def _fresh_prompt(self, q: torch.Tensor, meta: AttentionMeta, window: int) -> bool:
        """The step is one sequence's first and only chunk, unpadded, under full attention, in
        a dtype and head size both backends take and long enough for them to win (under the
        interpreter, in CI: at any length and dtype, so that the path meets transformers in the
        engine tests)."""
        one_fresh = (bool(self.sdpa_backends) and not window and meta.seq_lens.shape[0] == 1
                     and meta.max_seq_len == meta.max_query_len == q.shape[0])
        if interpreted():
            return one_fresh
        return (one_fresh and q.is_cuda and q.dtype != torch.float32
                and q.shape[-1] in (64, 128) and q.shape[0] >= SDPA_MIN_TOKENS)

    def _sdpa_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, Hq, D] over the rotated K/V the step just wrote (gathered back from the
        cache: 2 x T x Hk x D elements, a few microseconds), returned row-contiguous [T, Hq, D]
        for the output projection (a copy only where a backend laid its output out otherwise)."""
        from torch.nn.attention import sdpa_kernel

        q4 = q.transpose(0, 1).unsqueeze(0)
        k4 = k_cache[slots].transpose(0, 1).unsqueeze(0)
        v4 = v_cache[slots].transpose(0, 1).unsqueeze(0)
        with sdpa_kernel(list(self.sdpa_backends), set_priority=True):
            out = torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, scale=scale, enable_gqa=k4.shape[1] != q4.shape[1])
        return out[0].transpose(0, 1).contiguous()

    def hyper_collapse(self, logits: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor,
                       base: torch.Tensor, iters: int, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC's gates, Sinkhorn and the weighted sum in one kernel instead of ~140 launches
        (kernels/hyper_connections.py)."""
        if not self._on_triton(streams):
            return super().hyper_collapse(logits, streams, scale, base, iters, eps)
        from deepinfer.backends.cuda.kernels.hyper_connections import hyper_collapse

        return hyper_collapse(logits, streams, scale, base, iters, eps)

    def hyper_update(self, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     block_output: torch.Tensor) -> torch.Tensor:
        """mHC's update in one kernel instead of five (kernels/hyper_connections.py)."""
        if not self._on_triton(streams):
            return super().hyper_update(streams, post, comb, block_output)
        from deepinfer.backends.cuda.kernels.hyper_connections import hyper_update

        return hyper_update(streams, post, comb, block_output)

    # ---- DeepSeek-V4 (models/deepseek_v4/ holds the references) ---------------------------
    # The kernels are imported on first use: only DeepSeek-V4 reaches them.
    def v4_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
        """One kernel (norm.py's, with V4's roundings) instead of ~8 torch ops."""
        if not self._on_triton(x):
            return super().v4_rms_norm(x, weight, eps)
        from deepinfer.backends.cuda.kernels.norm import v4_rms_norm

        return v4_rms_norm(x, weight, eps)

    def compressor_decode(self, comp, kv: torch.Tensor, gate: torch.Tensor,
                          positions: torch.Tensor, target: DecodeTarget) -> None:
        """One launch a compressor (kernels/compress_decode.py) instead of ~25 torch ops."""
        if not self._on_triton(kv):
            return super().compressor_decode(comp, kv, gate, positions, target)
        from deepinfer.backends.cuda.kernels.compress_decode import compress_decode

        compress_decode(comp, kv, gate, positions, target)

    def interleaved_rope(self, x: torch.Tensor, positions: torch.Tensor,
                         inv_freq: torch.Tensor, scaling: float,
                         inverse: bool = False) -> torch.Tensor:
        """One kernel instead of ~20 torch ops (kernels/interleaved_rope.py)."""
        if not self._on_triton(x):
            return super().interleaved_rope(x, positions, inv_freq, scaling, inverse)
        from deepinfer.backends.cuda.kernels.interleaved_rope import interleaved_rope

        return interleaved_rope(x, positions, inv_freq, scaling, inverse)

    def compressed_decode_attention(self, q: torch.Tensor, window: PagedRows,
                                    entries: PagedRows | None, picks: torch.Tensor | None,
                                    lens: DecodeLens, sinks: torch.Tensor, sliding_window: int,
                                    scale: float) -> torch.Tensor:
        """Window + compressed entries + sink in one kernel (kernels/compressed_decode.py)."""
        from deepinfer.backends.cuda.kernels.compressed_decode import compressed_decode_attention

        return compressed_decode_attention(
            q, window.cache, window.tables, None if entries is None else entries.cache,
            None if entries is None else entries.tables, picks, lens.device, lens.max,
            sinks, sliding_window, 1 if entries is None else entries.rate, window.block_size,
            scale)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: PagedRows,
                     lens: DecodeLens, topk: int, scale: float) -> torch.Tensor:
        """The index scores in one kernel over the paged keys, then torch.topk."""
        from deepinfer.backends.cuda.kernels.index_topk import indexer_topk

        return indexer_topk(q, weights, keys.cache, keys.tables, lens.device, lens.max,
                            keys.rate, keys.block_size, topk, scale)
