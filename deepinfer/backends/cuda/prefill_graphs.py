"""CUDA graphs for a short chunk of one sequence: a prefix hit's last chunk, a short prompt.

Eager, such a chunk is ~10 launches a layer from Python, 20-40 ms of host time over 32 layers
on the H200's hosts against ~6 ms of GPU work for 128 tokens over 32K cached ones (a device
hit's TTFT was that host time). Each bucket of token counts gets a graph that reads one static
int64 buffer: the ids, positions and KV slots padded to the bucket (padding rows write no KV
and are no query), then 0 and the chunk's length (its query starts), the sequence's length,
the row whose logits are kept, and the block table. The attention's key splits are sized for
the longest context the model takes; the kernel cuts them by the sequence's length on the
device, so one graph serves every context.

Without a GPU (the Triton interpreter in CI) nothing is captured and each run records its
bucket afresh from the same buffer, so the tests run what a graph holds.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from deepinfer.backends.cuda.graphs import no_collection
from deepinfer.backends.cuda.step_inputs import AttentionMeta, StepInputs
from deepinfer.core.batch import ModelBatch

Forward = Callable[[StepInputs], torch.Tensor]  # inputs -> float32 logits [1, V]
BUCKETS = (16, 32, 64, 128, 256)  # a hit's last chunk is at most a block (or two, host tier)


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b <= max_tokens)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: recorded afresh at every run (no GPU)
    logits: torch.Tensor | None
    buffer: torch.Tensor  # the bucket's static inputs


class PrefillGraphs:
    def __init__(self, max_tokens: int, max_blocks: int, block_size: int, max_model_len: int,
                 device: torch.device) -> None:
        self.buckets = prefill_buckets(max_tokens)
        self.max_blocks, self.max_model_len, self.device = max_blocks, max_model_len, device
        self.block_size = block_size  # the KV pool's (PagedCache.block_size)
        width = _width(self.buckets[-1], max_blocks) if self.buckets else 0
        # Two pinned stagings used in turn: under async scheduling a step's inputs are written
        # while the step ahead's copy may still be queued.
        self.staging = [torch.zeros(width, dtype=torch.int64, pin_memory=device.type == "cuda")
                        for _ in range(2)]
        self.turn = 0
        self.graphs: dict[int, _Graph] = {}
        self.forward: Forward | None = None  # what runs without a GPU, in place of a replay

    def can_run(self, batch: ModelBatch) -> bool:
        """One sequence's chunk (no decode, no padding, no speculation, no scored prompt
        positions: a graph keeps the last row's logits only) that fits a bucket."""
        last = batch.from_last_step
        return (bool(self.graphs) and batch.num_seqs == 1 and not batch.is_decode_only
                and batch.spec is None and batch.num_padding_seqs == 0
                and not batch.prompt_logprobs
                and (last is None or not len(last.token_indices))
                and batch.num_tokens <= self.buckets[-1]
                and -(-batch.seq_lens[0] // self.block_size) <= self.max_blocks)

    def capture(self, forward: Forward) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        buffers = {t: _padding(t, self.max_blocks, self.device) for t in self.buckets}
        if self.device.type != "cuda":
            self.forward = forward
            self.graphs = {t: _Graph(None, None, buffers[t]) for t in self.buckets}
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), no_collection():
            for tokens in reversed(self.buckets):
                forward(self._inputs(buffers[tokens], tokens))  # warm-up: compiles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream,
                                      capture_error_mode="thread_local"):
                    logits = forward(self._inputs(buffers[tokens], tokens))
                self.graphs[tokens] = _Graph(graph, logits, buffers[tokens])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, batch: ModelBatch) -> torch.Tensor:
        """float32 logits [1, V] of the chunk's last token (valid until the next replay)."""
        tokens = self.buckets[bisect.bisect_left(self.buckets, batch.num_tokens)]
        entry = self.graphs[tokens]
        self.turn ^= 1
        staging = self.staging[self.turn][:entry.buffer.numel()]
        fill(staging.numpy(), batch, tokens, self.max_blocks)
        entry.buffer.copy_(staging, non_blocking=True)
        if entry.graph is None:
            return self.forward(self._inputs(entry.buffer, tokens))
        entry.graph.replay()
        return entry.logits

    def _inputs(self, buffer: torch.Tensor, tokens: int) -> StepInputs:
        """The model's inputs, sliced and converted on the device from the static buffer."""
        t = tokens
        meta = AttentionMeta(
            slot_mapping=buffer[2 * t:3 * t], block_tables=buffer[3 * t + 4:].view(1, -1)
            .to(torch.int32), seq_lens=buffer[3 * t + 2:3 * t + 3].to(torch.int32),
            query_starts=buffer[3 * t:3 * t + 2].to(torch.int32), max_query_len=t,
            decode=False, max_seq_len=self.max_model_len)
        return StepInputs(buffer[:t], buffer[t:2 * t], meta, buffer[3 * t + 3:3 * t + 4])


def _width(tokens: int, max_blocks: int) -> int:
    return 3 * tokens + 4 + max_blocks


def fill(out: np.ndarray, batch: ModelBatch, tokens: int, max_blocks: int) -> None:
    """The chunk into a bucket's buffer layout: ids | positions | slots (padded: id 0,
    position 0, slot -1) | 0, chunk length | sequence length | last row | block table."""
    n, t = batch.num_tokens, tokens
    out[:] = 0
    out[:n] = batch.input_ids
    out[t:t + n] = batch.positions
    out[2 * t:2 * t + n] = batch.slot_mapping
    out[2 * t + n:3 * t] = -1
    out[3 * t + 1] = n
    out[3 * t + 2] = batch.seq_lens[0]
    out[3 * t + 3] = n - 1
    table = batch.block_tables[0][:max_blocks]
    out[3 * t + 4:3 * t + 4 + len(table)] = table


def _padding(tokens: int, max_blocks: int, device: torch.device) -> torch.Tensor:
    """A bucket's buffer holding a harmless chunk (what capture runs): one token at position
    0 of the null block, no KV written."""
    buffer = torch.zeros(_width(tokens, max_blocks), dtype=torch.int64)
    buffer[2 * tokens:3 * tokens] = -1
    buffer[3 * tokens + 1] = 1
    buffer[3 * tokens + 2] = 1
    return buffer.to(device)
