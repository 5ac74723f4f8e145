"""CUDAAccelerator: the llama family on NVIDIA GPUs.

Triton kernels for attention, norms, rotary, activation and the KV write; cuBLAS (through torch)
for the GEMMs; CUDA graphs for decode batches; sampling on the GPU with one host sync per step
(the sampled ids); the KV pool sized from the memory a profiling step leaves; HiCache's host
tier moved by a UVA copy kernel. With device="cpu" and TRITON_INTERPRET=1 the same code runs on
the CPU (no graphs), which is how CI checks the backend end to end.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Sequence

import torch

from deepinfer.backends.cuda.graphs import DecodeGraphs
from deepinfer.backends.cuda.memory import GIB, kv_budget
from deepinfer.backends.cuda.step_inputs import StepInputs, pack_batch, unpack_batch
from deepinfer.core.accelerator import Accelerator, Capabilities, HostPoolLayout, MemoryStats
from deepinfer.core.batch import ModelBatch, SamplerOutput, SamplingRow
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, cpu_threads
from deepinfer.core.sampler import Sampler
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.loader import build_model, kv_block_bytes, resolve_dtype
from deepinfer.models.model_config import ModelConfig

log = logging.getLogger(__name__)


class CUDAAccelerator(Accelerator):
    name = "nvidia"
    capabilities = Capabilities(chunked_prefill=True, graph_capture=True, host_page_copy=True,
                                dtypes=("bfloat16", "float16", "float32"))

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.max_num_batched_tokens, self.max_num_seqs = 2048, 64
        self.enforce_eager, self.seed = False, 0
        self.model: torch.nn.Module | None = None
        self.model_config: ModelConfig | None = None
        self.dtype = torch.bfloat16
        self.max_model_len = 0
        self.cache = None  # PagedKVCache, once a model is loaded
        self.ops = None  # CUDAOps
        self.graphs: DecodeGraphs | None = None
        self.host_pool = None
        self.sampler = Sampler()
        self.block_size = 0
        self.num_sms = 8  # split-K sizing; the device's count once init_device ran on a GPU

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

    @property
    def on_gpu(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def init_device(self, rank: int = 0, world_size: int = 1) -> None:
        # Host-side torch ops are small here; ranks on one host share its cores.
        torch.set_num_threads(cpu_threads() or max(1, (os.cpu_count() or 1) // max(1, world_size)))
        if self.device is None:
            # One rank per GPU; a launcher that sets CUDA_VISIBLE_DEVICES per rank sees one.
            index = rank % torch.cuda.device_count()
            self.device = torch.device("cuda", index)
        if self.on_gpu:
            torch.cuda.set_device(self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    def configure(self, config: EngineConfig) -> None:
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.enforce_eager, self.seed = config.enforce_eager, config.seed

    # ---- model ---------------------------------------------------------------------------
    def load_model(self, spec: ModelSpec) -> None:
        if self.device is None:
            self.init_device()
        cfg = ModelConfig.from_dir(spec.path)
        self.model_config = cfg
        self.dtype = resolve_dtype(spec.dtype, cfg)
        self.max_model_len = spec.max_model_len or cfg.max_position_embeddings
        # The kernels import triton: only here, so that probing this backend on a machine
        # without a GPU (or without triton) costs nothing and reports nothing.
        from deepinfer.backends.cuda.ops import CUDAOps, PagedKVCache

        self.cache = PagedKVCache(cfg.num_layers)
        # DEEPINFER_CUDA_GEMV=0 sends one-token projections to cuBLAS too: the baseline the
        # GEMV kernel is measured against (benchmarks/cuda/profile_steps.py).
        use_gemv = os.environ.get("DEEPINFER_CUDA_GEMV", "1") != "0"
        self.ops = CUDAOps(self.cache, cfg.head_dim, use_gemv=use_gemv)
        self.model = build_model(cfg, self.ops, spec, self.max_model_len, self.device,
                                 self.dtype, self.seed)

    def _bytes_per_block(self, block_size: int) -> int:
        return kv_block_bytes(self.model_config, block_size, self.dtype)

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        if not self.on_gpu:
            return max(2, int(cache.kv_cache_memory_gb * GIB) // self._bytes_per_block(
                cache.block_size))
        budget = kv_budget(self.device, cache.gpu_memory_utilization,
                           self._profile_peak(cache.block_size))
        log.info("%s", budget.describe())
        return max(2, budget.kv_bytes // self._bytes_per_block(cache.block_size))

    def _profile_peak(self, block_size: int) -> int:
        """Peak bytes of the worst step: a full token budget of prefill, then the sampler over
        max_num_seqs rows with the filters that sort the vocabulary."""
        tokens = self.max_num_batched_tokens
        batch = _profile_batch(tokens, self.max_model_len, block_size)
        blocks = 1 + sum(len(table) for table in batch.block_tables)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.allocate_kv_cache(blocks, block_size, capture=False)
        scratch = self.cache.nbytes
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            hidden = self._forward(self._eager_inputs(batch))
            rows = min(self.max_num_seqs, tokens)
            logits = self.model.compute_logits(hidden[:rows])
            self.sampler.sample(logits, [_profile_row()] * rows)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch
        self.cache.kv = None
        del hidden, logits
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int, block_size: int, capture: bool = True) -> None:
        cfg = self.model_config
        self.block_size = self.ops.block_size = block_size
        self.cache.kv = None  # free the old pool first: the two need not fit together
        self.cache.allocate(num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                            self.device)
        self.num_blocks = num_blocks
        if capture and self.on_gpu and not self.enforce_eager:
            self._capture_graphs(block_size)

    def _capture_graphs(self, block_size: int) -> None:
        max_blocks = -(-self.max_model_len // block_size)
        self.graphs = DecodeGraphs(self.max_num_seqs, max_blocks, self.device,
                                   lambda batch: self._num_splits(batch, self.max_model_len))
        with torch.inference_mode():
            self.graphs.capture(lambda inputs, batch: self.model.compute_logits(
                self._forward(inputs)))
        log.info("captured decode graphs for batch sizes %s", self.graphs.buckets)

    # ---- steps ---------------------------------------------------------------------------
    def _num_splits(self, batch: int, max_seq_len: int) -> int:
        from deepinfer.backends.cuda.kernels.decode_attention import choose_num_splits

        return choose_num_splits(batch, self.model_config.num_kv_heads, max_seq_len,
                                 self.num_sms)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    def _eager_inputs(self, batch: ModelBatch) -> StepInputs:
        flat, width = pack_batch(batch)
        splits = self._num_splits(batch.num_seqs, max(batch.seq_lens)) \
            if batch.is_decode_only else 1
        device_flat = torch.from_numpy(flat).to(self.device)
        return unpack_batch(device_flat, batch, width, splits)

    @torch.inference_mode()
    def forward_logits(self, batch: ModelBatch, all_tokens: bool = False) -> torch.Tensor:
        """float32 logits of each sampled sequence's last token (or of every token)."""
        if not all_tokens and self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(batch)
            if list(batch.sample_indices) != list(range(batch.num_seqs)):
                logits = logits[torch.tensor(batch.sample_indices, device=self.device)]
            return logits
        inputs = self._eager_inputs(batch)
        hidden = self._forward(inputs)
        if all_tokens:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[inputs.logits_index])

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        if not batch.sample_indices:
            self.forward_logits(batch)  # a partial prefill chunk only fills the KV cache
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = self.forward_logits(batch)
        with torch.inference_mode():
            return self.sampler.sample(logits, batch.sampling)

    # ---- HiCache host tier ---------------------------------------------------------------
    def host_page_bytes(self) -> int:
        return self._bytes_per_block(self.block_size)

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0) -> HostPoolLayout:
        if not self.on_gpu:
            raise RuntimeError("the host page pool needs a CUDA device")
        from deepinfer.backends.cuda.host_pool import CUDAHostPool

        self.host_pool = CUDAHostPool.allocate(num_pages, self.cache.kv, self.block_size)
        return HostPoolLayout(num_pages, self.host_page_bytes(), num_state_slots, 0, True)

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[int],
                   to_device: bool):
        if self.host_pool is None:
            raise RuntimeError("allocate_host_pool was not called")
        return self.host_pool.copy(self.cache.kv, host_pages, device_blocks, self.block_size,
                                   to_device)

    def memory_stats(self) -> MemoryStats:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters()) \
            if self.model is not None else 0
        total = torch.cuda.mem_get_info(self.device)[1] if self.on_gpu else 0
        extra = {}
        if self.host_pool is not None:
            pages = self.host_pool.pages
            extra["hicache_bytes"] = pages.numel() * pages.element_size()
        return MemoryStats(device_total_bytes=total, weights_bytes=weights,
                           kv_cache_bytes=self.cache.nbytes if self.cache else 0, extra=extra)

    def shutdown(self) -> None:
        self.graphs = None
        self.model = None
        if self.cache is not None:
            self.cache.kv = None
        self.host_pool = None
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _profile_batch(tokens: int, max_len: int, block_size: int) -> ModelBatch:
    """A full token budget of prefill, cut into sequences no longer than the context (rotary
    tables end there), each in its own blocks after the null block."""
    lengths = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    tables, slots, positions, next_block = [], [], [], 1
    for length in lengths:
        used = -(-length // block_size)
        table = list(range(next_block, next_block + used))
        next_block += used
        tables.append(table)
        positions.extend(range(length))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(length))
    return ModelBatch(
        input_ids=[0] * tokens, positions=positions, query_lens=lengths, seq_lens=lengths,
        block_tables=tables, block_size=block_size, slot_mapping=slots,
        sample_indices=list(range(len(lengths))), sampling=[_profile_row()] * len(lengths))


def _profile_row() -> SamplingRow:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, logprobs=5)
    return SamplingRow(params=params, seed=0, step=0, prompt_token_ids=(), output_token_ids=())
