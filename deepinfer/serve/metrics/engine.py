"""vLLM's engine families that a rank's reports fill, per rank, read at scrape time.

vLLM labels these by `engine` (its data-parallel engine index); here the engine is the rank
(`"0"` ... `"N-1"`), so a dashboard made for vLLM reads them unchanged:

* `vllm:iteration_tokens_total`: tokens per engine step (each rank keeps the histogram as
  running totals, core/histogram.py, and reports it whole);
* `vllm:num_requests_waiting_by_reason`: the rank's waiting requests by why they wait;
* `vllm:cache_config_info`: the KV cache's settings as labels, on a gauge that reads 1.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from deepinfer.core.config import CacheConfig
from deepinfer.core.histogram import STEP_TOKEN_BOUNDS
from deepinfer.serve.ranks.ipc import EngineStats, Ready
from deepinfer.serve.ranks.supervisor import RankView

# vLLM's reasons: "capacity" waits for room in a step (token budget, sequence slots, KV
# blocks); "deferred" waits on something else first: here, its grammar being prepared.
WAITING_REASONS = ("capacity", "deferred")


def cache_config_labels(cache: CacheConfig, ready: Ready) -> dict[str, str]:
    """A rank's cache settings under the names vLLM's CacheConfig gives the same things
    (values written as Python writes them, as vLLM does): the KV blocks of the rank, the
    null block included; --num-kv-blocks as the override; host-tier pages as CPU blocks."""
    return {"block_size": str(ready.block_size),
            "num_gpu_blocks": str(ready.num_blocks),
            "num_gpu_blocks_override": str(cache.num_blocks),
            "num_cpu_blocks": str(ready.hicache_pages),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization)}


def _waiting(stats: EngineStats, reason: str) -> int:
    deferred = stats.waiting_deferred
    return deferred if reason == "deferred" else stats.waiting - deferred


class EngineCollector(Collector):
    def __init__(self, ranks: Callable[[], list[RankView]], model_name: str,
                 cache_info: list[dict[str, str]]) -> None:
        """`cache_info`: cache_config_labels of each rank, as the ranks started."""
        self.ranks, self.model_name, self.cache_info = ranks, model_name, cache_info

    def collect(self) -> Iterator[Metric]:
        reported = [v for v in self.ranks() if v.stats is not None]
        yield self._step_tokens(reported)
        yield self._waiting_by_reason(reported)
        yield self._cache_config()

    def _step_tokens(self, reported: list[RankView]) -> Metric:
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens per engine step: prompt tokens (prefill "
            "chunks), decoded tokens and drafts verified, as computed by the step",
            labels=["model_name", "engine"])
        for v in reported:
            counts = v.stats.step_token_counts or (0,) * (len(STEP_TOKEN_BOUNDS) + 1)
            buckets, seen = [], 0
            # Bounds written as prometheus_client's Histogram writes them ("8.0"), as vLLM's.
            for bound, count in zip((*map(floatToGoString, STEP_TOKEN_BOUNDS), "+Inf"), counts):
                seen += count
                buckets.append((bound, seen))
            family.add_metric([self.model_name, str(v.rank)], buckets, v.stats.step_tokens_sum)
        return family

    def _waiting_by_reason(self, reported: list[RankView]) -> Metric:
        family = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Requests waiting on the rank, by reason: "
            "capacity (room in a step: token budget, sequence slots, KV blocks) or deferred "
            "(its grammar being prepared); they sum to vllm:num_requests_waiting",
            labels=["model_name", "engine", "reason"])
        for v in reported:  # a dead rank reads 0, as its other gauges
            for reason in WAITING_REASONS:
                value = _waiting(v.stats, reason) if v.alive else 0
                family.add_metric([self.model_name, str(v.rank), reason], value)
        return family

    def _cache_config(self) -> Metric:
        keys = sorted(self.cache_info[0]) if self.cache_info else []
        family = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's settings of each "
                                   "rank (in the labels; the value is 1)",
                                   labels=["model_name", "engine", *keys])
        for rank, info in enumerate(self.cache_info):
            family.add_metric([self.model_name, str(rank), *(info[k] for k in keys)], 1.0)
        return family
