"""Prometheus view of the prompt tokenizer, read from its own counters at scrape time."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from deepinfer.serve.tokenizer import VerifiedTokenizer

BACKENDS = ("fastokens", "segment", "hf")


class TokenizerCollector(Collector):
    def __init__(self, tokenizer: VerifiedTokenizer, model_name: str) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.tokenizer.stats()
        labels = ["model_name"]
        backend = GaugeMetricFamily("deepinfer_tokenizer:backend",
                                    "1 for the prompt tokenizer backend in use",
                                    labels=labels + ["backend"])
        for name in BACKENDS:
            backend.add_metric([self.model_name, name], 1.0 if stats["name"] == name else 0.0)
        yield backend
        yield self._latency(stats["encode_latency"])
        for key, help_text in (("checks", "Prompts re-encoded by hf to verify the backend"),
                               ("mismatches", "Verification checks whose ids differed"),
                               ("dropped", "Verification checks dropped (queue full)")):
            family = CounterMetricFamily(f"deepinfer_tokenizer:verify_{key}", help_text,
                                         labels=labels)
            family.add_metric([self.model_name], stats.get(key, 0))
            yield family
        yield from self._segment_cache()

    def _latency(self, latency: dict) -> Metric:
        family = HistogramMetricFamily("deepinfer_tokenizer:encode_seconds",
                                       "Prompt encode latency", labels=["model_name"])
        buckets, running = [], 0
        for bound, count in zip(list(latency["bounds_s"]) + [float("inf")], latency["counts"]):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
        family.add_metric([self.model_name], buckets, latency["sum_s"])
        return family

    def _segment_cache(self) -> Iterator[Metric]:
        primary = self.tokenizer.primary
        if primary.name != "segment":
            return
        stats = primary.stats()
        hits = CounterMetricFamily("deepinfer_tokenizer:segment_cache_hits",
                                   "Prompt pieces served from the segment cache",
                                   labels=["model_name"])
        hits.add_metric([self.model_name], stats["hits"])
        size = GaugeMetricFamily("deepinfer_tokenizer:segment_cache_bytes",
                                 "Bytes held by the segment cache", labels=["model_name"])
        size.add_metric([self.model_name], stats["cached_bytes"])
        yield hits
        yield size
