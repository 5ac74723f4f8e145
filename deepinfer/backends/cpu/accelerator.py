"""CPUAccelerator: the reference backend and the embedded default on machines without a GPU."""
from __future__ import annotations

import os
from typing import Sequence

import torch

from deepinfer.core.accelerator import Accelerator, Capabilities, HostPoolLayout, MemoryStats
from deepinfer.core.batch import ModelBatch, SamplerOutput
from deepinfer.core.config import CacheConfig, ModelSpec, cpu_threads
from deepinfer.core.sampler import Sampler
from deepinfer.backends.cpu.attention import CPUAttentionMeta, CPUPagedAttention
from deepinfer.backends.cpu.host_pool import CPUHostPool
from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.models.loader import build_model, kv_block_bytes, resolve_dtype
from deepinfer.models.model_config import ModelConfig

GIB = 1 << 30


class CPUAccelerator(Accelerator):
    name = "cpu"
    capabilities = Capabilities(chunked_prefill=True, host_page_copy=True)

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.model_config: ModelConfig | None = None
        self.dtype = torch.float32
        self.attention: CPUPagedAttention | None = None
        self.sampler = Sampler()
        self.block_size = 0
        self.host_pool: CPUHostPool | None = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def init_device(self, rank: int = 0, world_size: int = 1) -> None:
        # Ranks on one host split its cores so they do not oversubscribe each other.
        threads = cpu_threads() or max(1, (os.cpu_count() or 1) // max(1, world_size))
        torch.set_num_threads(threads)

    def load_model(self, spec: ModelSpec) -> None:
        cfg = ModelConfig.from_dir(spec.path)
        self.model_config = cfg
        self.dtype = resolve_dtype(spec.dtype, cfg)
        max_len = spec.max_model_len or cfg.max_position_embeddings
        self.attention = CPUPagedAttention(cfg.num_layers)
        self.model = build_model(cfg, CPUOps(self.attention), spec, max_len, "cpu", self.dtype)

    def _bytes_per_block(self, block_size: int) -> int:
        return kv_block_bytes(self.model_config, block_size, self.dtype)

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        return max(2, int(cache.kv_cache_memory_gb * GIB) // self._bytes_per_block(cache.block_size))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model_config
        self.block_size = block_size
        self.attention.allocate(num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self.num_blocks = num_blocks

    # ---- HiCache host tier -----------------------------------------------------------------
    def host_page_bytes(self) -> int:
        return self._bytes_per_block(self.block_size)

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0) -> HostPoolLayout:
        cfg = self.model_config
        self.host_pool = CPUHostPool.allocate(num_pages, cfg.num_layers, self.block_size,
                                              cfg.num_kv_heads, cfg.head_dim, self.dtype)
        # Llama-family models keep no state besides their pages: slots are bookkeeping only.
        return HostPoolLayout(num_pages, self.host_page_bytes(), num_state_slots, 0, False)

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[int],
                   to_device: bool) -> None:
        if self.host_pool is None:
            raise RuntimeError("allocate_host_pool was not called")
        self.host_pool.copy(self.attention, host_pages, device_blocks, to_device)

    @torch.inference_mode()
    def forward_logits(self, batch: ModelBatch, all_tokens: bool = False) -> torch.Tensor:
        """Logits of each sampled sequence's last token (or of every token), float32."""
        meta = CPUAttentionMeta.from_batch(batch)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long)
        positions = torch.tensor(batch.positions, dtype=torch.long)
        hidden = self.model(input_ids, positions, meta)
        if all_tokens:
            return self.model.compute_logits(hidden)
        last = [meta.query_starts[i] + meta.query_lens[i] - 1 for i in batch.sample_indices]
        return self.model.compute_logits(hidden[torch.tensor(last, dtype=torch.long)])

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        logits = self.forward_logits(batch)
        if not batch.sample_indices:
            return SamplerOutput(token_ids=[], logprobs=[])
        with torch.inference_mode():
            return self.sampler.sample(logits, batch.sampling)

    def memory_stats(self) -> MemoryStats:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters()) \
            if self.model is not None else 0
        kv = sum(t.numel() * t.element_size()
                 for t in (self.attention.k_cache + self.attention.v_cache)) if self.attention else 0
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host = self.host_pool.pages if self.host_pool is not None else None
        extra = {"hicache_bytes": host.numel() * host.element_size()} if host is not None else {}
        return MemoryStats(device_total_bytes=total, weights_bytes=weights, kv_cache_bytes=kv,
                           extra=extra)

    def shutdown(self) -> None:
        self.model = None
        if self.attention is not None:
            self.attention.k_cache, self.attention.v_cache = [], []
        self.host_pool = None
