"""NeuronAccelerator: AWS Trainium through one device adapter (device.py), in static shapes.

- The KV pool is fixed (--num-kv-blocks, or the memory budget once) and says so through
  Capabilities, so the scheduler admits only what fits and never preempts.
- Every step is padded to a bucket (buckets.py): the scheduler pads tokens and decode batches,
  this backend pads block tables to a context bucket and the sampled rows to a fixed count.
- Every (bucket, context bucket) graph is built when the KV pool is allocated, then the
  static-shape guard refuses any other shape: on Trainium a new shape would be a compile in the
  middle of serving.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from deepinfer.backends.neuron.attention import StaticMeta
from deepinfer.backends.neuron.buckets import StaticShapeGuard, StaticShapes
from deepinfer.backends.neuron.device import select_device
from deepinfer.backends.neuron.env import neuron_settings
from deepinfer.backends.neuron.moe import StaticMoEExchange
from deepinfer.backends.neuron.ops import NeuronOps
from deepinfer.backends.neuron.timing import RegionTimer, timing_requested
from deepinfer.backends.neuron.xla_audit import (
    GraphAudit,
    XlaCounts,
    hlo_instructions,
    ir_text,
    xla_counts,
)
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.core.accelerator import (
    Accelerator,
    Capabilities,
    MemoryStats,
    ModelInfo,
    ParallelContext,
)
from deepinfer.core.batch import ModelBatch, SamplerOutput
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, cpu_threads
from deepinfer.core.padding import Buckets, dummy_batch, pad_batch
from deepinfer.core.sampler import all_plain_greedy

log = logging.getLogger(__name__)

# The graph kinds of a step run again with dense experts (its grouped ones overflowed): its
# bucket's kind and this suffix.
DENSE = "-dense"


class NeuronAccelerator(Accelerator):
    name = "neuron"

    def __init__(self) -> None:
        self.device = select_device()
        self.distributed_backend = self.device.distributed_backend
        self.capabilities = Capabilities(chunked_prefill=True, fixed_kv_pool=True,
                                         dtypes=("float32", "bfloat16"))
        self.timer = RegionTimer(timing_requested(), self.device.synchronize)
        self.runner = TorchRunner(self.device.torch_device, self.capabilities,
                                  lambda cache: NeuronOps(cache, self.timer),
                                  backend=self.name)
        self.guard = StaticShapeGuard()
        self.audit = GraphAudit() if neuron_settings().audit_graphs and \
            self.device.kind == "xla" else None
        # On XLA, per bucket built at start-up: its HLO size, compilations and compile time.
        self.graph_report: list[dict] = []
        self._hlo_size: int | None = None  # set while a reported bucket is built
        self.flag_row = False  # the last step's logits end with the experts' overflow flag
        self.shapes: StaticShapes | None = None
        self.scratch_slot: int | None = None
        self._forward = self.device.compile(self._step_forward, "step")

    @classmethod
    def is_available(cls) -> bool:
        from deepinfer.backends.neuron.device import available

        return available()

    @classmethod
    def unavailable_reason(cls) -> str:
        from deepinfer.backends.neuron.device import unavailable_reason

        return unavailable_reason()

    def init_device(self, parallel: ParallelContext = ParallelContext()) -> None:
        if self.device.kind == "cpu":
            threads = cpu_threads() or max(1, (os.cpu_count() or 1) // max(1, parallel.world_size))
            torch.set_num_threads(threads)
        self.runner.ops.parallel = parallel

    def configure(self, config: EngineConfig) -> None:
        self.runner.seed = config.seed
        self.config = config

    def load_model(self, spec: ModelSpec) -> ModelInfo:
        info = self.runner.load(spec)
        s = self.config.scheduler
        self.shapes = StaticShapes.plan(s.step_tokens, s.step_seqs,
                                        info.max_model_len, self.config.cache.block_size)
        # The engine reads the buckets after load_model: the scheduler pads to them.
        self.capabilities = dataclasses.replace(
            self.capabilities, token_buckets=self.shapes.token_buckets,
            batch_buckets=self.shapes.batch_buckets)
        return info

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        return self.runner.pool_blocks(cache)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> None:
        # One more state slot for a stateful model: padding reads it and every token but a
        # sequence's last writes it (a step's shape cannot leave them out).
        extra = 1 if num_state_slots else 0
        self.scratch_slot = num_state_slots if extra else None
        self.runner.cache.state_dtype = self.runner.dtype
        self.runner.allocate(num_blocks, block_size, num_state_slots + extra)
        # On XLA the loaded weights (copied in by slices) and the zeroed pool are still traced
        # ops: materialise them now, one graph of their own, or they would ride along in the
        # first bucket's graph and make it differ from every later step of that bucket.
        self.device.end_step()

    # ---- graphs --------------------------------------------------------------------------
    def capture_graphs(self) -> None:
        """Run every bucket once (on Trainium: compile it, or load it from the compiler's
        cache), then freeze the guard."""
        graphs = self.graph_plan()
        cache, start = self.runner.cache, time.perf_counter()
        for i, (kind, size, width) in enumerate(graphs, 1):
            dense = kind.endswith(DENSE)
            batch = _warmup_batch(kind.removesuffix(DENSE), size, cache.block_size,
                                  len(cache.spec.groups))
            if self.device.kind == "xla":
                self._build_reported(batch, width, dense)
            else:
                self.forward_logits(batch, width, dense)
            if i % max(1, len(graphs) // 10) == 0 or i == len(graphs):
                log.info("neuron graphs: %d/%d built (%.1f s)", i, len(graphs),
                         time.perf_counter() - start)
        self.guard.freeze()

    def graph_plan(self) -> list[tuple[str, int, int]]:
        """Every graph built at start-up: the buckets (shapes.graphs()) and, on a traced device
        with experts, the dense rerun of each bucket that can overflow a slot."""
        plan = self.shapes.graphs()
        exchange = self._traced_exchange()
        if exchange is not None:
            plan += [(kind + DENSE, n, w) for kind, n, w in self.shapes.graphs()
                     if exchange.may_overflow(n)]
        return plan

    def _traced_exchange(self) -> StaticMoEExchange | None:
        """The static MoE exchange where a step cannot read its counts back (a compiled
        device): it flags an overflow instead, and the step runs again dense."""
        moe = self.runner.moe
        exchange = moe.static_exchange if moe is not None else None
        if exchange is None or self.device.kind == "cpu":
            return None
        exchange.traced = True
        return exchange

    def _build_reported(self, batch: ModelBatch, width: int, dense: bool) -> None:
        """One bucket's graph on XLA, with what it cost: its HLO instructions (the size of
        what neuronx-cc receives), the compilations it made and their seconds."""
        before = xla_counts()
        self._hlo_size = 0
        self.forward_logits(batch, width, dense)
        delta = xla_counts().minus(before)
        kind = "decode" if batch.is_decode_only else "prefill"
        self.graph_report.append(
            {"kind": kind + (DENSE if dense else ""),
             "size": batch.num_seqs if kind == "decode" else batch.num_tokens,
             "context_blocks": width, "hlo_instructions": self._hlo_size,
             "compiles": delta.compiles, "compile_s": round(delta.compile_seconds, 4)})
        self._hlo_size = None

    # ---- steps ---------------------------------------------------------------------------
    def forward_logits(self, batch: ModelBatch, width: int | None = None,
                       dense: bool = False) -> torch.Tensor:
        """float32 logits of the sampled sequences' last tokens (rows past them: padding),
        then, where the step's grouped experts may overflow on a traced device, one more row:
        the overflow flag (`flag_row`). dense: the step's dense rerun."""
        with self.device.inference():
            return self._run_step(batch, width, dense)[0]

    def _run_step(self, batch: ModelBatch, width: int | None,
                  dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's graph: (logits, their argmax), each ending with the overflow flag
        where the step has one (`flag_row`)."""
        before = None
        if self.audit is not None:
            # XLA runs graphs asynchronously: a graph launched before this step (the last
            # bucket built at start-up, whose result nobody reads) may still be running, and
            # its execution would be counted in this step's.
            self.device.synchronize()
            before = xla_counts()
        blocks = max(len(t) for g in batch.groups for t in g.block_tables)
        width = width or self.shapes.context_bucket(blocks)
        meta = StaticMeta.from_batch(batch, self.runner.cache, width, self.device.torch_device,
                                     self.scratch_slot)
        kind = "decode" if batch.is_decode_only else "prefill"
        exchange = self._traced_exchange()
        if exchange is not None:
            exchange.force_dense, exchange.overflow = dense, None
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device.torch_device)
        rows = self._sample_rows(batch, kind)
        graph = kind + (DENSE if dense else "")
        self.guard.check(graph, ids, meta.tables[0], rows)
        # The real-token count goes in as data: a constant would make a graph per count. [1],
        # not a scalar: PyTorch/XLA traces scalars 0 and 1 as constants.
        real = torch.tensor([batch.num_real_tokens], device=self.device.torch_device)
        self.runner.begin_step(batch.num_tokens, real)
        if self.audit is None:
            out = self._forward(ids, meta, rows)
            if self._hlo_size is not None:  # a bucket built on XLA: measured before its launch
                self._hlo_size = hlo_instructions(out)
            self.device.end_step()
            return out
        # Its inputs: ids, rows, the real count and the metadata's.
        planned = 3 + meta.num_inputs
        return self._audited_forward((graph, ids.shape[0], width), ids, meta, rows, before,
                                     planned)

    def _audited_forward(self, key: tuple, ids: torch.Tensor, meta: StaticMeta,
                         rows: torch.Tensor, before: XlaCounts, inputs: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step checked against its plan (DEEPINFER_NEURON_AUDIT_GRAPHS): while the
        buckets are built, each one's trace is recorded; after, a step that compiles, syncs
        mid-way or moves more than its inputs in raises UnplannedGraphError naming the op."""
        out = self._forward(ids, meta, rows)
        trace = ir_text(out)
        if self._hlo_size is not None:
            self._hlo_size = hlo_instructions(out)
        self.device.end_step()
        delta = xla_counts().minus(before)
        if self.guard.frozen:
            self.audit.check(key, trace, delta, inputs)
        else:
            self.audit.record(key, trace)
        return out

    def _step_forward(self, ids: torch.Tensor, meta: StaticMeta,
                      rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.runner.forward(ids, meta.positions, meta)
        logits = self.runner.logits(hidden[rows])
        # The argmax in the graph: plain greedy steps take their ids out instead of the logits.
        tokens = logits.argmax(dim=-1)
        exchange = self._traced_exchange()
        self.flag_row = exchange is not None and exchange.overflow is not None
        if self.flag_row:  # out with either: no transfer of its own
            flag = exchange.overflow.reshape(1)
            logits = torch.cat((logits, flag.to(logits.dtype).expand(1, logits.shape[1])))
            tokens = torch.cat((tokens, flag.to(tokens.dtype)))
        return logits, tokens

    def _sample_rows(self, batch: ModelBatch, kind: str) -> torch.Tensor:
        """The last token of each sampled sequence, padded to a fixed count (a decode step:
        one a sequence; a prefill step: shapes.sample_rows) with row 0."""
        ends, total = [], 0
        for q in batch.query_lens:
            total += q
            ends.append(total - 1)
        last = [ends[i] for i in batch.sample_indices]
        count = batch.num_seqs if kind == "decode" else self.shapes.sample_rows
        return torch.tensor(last + [0] * (count - len(last)), dtype=torch.long,
                            device=self.device.torch_device)

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        # Sliced on the host: a slice on the device would be a graph per row count.
        count = len(batch.sample_indices)
        if all_plain_greedy(batch.sampling):  # the graph's argmax is the sampler's
            tokens = self._host_output(batch, greedy=True)[:count].tolist()
            return SamplerOutput(token_ids=tokens, logprobs=[None] * count)
        logits = self._host_output(batch, greedy=False)[:count]
        with self.device.inference():
            return self.runner.sample(logits, batch.sampling)

    def _host_output(self, batch: ModelBatch, greedy: bool) -> torch.Tensor:
        """What sampling needs on the host, in one transfer: the greedy ids, or the logits. A
        step whose grouped experts overflowed a slot (its flag, last) runs again with dense
        experts: it writes the same KV slots, now exact. The routers count its routes twice
        in the experts' load (a rare step)."""
        out = self._step_output(batch, greedy, dense=False)
        if not self.flag_row:
            return out
        if out[-1].max() == 0:
            return out[:-1]
        return self._step_output(batch, greedy, dense=True)[:-1]

    def _step_output(self, batch: ModelBatch, greedy: bool, dense: bool) -> torch.Tensor:
        with self.device.inference():
            logits, tokens = self._run_step(batch, None, dense)
        return (tokens if greedy else logits).to("cpu")

    def region_times(self) -> dict[str, dict[str, float]]:
        """DEEPINFER_NEURON_REGION_TIMING=1: device seconds and calls per region since start."""
        return self.timer.snapshot()

    def expert_load(self):
        return self.runner.expert_load()

    def rebalance_experts(self):
        return self.runner.rebalance_experts()

    def memory_stats(self) -> MemoryStats:
        extra = {"static_graphs": self.guard.num_graphs}
        return self.runner.memory_stats(0, extra)

    def shutdown(self) -> None:
        self.runner.shutdown()


def _warmup_batch(kind: str, size: int, block_size: int, num_groups: int) -> ModelBatch:
    """A step of only padding in the null block: `size` one-token sequences (decode) or a
    `size`-token step (prefill)."""
    base = dummy_batch(num_groups, block_size)
    if size == 1:
        return base
    buckets = Buckets(batch=(size,)) if kind == "decode" else Buckets(tokens=(size,))
    return pad_batch(base, buckets, block_size)
