"""CUDAAccelerator: the shared torch runner on NVIDIA GPUs.

Triton kernels for attention (full, sliding-window, MLA), norms, rotary, activation and the KV
write; cuBLAS (through torch) for the GEMMs; CUDA graphs for decode batches; sampling on the GPU
with one host sync per step (the sampled ids); the KV pool sized from the memory a profiling
step leaves; HiCache's host tier moved by a UVA copy kernel. With device="cpu" and
TRITON_INTERPRET=1 the same code runs on the CPU (no graphs), which is how CI checks the
backend end to end.

Llama-family models with sliding and full layers (several KV groups, one per layer) get one
AttentionMeta per group, each layer reading its own (step_inputs.LayerGroupMeta), in eager steps.
Models with several KV groups or per-request state (DeepSeek-V4) get every group's tables and
their state slots (group_inputs.py). Their prefill and mixed steps run eagerly (the compressors
step sequence by sequence there); their decode steps replay graphs too when the model's decode
reads no host list (`graph_decode`), with one extra state slot for the padding rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import deque
from typing import Iterator, Sequence

import torch

from deepinfer.backends.cuda.dummy_batches import (
    profile_batch,
    profile_row,
    split_warmup_batches,
    split_warmup_contexts,
    warmup_batch,
    warmup_token_counts,
)
from deepinfer.backends.cuda.graphs import DecodeGraphs, RowLayout
from deepinfer.backends.cuda.group_inputs import GroupedDecodeRows, grouped_inputs
from deepinfer.backends.cuda.memory import GIB, kv_budget
from deepinfer.backends.cuda.prefill_graphs import PrefillGraphs
from deepinfer.backends.cuda.probe import unavailable_reason
from deepinfer.backends.cuda.settings import cuda_settings
from deepinfer.backends.cuda.spec_graphs import GraphSpeculator
from deepinfer.backends.cuda.step_inputs import (
    DecodeRows,
    LayerGroupMeta,
    StepInputs,
    pack_batch,
    unpack_batch,
)
from deepinfer.backends.torch.host_pool import host_memory
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.backends.torch.speculative import MTPSpeculator
from deepinfer.backends.torch.step_future import DeviceTokens, HostTokenBuffers, fill_from_last_step
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
from deepinfer.core.sampler import all_plain_greedy
from deepinfer.core.transfer import tensor_on, to_device

log = logging.getLogger(__name__)
CONTEXT_CLASSES = (2048, 8192, 32768)  # grouped models' decode graphs: bounds below the longest


class CUDAAccelerator(Accelerator):
    name = "nvidia"
    distributed_backend = "nccl"
    capabilities = Capabilities(chunked_prefill=True, host_page_copy=True,
                                host_copy_skips_null=True, async_output=True,
                                host_pool_shared=True,
                                speculative_decoding=True, rebind_group=True,
                                prompt_logprobs=True,
                                dtypes=("bfloat16", "float16", "float32"),
                                max_num_seqs=256, max_num_batched_tokens=8192)

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        # Until configure() gives the engine's: the backend's own defaults.
        self.max_num_batched_tokens = self.capabilities.max_num_batched_tokens
        self.max_num_seqs = self.capabilities.max_num_seqs
        self.enforce_eager, self.seed = False, 0
        self.num_speculative_tokens = 0  # the model loads its MTP draft layer when > 0
        self.runner: TorchRunner | None = None
        self.info: ModelInfo | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # short chunks of one sequence
        self.host_pool = None
        # Layer-by-layer HiCache loads the next step waits for (copy_pages), and each KV
        # chunk's layer; None: loads go whole, on the engine's stream.
        self._loads: list = []
        self._chunk_layers: list[int] | None = None
        self.host_tokens: HostTokenBuffers | None = None  # launch()'s readback, on a GPU
        # The steps launch() returned lately, newest last: at most one unread at a time.
        self.launched: deque[DeviceTokens] = deque(maxlen=2)
        self.speculator: MTPSpeculator | None = None  # built with the runner
        self.num_sms = 8  # split-K sizing; the device's count once init_device ran on a GPU
        self.parallel = ParallelContext()

    @classmethod
    def is_available(cls) -> bool:
        return unavailable_reason() is None

    @classmethod
    def unavailable_reason(cls) -> str:
        return unavailable_reason() or ""

    @property
    def on_gpu(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    @property
    def cache(self):
        return self.runner.cache if self.runner is not None else None

    def init_device(self, parallel: ParallelContext = ParallelContext()) -> None:
        # Host-side torch ops are small here; ranks on one host share its cores.
        threads = cpu_threads() or max(1, (os.cpu_count() or 1) // max(1, parallel.world_size))
        torch.set_num_threads(threads)
        self.parallel = parallel
        if self.device is None:
            # One rank per GPU; a launcher that sets CUDA_VISIBLE_DEVICES per rank sees one.
            self.device = torch.device("cuda", parallel.rank % torch.cuda.device_count())
        if self.on_gpu:
            torch.cuda.set_device(self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    def rebind_group(self, parallel: ParallelContext) -> None:
        # The replacement rank warms up and captures its graphs as it starts, running the MoE
        # exchange in both: this rank runs them with it, in the same order. Its own graphs
        # held the old group's communicator, so they are captured again.
        self.parallel = parallel
        self.runner.rebind_group(parallel)
        self.graphs = self.prefill_graphs = None
        self.warm_up()
        self.capture_graphs()

    def configure(self, config: EngineConfig) -> None:
        self.max_num_batched_tokens = config.scheduler.step_tokens
        self.max_num_seqs = config.scheduler.step_seqs
        self.enforce_eager, self.seed = config.enforce_eager, config.seed
        self.num_speculative_tokens = config.scheduler.num_speculative_tokens

    # ---- model ---------------------------------------------------------------------------
    def load_model(self, spec: ModelSpec) -> ModelInfo:
        if self.device is None:
            self.init_device()
        # The kernels import triton: only here, so that probing this backend on a machine
        # without a GPU (or without triton) costs nothing and reports nothing.
        from deepinfer.backends.cuda.ops import CUDAOps

        # DEEPINFER_CUDA_GEMV=0 sends one-token projections to cuBLAS too: the baseline the
        # GEMV kernel is measured against (benchmarks/cuda/profile_steps.py).
        use_gemv = cuda_settings().gemv
        self.runner = TorchRunner(self.device, self.capabilities,
                                  lambda cache: CUDAOps(cache, use_gemv, self.num_sms,
                                                        self.max_num_batched_tokens), self.seed,
                                  backend=self.name)
        self.runner.ops.parallel = self.parallel
        self.runner.num_speculative_tokens = self.num_speculative_tokens
        self.speculator = MTPSpeculator(self.runner, self._step_meta)
        self.info = self.runner.load(spec)
        if self.grouped and not self.layer_groups and \
                not self.runner.model.traits.reads_group_meta:
            raise ValueError("the nvidia backend serves a model with per-request state only "
                             "where its data path reads every group's tables")
        return self.info

    @property
    def grouped(self) -> bool:
        """The model has several KV groups or per-request state: eager grouped steps."""
        kv = self.info.kv_spec
        return kv.num_groups != 1 or kv.state_bytes > 0

    @property
    def layer_groups(self) -> bool:
        """Several KV groups whose layers each read one group's tables, no state (the llama
        family with sliding and full layers): each group's AttentionMeta, the layer picks."""
        kv = self.info.kv_spec
        return kv.num_groups > 1 and kv.state_bytes == 0 and \
            not self.runner.model.traits.reads_group_meta

    @property
    def model(self) -> torch.nn.Module | None:
        return self.runner.model if self.runner is not None else None

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        if not self.on_gpu:
            return self.runner.blocks_in(int(cache.kv_cache_memory_gb * GIB), cache.block_size)
        budget = kv_budget(self.device, cache.gpu_memory_utilization,
                           self._profile_peak(cache.block_size))
        log.info("%s", budget.describe())
        # The engine allocates a state slot per running request beside the pages (and the
        # graphs' padding rows one more).
        state = self.info.kv_spec.state_bytes * (self.max_num_seqs + 1)
        return self.runner.blocks_in(budget.kv_bytes - state, cache.block_size)

    def _profile_peak(self, block_size: int) -> int:
        """Peak bytes of the worst step: a full token budget of prefill, then the sampler over
        max_num_seqs rows with the filters that sort the vocabulary."""
        tokens = self.max_num_batched_tokens
        batch = profile_batch(tokens, self.max_model_len, block_size,
                              self.info.kv_spec.num_groups, self.info.kv_spec.state_bytes > 0)
        blocks = 1 + sum(len(table) for table in batch.block_tables)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.allocate_kv_cache(blocks, block_size, len(batch.state_slots))
        scratch = self.cache.nbytes
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            self.runner.begin_step(batch.num_tokens, 0)  # no real token: counts in no load
            hidden = self._forward(self._eager_inputs(batch))
            rows = min(self.max_num_seqs, tokens)
            logits = self.runner.logits(hidden[:rows])
            self.runner.sample(logits, [profile_row()] * rows)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch
        self.cache.free()
        del hidden, logits
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> None:
        # Graphs of a stateful model pad their batch with rows that own one more state slot.
        extra = 1 if self.graphable and num_state_slots else 0
        self.runner.allocate(num_blocks, block_size, num_state_slots + extra)

    def warm_up(self) -> None:
        """On a GPU: warm_up_kernels."""
        if self.on_gpu:
            self.warm_up_kernels()

    def warm_up_kernels(self) -> None:
        """Compile the prefill path's kernels for every chunk-size class before the first
        request (dummy_batches.py), then clear what the dummy chunks wrote."""
        spec, block_size, t0 = self.info.kv_spec, self.cache.block_size, time.perf_counter()
        counts = warmup_token_counts(self.max_num_batched_tokens)
        with torch.inference_mode():
            for tokens in counts:
                for offset in (0, block_size):  # a first chunk, and one after a prefix
                    if offset + tokens > self.max_model_len:
                        continue
                    batch = warmup_batch(tokens, offset, block_size, self.cache.num_blocks,
                                         spec.num_groups, spec.state_bytes > 0)
                    self._warm_up_step(batch)
            if not self.grouped:  # the attention kernels' split counts (one KV group only)
                for context in split_warmup_contexts(self.max_model_len):
                    for batch in split_warmup_batches(context, block_size, self.cache.num_blocks,
                                                      spec.num_groups, spec.state_bytes > 0):
                        self._warm_up_step(batch)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        self.cache.zero_()
        log.info("prefill kernels warmed up for chunks of %d..%d tokens in %.1f s",
                 counts[0], counts[-1], time.perf_counter() - t0)

    def _warm_up_step(self, batch: ModelBatch) -> None:
        self.runner.begin_step(batch.num_tokens, 0)  # no real token: counts in no load
        inputs = self._eager_inputs(batch)
        self.runner.logits(self._forward(inputs)[inputs.logits_index])

    @property
    def graphable(self) -> bool:
        """Decode steps can be captured: one KV group, or a model whose decode step reads
        only device tensors (group_inputs.GroupedDecodeRows)."""
        return not self.grouped or self.runner.model.traits.graph_decode

    @property
    def prefill_graphable(self) -> bool:
        """A short chunk of one sequence can be captured: one KV group of keys and values,
        no MoE (its exchanges and counts follow the real tokens), no speculation."""
        entries = self.info.kv_spec.groups[0].kind.entries
        return (not self.grouped and len(entries) == 2 and self.runner.moe is None
                and not self.num_speculative_tokens)

    def capture_graphs(self) -> None:
        """On a GPU, unless enforce_eager or the model's decode cannot be captured: the
        decode graphs and speculative decoding's."""
        if self.on_gpu and not self.enforce_eager and self.graphable:
            self.record_graphs()

    def record_graphs(self) -> None:
        """Decode graphs for every batch bucket (without a GPU: recorded at each run, which
        is how the tests run them), and speculative decoding's (spec_graphs.py)."""
        layout = self._row_layout(self.cache.block_size)
        self.graphs = DecodeGraphs(self.max_num_seqs, layout, self.device)
        with torch.inference_mode():
            self.graphs.capture(self._capture_forward)
        log.info("captured decode graphs for batch sizes %s", self.graphs.buckets)
        if self.prefill_graphable:
            self.prefill_graphs = PrefillGraphs(self.max_num_batched_tokens, layout.max_blocks,
                                                layout.block_size, self.max_model_len,
                                                self.device)
            with torch.inference_mode():
                self.prefill_graphs.capture(
                    lambda inputs: self.runner.logits(self._forward(inputs)[inputs.logits_index]))
            log.info("captured prefill graphs for one sequence's chunks of up to %s tokens",
                     self.prefill_graphs.buckets)
        if self.num_speculative_tokens:
            self.speculator = GraphSpeculator(self.runner, self._step_meta,
                                              self.num_speculative_tokens, self.max_num_seqs,
                                              layout, self.device)
            with torch.inference_mode():
                self.speculator.capture()
            log.info("captured speculative decoding's verify and draft graphs")

    def _row_layout(self, block_size: int) -> RowLayout:
        max_blocks = -(-self.max_model_len // block_size)
        if not self.grouped:
            return DecodeRows(max_blocks, block_size,
                              lambda batch: self._num_splits(batch, self.max_model_len))
        spec, state = self.info.kv_spec, self.cache.state
        group_of = {layer: g.index for g in spec.groups for layer in g.layers}
        null_slot = 0 if state is None else state.shape[0] - 1
        # Shorter contexts get graphs of their own: DeepSeek-V4's indexer scores and ranks as
        # many entries as the class's bound allows (up to 2048 tokens, V4's 512 picks of 4,
        # none: every entry is picked).
        bounds = [b for b in CONTEXT_CLASSES if b < self.max_model_len]
        classes = tuple(bounds + [self.max_model_len])
        return GroupedDecodeRows(spec.num_groups, max_blocks, block_size, group_of, classes,
                                 null_slot)

    # ---- steps ---------------------------------------------------------------------------
    def _num_splits(self, batch: int, max_seq_len: int) -> int:
        from deepinfer.backends.cuda.kernels.decode_attention import choose_num_splits

        entries = self.info.kv_spec.groups[0].kind.entries
        kv_heads = entries[0].shape[0] if len(entries[0].shape) > 1 else 1  # MLA: one latent
        return choose_num_splits(batch, kv_heads, max_seq_len, self.num_sms)

    def _capture_forward(self, inputs: StepInputs, batch: int) -> torch.Tensor:
        """A bucket's forward as its graph records it: MoE exchanges sized to the bucket
        (every rank replays the same bucket, see forward_logits)."""
        if self.runner.moe is not None:
            self.runner.moe.padded_tokens = batch
        return self.runner.logits(self._forward(inputs))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.runner.forward(inputs.input_ids, inputs.positions, inputs.meta)

    def _eager_inputs(self, batch: ModelBatch) -> StepInputs:
        if self.layer_groups:
            inputs = self._layer_group_inputs(batch)
        elif self.grouped:
            inputs = grouped_inputs(batch, self.info.kv_spec, self.device)
        else:
            inputs = self._one_group_inputs(batch)
        fill_from_last_step(inputs.input_ids, batch.from_last_step)
        return inputs

    def _one_group_inputs(self, batch: ModelBatch) -> StepInputs:
        flat, width = pack_batch(batch, self.cache.block_size)
        splits = self._num_splits(batch.num_seqs, max(batch.seq_lens)) \
            if batch.is_decode_only else 1
        device_flat = to_device(torch.from_numpy(flat), self.device)
        return unpack_batch(device_flat, batch, width, splits)

    def _layer_group_inputs(self, batch: ModelBatch) -> StepInputs:
        """One group's inputs per KV group (their ids and positions alike: the first's are
        the step's), and the layers' map to them."""
        per_group = [self._one_group_inputs(dataclasses.replace(batch, groups=(group,)))
                     for group in batch.groups]
        spec = self.info.kv_spec
        group_of = {layer: g.index for g in spec.groups for layer in g.layers}
        first = per_group[0]
        meta = LayerGroupMeta([inputs.meta for inputs in per_group], group_of)
        return StepInputs(first.input_ids, first.positions, meta, first.logits_index)

    def forward_logits(self, batch: ModelBatch, all_tokens: bool = False) -> torch.Tensor:
        """float32 logits of each sampled sequence's last token (or of every token)."""
        return self._step_logits(batch, all_tokens)[0]

    @torch.inference_mode()
    def _step_logits(self, batch: ModelBatch, all_tokens: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward_logits', and the greedy ids of those rows where a decode graph computed
        them (None otherwise)."""
        # Behind a HiCache load a step runs eagerly: its layers wait for their own pages, and
        # launching them overlaps the copy (a graph would wait for all of it first).
        if not all_tokens and not self._loads and self.prefill_graphs is not None and \
                self.prefill_graphs.can_run(batch):
            return sampled_rows(self.prefill_graphs.run(batch), batch), None
        graphable = not all_tokens and self.graphs is not None and self.graphs.can_run(batch)
        padded, graphable = self._agree(batch, graphable)
        if graphable:
            self._await_loads()
            bucket = self.graphs.bucket_for(padded)
            self._set_step(bucket, batch)
            logits, greedy = self.graphs.run(batch, bucket)
            rows = sampled_rows(logits, batch)
            return rows, (greedy if rows is logits else None)
        self._set_step(padded, batch)
        inputs = self._eager_inputs(batch)
        with self._layer_waits():
            hidden = self._forward(inputs)
        if all_tokens:
            return self.runner.logits(hidden), None
        return self.runner.logits(hidden[inputs.logits_index]), None

    def _agree(self, batch: ModelBatch, graphable: bool) -> tuple[int, bool]:
        """MoE under expert parallel: every rank runs the same exchange size, and all replay a
        graph or none (a collective); otherwise this rank's own size."""
        moe = self.runner.moe
        size = batch.num_seqs if graphable else batch.num_tokens  # equal for decode graphs
        return (size, graphable) if moe is None else moe.agree(size, graphable)

    def _set_step(self, padded: int, batch: ModelBatch) -> None:
        if self.runner.moe is not None:
            self.runner.moe.set_step(padded, batch.num_real_tokens)

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        self.launched.clear()  # a step read to its end: stores order after the stream again
        if batch.spec is not None or batch.prompt_logprobs:
            self._await_loads()
        if batch.spec is not None:  # eager: a verify step's queries are 1 + k tokens long
            with torch.inference_mode():
                return self.speculator.execute(batch)
        if batch.prompt_logprobs:
            return self._execute_scoring(batch)
        logits, greedy = self._step_logits(batch)
        if greedy is not None and all_plain_greedy(batch.sampling):
            return SamplerOutput(greedy.tolist(), [None] * len(batch.sampling))
        with torch.inference_mode():
            return self.runner.sample(logits, batch.sampling)

    @torch.inference_mode()
    def _execute_scoring(self, batch: ModelBatch) -> SamplerOutput:
        """A step that scores prompt positions runs eagerly: the graphs keep the logits of the
        sampled rows only, the scored rows need their hidden states."""
        padded, _ = self._agree(batch, False)
        self._set_step(padded, batch)
        inputs = self._eager_inputs(batch)
        hidden = self._forward(inputs)
        out = self.runner.sample(self.runner.logits(hidden[inputs.logits_index]),
                                 batch.sampling)
        return dataclasses.replace(out, prompt_logprobs=self.runner.prompt_logprobs(hidden, batch))

    def _step_meta(self, batch: ModelBatch):
        """The attention metadata of an eager step (the speculator's forwards)."""
        return self._eager_inputs(batch).meta

    def launch(self, batch: ModelBatch) -> DeviceTokens:
        logits, tokens = self._step_logits(batch)
        if self.host_tokens is None and self.on_gpu:
            self.host_tokens = HostTokenBuffers(self.max_num_seqs)
        with torch.inference_mode():
            if tokens is None or not all_plain_greedy(batch.sampling):
                tokens = self.runner.sample_tokens(logits, batch.sampling)
            future = DeviceTokens(tokens, self.host_tokens)
        self.launched.append(future)
        return future

    def expert_load(self):
        return self.runner.expert_load()

    def rebalance_experts(self):
        return self.runner.rebalance_experts()

    # ---- HiCache host tier ---------------------------------------------------------------
    def host_page_bytes(self) -> int:
        return self.runner.block_bytes(self.cache.block_size)

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0,
                           shared_file: str | None = None) -> HostPoolLayout:
        if not self.on_gpu:
            raise RuntimeError("the host page pool needs a CUDA device")
        from deepinfer.backends.cuda.host_pool import CUDAHostPool
        from deepinfer.backends.cuda.page_copy import DeviceChunks

        pairs = self.cache.chunk_tensors()
        chunks = DeviceChunks.prepare([t for _, t in pairs], [c.group for c, _ in pairs],
                                      self.cache.num_blocks)
        self.host_pool = CUDAHostPool.allocate(num_pages, chunks, shared_file=shared_file)
        # Per-layer waits need every KV read to go through the ops' layer accessor: not so for
        # models that read the grouped tables from the step metadata (DeepSeek-V4).
        if cuda_settings().layer_loads and not self.runner.model.traits.reads_group_meta:
            self._chunk_layers = [c.layer for c, _ in pairs]
        # State slots are bookkeeping only, as on the CPU backend: the one model with state
        # (DeepSeek-V4) keeps it in its pages (KVSpec.state_in_pages), so HiCache asks for none
        # and never calls copy_state.
        return HostPoolLayout(num_pages, self.host_page_bytes(), num_state_slots, 0, True,
                              host_memory(self.host_pool.pages))

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[Sequence[int]],
                   to_device: bool):
        if self.host_pool is None:
            raise RuntimeError("allocate_host_pool was not called")
        # A null block in device_blocks[g][i] leaves group g of page i alone
        # (host_copy_skips_null): sliding-window models' freed pages.
        if to_device and self._chunk_layers is not None:
            load = self.host_pool.load_layers(host_pages, device_blocks, self._chunk_layers)
            if load is not None:
                self._loads.append(load)
            return load
        return self.host_pool.copy(host_pages, device_blocks, to_device, self._read_upto())

    def _await_loads(self) -> None:
        """The engine's stream waits for every layer of the loads since the last step (a step
        that cannot wait layer by layer: a graph replay, a verify or scoring step)."""
        stream = torch.cuda.current_stream(self.device) if self._loads else None
        for load in self._loads:
            load.wait_all(stream)
        self._loads = []

    @contextlib.contextmanager
    def _layer_waits(self) -> Iterator[None]:
        """While the step's forward is enqueued, each layer waits for its own pages of the
        loads since the last step, just before it reads its KV."""
        loads, self._loads = self._loads, []
        if not loads:
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        ops = self.runner.ops
        ops.layer_gate = lambda layer: [load.wait_layer(layer, stream) for load in loads]
        try:
            yield
        finally:
            ops.layer_gate = None
            for load in loads:  # layers the forward never touched: still in order after it
                load.wait_all(stream)

    def _read_upto(self) -> torch.cuda.Event | None:
        """The end of the newest launched step whose tokens the host has read (None: none in
        `launched`). The core stores the pages a step computed when it takes that step's
        tokens, so a store starts there, not behind the step launched since (under async
        scheduling, the next prefill chunk: a long prompt's last two chunks were stored after
        it ended, and a host-tier hit right behind it waited for both)."""
        return next((f.event for f in reversed(self.launched) if f.read), None)

    def memory_stats(self) -> MemoryStats:
        total = torch.cuda.mem_get_info(self.device)[1] if self.on_gpu else 0
        extra = {}
        if self.host_pool is not None:
            pages = self.host_pool.pages
            extra["hicache_bytes"] = pages.numel() * pages.element_size()
        if self.runner is None:
            return MemoryStats(total, 0, 0, extra)
        return self.runner.memory_stats(total, extra)

    def shutdown(self) -> None:
        self.graphs = self.prefill_graphs = None
        self.speculator = None  # its graphs and static buffers hold device memory
        if self.runner is not None:
            self.runner.shutdown()
        self.host_pool = None
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def sampled_rows(logits: torch.Tensor, batch: ModelBatch) -> torch.Tensor:
    """The rows of per-sequence logits whose sequences sample this step (none for a dummy
    step: its one padding sequence samples nothing)."""
    if list(batch.sample_indices) == list(range(batch.num_seqs)):
        return logits
    index = tensor_on(batch.sample_indices, logits.device)
    return logits[index]
