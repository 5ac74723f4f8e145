"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padded rows.

A decode step of a 32-layer model is ~300 small kernels; launched one by one from Python the
launch gaps, not the memory traffic, set the step time at small batches. Each bucket's graph
reads its inputs from the first B rows of one static int64 buffer (a RowLayout: one KV
group's, step_inputs.DecodeRows, or several groups' with state slots, group_inputs'),
unpacks them on the device, runs the model and the LM head, and leaves float32 logits in a
static output and each row's argmax in one static id buffer that every bucket shares. A greedy
step needs nothing more; and a row whose input id the step in flight sampled (async
scheduling) reads it from that buffer inside the graph, so a greedy decode step launches no
kernel outside its graph. Mixed steps stay eager; a short chunk of one sequence has graphs of
its own (prefill_graphs.py).

Without a GPU (the Triton interpreter in CI) nothing is captured and each run records its
bucket afresh from the same rows: the tests run exactly what a graph would hold.
"""
from __future__ import annotations

import bisect
import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from deepinfer.backends.cuda.kernels.argmax import greedy_ids
from deepinfer.backends.cuda.step_inputs import StepInputs
from deepinfer.core.batch import InputsFromLastStep, ModelBatch


# Buckets as in vLLM/SGLang: every size up to 8, then steps of 8 then 16, so padding wastes
# little while the number of graphs (capture time, memory) stays small.
def batch_buckets(max_batch: int) -> tuple[int, ...]:
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, 513, 16))
    chosen = [s for s in sizes if s < max_batch] + [max_batch]
    return tuple(sorted(set(chosen)))


Forward = Callable[[StepInputs, int], torch.Tensor]  # (inputs, batch) -> logits [batch, V]


class RowLayout(Protocol):
    """How a decode batch is packed into int64 rows and unpacked on the device: one group's
    (step_inputs.DecodeRows) or several groups' with state slots (group_inputs)."""

    max_blocks: int
    block_size: int  # the KV pool's (PagedCache.block_size)

    @property
    def width(self) -> int: ...

    @property
    def context_classes(self) -> tuple[int, ...]:
        """The context classes a bucket is captured for (kernels sized by a bound on the
        lengths: a graph per bound)."""

    def context_class(self, longest: int) -> int:
        """The class of a batch whose longest sequence has `longest` tokens."""

    def pad(self, rows: torch.Tensor) -> None:
        """Make every row a harmless padding row (before capture)."""

    def fill(self, rows: np.ndarray, batch: ModelBatch) -> None:
        """The batch into rows[:B], the rest padding."""

    def inputs(self, rows: torch.Tensor, last_tokens: torch.Tensor,
               context: int) -> StepInputs:
        """The model's inputs from rows (ids from last_tokens where a row says so), for the
        graph of context class `context`."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: recorded afresh at every run (no GPU)
    logits: torch.Tensor | None


class DecodeGraphs:
    def __init__(self, max_batch: int, layout: RowLayout, device: torch.device) -> None:
        self.buckets = batch_buckets(max_batch)
        self.layout, self.max_blocks = layout, layout.max_blocks
        width = layout.width
        self.rows = torch.zeros((self.buckets[-1], width), dtype=torch.int64, device=device)
        # Pinned staging so the per-step copy is one asynchronous DMA; two, used in turn,
        # since with async scheduling a step's rows are written while the step ahead (whose
        # copy may not have run yet) is still queued.
        self.host_rows = [torch.zeros((self.buckets[-1], width), dtype=torch.int64,
                                      pin_memory=device.type == "cuda") for _ in range(2)]
        self.turn = 0
        # The last replay's argmax per row; the next replay's rows may take their ids from it.
        self.tokens = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (batch bucket, context class)
        self.forward: Forward | None = None  # what runs without a GPU, in place of a replay

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, batch: ModelBatch) -> bool:
        if not self.graphs or not batch.is_decode_only or batch.num_seqs > self.max_batch:
            return False
        longest = max(batch.seq_lens)
        return -(-longest // self.layout.block_size) <= self.max_blocks

    def capture(self, forward: Forward) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        self.layout.pad(self.rows)
        if self.rows.device.type != "cuda":  # no graphs: each run records its bucket afresh
            self.forward = forward
            self.graphs = {key: _Graph(None, None) for key in self._keys()}
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), no_collection():
            for batch, context in self._keys():
                self.record(forward, batch, context)  # warm-up: compiles the kernels
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls (a HiCache copy, a tokenizer
                # thread's pinned buffers) cannot invalidate this capture.
                with torch.cuda.graph(graph, pool=pool, stream=stream,
                                      capture_error_mode="thread_local"):
                    logits = self.record(forward, batch, context)
                self.graphs[batch, context] = _Graph(graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _keys(self) -> list[tuple[int, int]]:
        """Largest first, so the smaller graphs reuse its memory."""
        return sorted(((b, c) for b in self.buckets for c in self.layout.context_classes),
                      reverse=True)

    def record(self, forward: Forward, batch: int, context: int) -> torch.Tensor:
        """What a bucket's graph runs: unpack the rows, forward, argmax into self.tokens
        (ids are read from it first, in the unpack)."""
        inputs = self.layout.inputs(self.rows[:batch], self.tokens, context)
        logits = forward(inputs, batch)
        greedy_ids(logits, out=self.tokens[:batch])
        return logits

    def bucket_for(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def run(self, batch: ModelBatch, bucket: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [num_seqs, vocab] of a decode-only batch and each row's argmax [num_seqs]
        (valid until the next replay), replayed at its bucket (or a larger one: expert-parallel
        ranks replay the same bucket)."""
        n = batch.num_seqs
        bucket = self.bucket_for(n) if bucket is None else bucket
        self.turn ^= 1
        staging = self.host_rows[self.turn][:bucket]
        self.layout.fill(staging.numpy(), batch)
        self.rows[:bucket].copy_(staging, non_blocking=True)
        self._take_last_step(batch.from_last_step)
        context = self.layout.context_class(max(batch.seq_lens))
        entry = self.graphs[bucket, context]
        if entry.graph is None:
            # A copy of the ids: a GPU's stream reads them before the next replay writes the
            # buffer, while here the next step runs before this one's ids are read.
            return self.record(self.forward, bucket, context)[:n], self.tokens[:n].clone()
        entry.graph.replay()
        return entry.logits[:n], self.tokens[:n]

    def _take_last_step(self, last: InputsFromLastStep | None) -> None:
        """Where the step in flight's ids are not a replay's own argmax (the sampler's, or an
        eager step's), copy them into self.tokens, in stream order, for the rows to index."""
        if last is None:
            return
        sampled = last.source.tokens
        if sampled.data_ptr() != self.tokens.data_ptr():
            self.tokens[:sampled.numel()].copy_(sampled)


@contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection while graphs are captured: a collection there may finalize an
    older engine's graphs, events or pinned buffers, CUDA calls a capture does not allow (the
    likely cause of one invalidated capture in a test process that built engine after
    engine). Collected once before instead."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
