"""CPUAccelerator: the reference backend and the embedded default on machines without a GPU.
The shared torch runner does the work; this backend brings the reference ops with its C++
kernels (ops.py) and the reference attention metadata."""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import torch

from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.torch.attention import PagedAttentionMeta
from deepinfer.backends.torch.host_pool import CPUHostPool, host_memory
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.backends.torch.speculative import MTPSpeculator
from deepinfer.backends.torch.step_future import DeviceTokens, fill_from_last_step
from deepinfer.core.accelerator import (
    Accelerator,
    Capabilities,
    HostPoolLayout,
    MemoryStats,
    ModelInfo,
    ParallelContext,
)
from deepinfer.core.batch import ModelBatch, SamplerOutput
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, cpu_threads


class CPUAccelerator(Accelerator):
    name = "cpu"
    capabilities = Capabilities(chunked_prefill=True, host_page_copy=True,
                                host_copy_skips_null=True, speculative_decoding=True,
                                host_pool_shared=True,
                                async_output=True, rebind_group=True, prompt_logprobs=True,
                                dtypes=("float32", "bfloat16", "float16"),
                                prefill_beside_decodes=256)

    def __init__(self) -> None:
        self.runner = TorchRunner("cpu", self.capabilities, CPUOps, backend=self.name)
        self.speculator = MTPSpeculator(self.runner, self._meta)
        self.host_pool: CPUHostPool | None = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def init_device(self, parallel: ParallelContext = ParallelContext()) -> None:
        # Ranks on one host split its cores so they do not oversubscribe each other.
        threads = cpu_threads() or max(1, (os.cpu_count() or 1) // max(1, parallel.world_size))
        torch.set_num_threads(threads)
        self.runner.ops.parallel = parallel  # MoE layers spread their experts over the ranks

    def rebind_group(self, parallel: ParallelContext) -> None:
        self.runner.rebind_group(parallel)  # start-up made no collective beyond the runtime's

    def configure(self, config: EngineConfig) -> None:
        self.runner.seed = config.seed
        self.runner.num_speculative_tokens = config.scheduler.num_speculative_tokens

    def load_model(self, spec: ModelSpec) -> ModelInfo:
        return self.runner.load(spec)

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        return self.runner.pool_blocks(cache)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> None:
        self.runner.allocate(num_blocks, block_size, num_state_slots)

    # ---- steps ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, batch: ModelBatch, all_tokens: bool = False) -> torch.Tensor:
        """Logits of each sampled sequence's last token (or of every token), float32."""
        hidden, last = self._forward(batch)
        return self.runner.logits(hidden if all_tokens else hidden[last])

    def _forward(self, batch: ModelBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token's hidden state, and the rows of the sampled ones."""
        meta = PagedAttentionMeta.from_batch(batch, self.runner.cache)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long)
        fill_from_last_step(input_ids, batch.from_last_step)
        positions = torch.tensor(batch.positions, dtype=torch.long)
        self.runner.begin_step(batch.num_tokens, batch.num_real_tokens)
        hidden = self.runner.forward(input_ids, positions, meta)
        last = [meta.query_starts[i] + meta.query_lens[i] - 1 for i in batch.sample_indices]
        return hidden, torch.tensor(last, dtype=torch.long)

    def _meta(self, batch: ModelBatch) -> PagedAttentionMeta:
        return PagedAttentionMeta.from_batch(batch, self.runner.cache)

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        if batch.spec is not None:
            with torch.inference_mode():
                return self.speculator.execute(batch)
        with torch.inference_mode():
            hidden, last = self._forward(batch)
            out = self.runner.sample(self.runner.logits(hidden[last]), batch.sampling)
            if batch.prompt_logprobs:
                out = dataclasses.replace(
                    out, prompt_logprobs=self.runner.prompt_logprobs(hidden, batch))
            return out

    def launch(self, batch: ModelBatch) -> DeviceTokens:
        # Nothing here runs asynchronously, but the engine's async path is the same as on a
        # GPU: the next step takes its input ids from this one's tensor.
        logits = self.forward_logits(batch)
        with torch.inference_mode():
            return DeviceTokens(self.runner.sample_tokens(logits, batch.sampling))

    def expert_load(self):
        return self.runner.expert_load()

    def rebalance_experts(self):
        return self.runner.rebalance_experts()

    # ---- HiCache host tier -----------------------------------------------------------------
    def host_page_bytes(self) -> int:
        return self.runner.block_bytes(self.runner.cache.block_size)

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0,
                           shared_file: str | None = None) -> HostPoolLayout:
        self.host_pool = CPUHostPool.allocate(num_pages, self.runner.cache, shared_file)
        # State slots are bookkeeping only until a model with state runs here.
        return HostPoolLayout(num_pages, self.host_page_bytes(), num_state_slots, 0, False,
                              host_memory(self.host_pool.pages))

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[Sequence[int]],
                   to_device: bool) -> None:
        if self.host_pool is None:
            raise RuntimeError("allocate_host_pool was not called")
        self.host_pool.copy(self.runner.cache, host_pages, device_blocks, to_device)

    def memory_stats(self) -> MemoryStats:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host = self.host_pool.pages if self.host_pool is not None else None
        extra = {"hicache_bytes": host.numel() * host.element_size()} if host is not None else {}
        return self.runner.memory_stats(total, extra)

    def shutdown(self) -> None:
        self.runner.shutdown()
        self.host_pool = None
