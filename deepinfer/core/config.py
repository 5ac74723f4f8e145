"""Frozen configuration dataclasses; the one place that reads DEEPINFER_* environment variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_ACCELERATOR = "DEEPINFER_ACCELERATOR"
ENV_CACHE_DIR = "DEEPINFER_CACHE_DIR"
ENV_CPU_THREADS = "DEEPINFER_CPU_THREADS"


@dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint to run and how: an HF folder (config.json + safetensors + tokenizer)."""

    path: str
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype, float32 if none
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    # "auto": the checkpoint's safetensors; "dummy": random weights made on the device
    # (benchmarks of a model shape without its checkpoint).
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 128
    num_blocks: int | None = None  # None: sized by the backend from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # host-memory backends (CPU)
    enable_prefix_caching: bool = True
    # HiCache: a host-memory pool of KV pages behind the device prefix cache (0 disables).
    hicache_size_gb: float = 0.0
    # Host slots for per-request layer state (models that keep state besides pages only).
    hicache_state_slots: int = 0
    # A host hit stops so that at least this many prompt tokens are recomputed.
    yoco_keep_tokens: int = 140
    # GPU backends: the fraction of device memory for weights, activations and the KV pool;
    # the pool gets what is left after a profiling run at the step's full token budget.
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.hicache_size_gb < 0 or self.hicache_state_slots < 0 or self.yoco_keep_tokens < 0:
            raise ValueError("hicache_size_gb, hicache_state_slots and yoco_keep_tokens "
                             "must be >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # A prefill longer than this is cut into chunks even when the budget has room, so that
    # decodes of other requests keep flowing (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks share the work: data parallel ranks (one process and device each), expert
    parallelism across them (MoE layers), tensor parallel size (1 only, for now)."""

    dp: int = 1
    ep: bool = False
    tp: int = 1
    # Where ranks meet for torch.distributed (the API process picks a free port when 0).
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.tp != 1:
            raise ValueError("tensor parallelism is not supported yet; use tp=1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    accelerator: str | None = None  # None: DEEPINFER_ACCELERATOR, else probe
    seed: int = 0
    # Graph-capturing backends run every step eagerly (debugging, profiling).
    enforce_eager: bool = False


def accelerator_from_env() -> str | None:
    value = os.environ.get(ENV_ACCELERATOR, "").strip().lower()
    return value or None


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return os.environ.get(ENV_CACHE_DIR, default)


def cpu_threads() -> int | None:
    value = os.environ.get(ENV_CPU_THREADS)
    return int(value) if value else None
