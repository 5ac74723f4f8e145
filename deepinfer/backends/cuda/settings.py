"""The CUDA backend's environment switches, read in one place (documented in
docs/configuration.md). Every switch but the SDPA list turns one kernel off for comparison:
the default is the path the backend runs."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from deepinfer.core.settings import flag, read_settings, setting


@dataclass(frozen=True)
class CudaSettings:
    # One-token projections on the Triton GEMV (off: cuBLAS).
    gemv: bool = setting(True, "DEEPINFER_CUDA_GEMV", flag)
    # The GEMV requests a whole row before the PDL wait (off: one tile).
    gemv_preload: bool = setting(True, "DEEPINFER_CUDA_GEMV_PRELOAD", flag)
    # Programmatic dependent launch of the decode-path kernels (Hopper and later).
    pdl: bool = setting(True, "DEEPINFER_CUDA_PDL", flag)
    # Rotary + KV write, split-K attention and the merge as one kernel (off: three).
    fused_decode: bool = setting(True, "DEEPINFER_CUDA_FUSED_DECODE", flag)
    # SDPA backends, in order, for a prompt's only chunk with no cached prefix ("" default
    # order; "0": the paged Triton kernel for every prefill).
    sdpa_prefill: str = setting("", "DEEPINFER_CUDA_SDPA_PREFILL")
    # FP8 GEMMs of more than one row on cuBLAS's block-scaled scaled_mm (off: Triton).
    fp8_cublas: bool = setting(True, "DEEPINFER_CUDA_FP8_CUBLAS", flag)
    # FP8 projections of decode batches on the skinny GEMM (off: the prefill GEMM).
    fp8_skinny: bool = setting(True, "DEEPINFER_CUDA_FP8_SKINNY", flag)
    # HiCache loads layer by layer on a stream of their own, each layer of the next step
    # waiting for its own pages (off: the whole load on the engine's stream, then the step).
    layer_loads: bool = setting(True, "DEEPINFER_CUDA_LAYER_LOADS", flag)
    # MLA prefill expanded into per-head keys and values where it saves FLOPs (off: the
    # weight-absorbed kernel for every prefill).
    mla_expanded_prefill: bool = setting(True, "DEEPINFER_CUDA_MLA_EXPANDED_PREFILL", flag)
    # MoE layers' shared experts as slots of the fused MoE, on: no faster than the dense MLP
    # beside it, the default (docs/benchmarks.md, "Shared experts").
    fused_shared_experts: bool = setting(False, "DEEPINFER_CUDA_FUSED_SHARED_EXPERTS", flag)


@functools.cache
def cuda_settings() -> CudaSettings:
    """This process's settings, read once: kernels consult them at every eager launch."""
    return read_settings(CudaSettings)


def interpreted() -> bool:
    """Kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
