"""The Accelerator seam: the one object the engine calls each step.

Hooks (plugins.py) are for discovery only; per-step work goes straight to the selected
Accelerator, so a backend is a plain class a plugin author can read top to bottom.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.core.batch import ModelBatch, SamplerOutput
    from deepinfer.core.config import CacheConfig, ModelSpec


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data, so the neutral scheduler adapts without subclassing."""

    chunked_prefill: bool = True
    # A backend with a fixed KV pool sizes it once at start-up and never grows it.
    fixed_kv_pool: bool = False
    # Static-shape backends (graphs, Neuron) pad batches up to one of these sizes.
    batch_buckets: tuple[int, ...] = ()
    token_buckets: tuple[int, ...] = ()
    graph_capture: bool = False
    host_page_copy: bool = False
    dtypes: tuple[str, ...] = ("float32", "bfloat16")


@dataclass(frozen=True)
class MemoryStats:
    device_total_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    extra: dict[str, int] = field(default_factory=dict)


class Accelerator(ABC):
    """A backend. One instance per rank process.

    Lifecycle: init_device -> load_model -> num_kv_blocks -> allocate_kv_cache -> execute* -> shutdown.
    """

    name: str = "abstract"
    capabilities: Capabilities = Capabilities()

    @classmethod
    def is_available(cls) -> bool:
        """Cheap probe: can this backend run on this machine?"""
        return True

    def init_device(self, rank: int = 0, world_size: int = 1) -> None:
        """Per-rank environment and device setup (pinning, threads, visible devices)."""

    @abstractmethod
    def load_model(self, spec: "ModelSpec") -> None:
        """Build the model for `spec` and load its weights onto the device."""

    @abstractmethod
    def num_kv_blocks(self, cache: "CacheConfig") -> int:
        """How many KV blocks of cache.block_size tokens fit in the memory budget."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged KV cache. Block 0 is the null block (padding only)."""

    @abstractmethod
    def execute(self, batch: "ModelBatch") -> "SamplerOutput":
        """Run the model on the batch, sample one token per sampled sequence."""

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(device_total_bytes=0, weights_bytes=0, kv_cache_bytes=0)

    def shutdown(self) -> None:
        """Release the device; idempotent."""
