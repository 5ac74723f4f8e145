"""The backend itself: a plain `Accelerator` subclass, written the way a third-party backend
starts. The shared torch runner (`deepinfer.backends.torch.runner.TorchRunner`) loads the
checkpoint into DeepInfer's model for its architecture, sizes and allocates the KV pool from
the model's KV spec, runs the forward pass and samples. The backend brings the ops the model
calls (ops.py: `ExampleOps`, over DeepInfer's reference torch ops) and the attention metadata
those ops read (`PagedAttentionMeta`), so it runs on the host CPU; a device backend puts its
own kernels and metadata in their place and keeps the rest.

It counts the steps and tokens it executes, and implements HiCache's host page copy.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from deepinfer.backends.torch.attention import PagedAttentionMeta
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.core.accelerator import (
    Accelerator,
    Capabilities,
    HostPoolLayout,
    MemoryStats,
    ModelInfo,
    ParallelContext,
)
from deepinfer.core.batch import ModelBatch, SamplerOutput
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec
from deepinfer_example_plugin.ops import ExampleOps

GIB = 1 << 30


class CountingAccelerator(Accelerator):
    name = "example"
    capabilities = Capabilities(chunked_prefill=True, host_page_copy=True,
                                dtypes=("float32", "bfloat16"))

    def __init__(self) -> None:
        # The runner calls ExampleOps(cache) with its PagedCache: the ops write and read KV
        # there. A model that needs an op family ExampleOps lacks is refused at load.
        self.runner = TorchRunner("cpu", self.capabilities, ExampleOps, backend=self.name)
        self.host_pages: torch.Tensor | None = None
        self.steps = 0
        self.tokens = 0

    @classmethod
    def is_available(cls) -> bool:
        return True  # a device backend checks for its device and SDK here, cheaply

    def init_device(self, parallel: ParallelContext = ParallelContext()) -> None:
        # One instance per rank process. A device backend selects its device from
        # parallel.rank here; on the host, ranks share its cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.world_size))
        self.runner.ops.parallel = parallel  # MoE models spread their experts over the ranks

    def configure(self, config: EngineConfig) -> None:
        self.runner.seed = config.seed  # the seed of --load-format dummy weights

    def load_model(self, spec: ModelSpec) -> ModelInfo:
        # ModelInfo carries the model's KV spec: the engine's block tables (one per KV group)
        # and the page layout below follow it.
        return self.runner.load(spec)

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        return self.runner.blocks_in(int(cache.kv_cache_memory_gb * GIB), cache.block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> None:
        self.runner.allocate(num_blocks, block_size, num_state_slots)

    @torch.inference_mode()
    def execute(self, batch: ModelBatch) -> SamplerOutput:
        self.steps += 1
        self.tokens += batch.num_tokens
        # Per KV group: slots to write, block tables to read (null block 0 where a sliding
        # window freed blocks), the window itself.
        meta = PagedAttentionMeta.from_batch(batch, self.runner.cache)
        # MoE models: agree on the step's size with the other ranks, count real tokens only.
        self.runner.begin_step(batch.num_tokens, batch.num_real_tokens)
        hidden = self.runner.forward(torch.tensor(batch.input_ids, dtype=torch.long),
                                     torch.tensor(batch.positions, dtype=torch.long), meta)
        # Logits of each sampled sequence's last token only (partial prefills sample nothing).
        last = [meta.query_starts[i] + meta.query_lens[i] - 1 for i in batch.sample_indices]
        logits = self.runner.logits(hidden[torch.tensor(last, dtype=torch.long)])
        return self.runner.sample(logits, batch.sampling)

    # ---- HiCache host tier -----------------------------------------------------------------
    # A page is one block of every KV group: every (layer, cache entry) chunk of the KV spec,
    # in KVSpec.chunks() order. Host pages are stored page-first, [num_pages, page elements], so
    # a page is one contiguous run; a device backend would move it with one DMA.
    def host_page_bytes(self) -> int:
        return self.runner.block_bytes(self.runner.cache.block_size)

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0) -> HostPoolLayout:
        page_numel = sum(chunk.numel for chunk, _ in self.runner.cache.chunk_tensors())
        self.host_pages = torch.empty((num_pages, page_numel), dtype=self.runner.dtype)
        # The models here keep no per-request state (state_slot_bytes 0): slots are bookkeeping.
        return HostPoolLayout(num_pages, self.host_page_bytes(), num_state_slots)

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[Sequence[int]],
                   to_device: bool) -> None:
        """host_pages[i] <-> block device_blocks[g][i] of each KV group g. Synchronous, so it
        returns None (done); a backend with streams returns a handle to poll."""
        if self.host_pages is None:
            raise RuntimeError("allocate_host_pool was not called")
        if any(len(blocks) != len(host_pages) for blocks in device_blocks):
            raise ValueError("one device block per host page in every KV group")
        pages = torch.tensor(host_pages, dtype=torch.long)
        groups = [torch.tensor(blocks, dtype=torch.long) for blocks in device_blocks]
        offset = 0
        with torch.inference_mode():
            for chunk, tensor in self.runner.cache.chunk_tensors():
                device = tensor.view(-1, chunk.numel)  # row b: block b of this layer's entry
                host = self.host_pages[:, offset:offset + chunk.numel]
                blocks = groups[chunk.group]
                if to_device:
                    device.index_copy_(0, blocks, host.index_select(0, pages))
                else:
                    host.index_copy_(0, pages, device.index_select(0, blocks))
                offset += chunk.numel

    def memory_stats(self) -> MemoryStats:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return self.runner.memory_stats(total)

    def shutdown(self) -> None:
        self.runner.shutdown()  # idempotent: drops the model and frees the pool
        self.host_pages = None
