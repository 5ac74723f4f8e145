"""Prometheus metrics of the API process, named as vLLM names them where they mean the same, so
existing dashboards and scorers read them. Engine series are refreshed from rank stats at
scrape time.

With several API processes (--api-server-count) the metric values live in prometheus_client's
multiprocess files (PROMETHEUS_MULTIPROC_DIR, set before any process imports the library), and
any process's /metrics reads them all: request series are summed over the processes, engine
series come from process 0 alone (every process sees the same rank stats; summing would count
them once per process), and it refreshes them every second as well as when it is scraped.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from deepinfer.serve.ranks.ipc import EngineStats
from deepinfer.serve.settings import serve_settings

# HiCache running totals reported by each rank (EngineStats.hicache_<name>), as counters.
_HICACHE_TOTALS = (
    ("lookups", "Admitted requests that looked up the host KV tier"),
    ("stored_pages", "KV pages written through from device to host"),
    ("loaded_pages", "KV pages loaded from host into device blocks on a hit"),
    ("evicted_pages", "Host KV pages evicted (LRU) to make room"),
    ("load_bytes", "Bytes copied host to device"),
    ("store_bytes", "Bytes copied device to host"),
    ("load_seconds", "Seconds spent copying host to device"),
    ("store_seconds", "Seconds spent copying device to host"),
)
# The disk tier's (EngineStats.hicache_disk_<name>): gauges summed over ranks, then totals.
_DISK_GAUGES = (
    ("pages", "KV pages on disk, all ranks"),
    ("bytes_used", "Bytes of KV pages on disk, all ranks"),
    ("capacity_bytes", "Disk space for KV pages, all ranks"),
    ("write_queue", "KV pages waiting for or in write-back to disk"),
    ("write_stopped", "Ranks whose write-back to disk stopped on an error (the disk full)"),
)
_DISK_TOTALS = (
    ("written_pages", "KV pages written back from host to disk"),
    ("write_bytes", "Bytes written to disk"),
    ("write_seconds", "Seconds of disk writes (worker threads)"),
    ("write_errors", "Disk writes that failed"),
    ("write_dropped", "KV pages not written back: the queue was full or write-back stopped"),
    ("read_pages", "KV pages read from disk into host pages"),
    ("read_bytes", "Bytes read from disk"),
    ("read_seconds", "Seconds of disk reads (worker threads)"),
    ("corrupt_pages", "KV pages on disk that failed their checksum: deleted, not served"),
    ("evicted_pages", "KV pages deleted from disk (LRU) to stay within the space"),
    ("unawaited_prefetches", "Prompts admitted before their KV pages from disk were all "
     "read: the disk reads a page slower than the engine recomputes it"),
)
# The finish reasons a recorded generation can have (serve/api/generation.py: "abort" for one the
# client left or the server aborted before its end); failed requests are not recorded.
_FINISH_REASONS = ("stop", "length", "abort")
# Why the server closed a connection early (serve/api/connections.py).
_CLOSE_REASONS = ("header_timeout", "body_timeout", "write_timeout", "over_capacity")
# Speculative decoding running totals (EngineStats.spec_<name>), as vLLM's spec_decode series.
_SPEC_TOTALS = (
    ("drafts", "num_drafts", "Decode steps of a sequence that verified drafts"),
    ("draft_tokens", "num_draft_tokens", "Draft tokens verified"),
    ("accepted_tokens", "num_accepted_tokens", "Draft tokens accepted"),
)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's buckets for the phases of a request (queue, prefill, decode, inference).
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for the `n` request parameter
_PHASES = (
    ("queue", "vllm:request_queue_time_seconds", "Seconds from a request's arrival at its "
     "rank to its first step"),
    ("prefill", "vllm:request_prefill_time_seconds", "Seconds from a request's first step to "
     "its first token on the rank (preemptions included)"),
    ("decode", "vllm:request_decode_time_seconds", "Seconds from a request's first token to "
     "its last on the rank (preemptions included)"),
    ("inference", "vllm:request_inference_time_seconds", "Seconds from a request's first step "
     "to its last token on the rank: prefill + decode"),
)


def buckets_1_2_5(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's buckets for token counts, up to the
    context length)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > most:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class Phases:
    """Where a generation's time went on its rank, in seconds (RequestTimes differences)."""

    queue: float
    prefill: float
    decode: float
    inference: float


def _pool_sum(stats: list[EngineStats], name: str) -> int:
    """A host-pool gauge over ranks: each rank's own pool counts, the node's shared pool (which
    every rank of it reports whole) once."""
    own = sum(getattr(s, name) for s in stats if not s.hicache_shared)
    return own + max((getattr(s, name) for s in stats if s.hicache_shared), default=0)


def multiprocess_mode() -> bool:
    return bool(serve_settings().metrics_dir)


class ServerMetrics:
    def __init__(self, model_name: str, observes_engine: bool = True, num_engines: int = 1,
                 max_model_len: int = 8192) -> None:
        # No NAME_created series (prometheus_client adds one per counter and histogram by
        # default): no dashboard reads them, and each is one more series for every scraper
        # to store. The switch is the library's, for this process; every API process (the
        # processes that export) builds this.
        disable_created_metrics()
        # The process's own collectors (ranks, tokenizer) go here; the metrics below too,
        # unless they are multiprocess values (render reads those from the files).
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.multiprocess = multiprocess_mode()
        self.observes_engine = observes_engine  # False: another process exports engine series
        r, labels = (None if self.multiprocess else self.registry), ["model_name"]
        self.requests = Counter("vllm:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels,
                                         registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency end to end",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        # Gauges set by one process: the latest value wins across the multiprocess files.
        gauge = dict(registry=r, multiprocess_mode="mostrecent")
        self.running = Gauge("vllm:num_requests_running", "Requests in a batch", labels,
                             **gauge)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", labels, **gauge)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              labels, **gauge)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the "
                                   "prefix cache", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted", labels,
                                   registry=r)
        self.hicache_pages_used = Gauge("deepinfer:hicache_pages_used", "Host KV pages "
                                        "holding data, all ranks", labels, **gauge)
        self.hicache_pages_total = Gauge("deepinfer:hicache_pages_total", "Host KV pages, all "
                                         "ranks", labels, **gauge)
        self.hicache_pages_pinned = Gauge("deepinfer:hicache_pages_pinned", "Host KV pages "
                                          "held by a copy or disk job in flight, all ranks",
                                          labels, **gauge)
        self.hicache_hit_tokens = Counter("deepinfer:hicache_hit_tokens", "Prompt tokens served "
                                          "from a cache tier (device or host) where HiCache is "
                                          "on", labels + ["tier"], registry=r)
        self.hicache = {name: Counter(f"deepinfer:hicache_{name}", doc, labels, registry=r)
                        for name, doc in _HICACHE_TOTALS}
        self.disk_gauges = {name: Gauge(f"deepinfer:hicache_disk_{name}", doc, labels, **gauge)
                            for name, doc in _DISK_GAUGES}
        self.disk = {name: Counter(f"deepinfer:hicache_disk_{name}", doc, labels, registry=r)
                     for name, doc in _DISK_TOTALS}
        # Ranks report running totals; counters advance by the change since the last report.
        self._seen: dict[tuple[int, str], float] = {}
        self.bad_requests = Counter("deepinfer:bad_requests", "Requests answered with 400",
                                    labels, registry=r)
        self.closed_connections = Counter(
            "deepinfer:http_connections_closed", "Connections the server closed early, by "
            "reason: request headers or body too slow, a response write blocked on a client "
            "that does not read, or over --max-connections", labels + ["reason"], registry=r)
        self.spec = {name: Counter(f"deepinfer:spec_decode_{series}", doc, labels, registry=r)
                     for name, series, doc in _SPEC_TOTALS}
        self.spec_per_position = Counter(
            "deepinfer:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
            "each draft position (0: the first draft)", labels + ["position"], registry=r)
        self.engines = [str(rank) for rank in range(num_engines)]
        self._request_histograms(r, labels + ["engine"], max_model_len)
        self._zero_series()

    def _request_histograms(self, r: CollectorRegistry | None, labels: list[str],
                            max_model_len: int) -> None:
        """vLLM's per-request histograms, by the rank (`engine`) that served the request."""
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request", labels,
            buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Tokens generated for a request (all n choices)",
            labels, buckets=tokens, registry=r)
        self.request_params_n = Histogram(
            "vllm:request_params_n", "The n request parameter", labels, buckets=_N_BUCKETS,
            registry=r)
        self.request_params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter, where a "
            "request set it", labels, buckets=tokens, registry=r)
        self.phases = {name: Histogram(series, doc, labels, buckets=_PHASE_BUCKETS, registry=r)
                       for name, series, doc in _PHASES}

    def _zero_series(self) -> None:
        """Create the labelled children that exist from the start, so a counter that has not
        moved reads 0 instead of being absent (rate() misses a series' first increment, and
        dashboards cannot tell "none yet" from "not exported"). The HiCache series are left
        to _observe_hicache: they exist only where a rank runs with HiCache."""
        m = self.model_name
        for reason in _FINISH_REASONS:
            self.requests.labels(m, reason)
        for reason in _CLOSE_REASONS:
            self.closed_connections.labels(m, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.prefix_queries, self.prefix_hits, self.preemptions,
                       self.bad_requests):
            metric.labels(m)
        for metric in (self.request_prompt_tokens, self.request_generation_tokens,
                       self.request_params_n, self.request_params_max_tokens,
                       *self.phases.values()):
            for engine in self.engines:
                metric.labels(m, engine)

    def observe_engine(self, stats: list[EngineStats | None]) -> None:
        if not self.observes_engine:
            return
        live = [s for s in stats if s is not None]
        m = self.model_name
        self.running.labels(m).set(sum(s.running for s in live))
        self.waiting.labels(m).set(sum(s.waiting for s in live))
        if live:
            self.kv_usage.labels(m).set(sum(s.kv_usage for s in live) / len(live))
        for rank, s in enumerate(stats):
            if s is None:
                continue
            self._advance(self.prefix_queries, rank, "queries", s.prefix_queries)
            self._advance(self.prefix_hits, rank, "hits", s.prefix_hits)
            self._advance(self.preemptions, rank, "preemptions", s.preemptions)
            if s.hicache_pages_total:
                self._observe_hicache(rank, s)
            if s.spec_tokens:
                self._observe_spec(rank, s)
        with_host = [s for s in live if s.hicache_pages_total]
        for name in ("used", "total", "pinned") if with_host else ():
            gauge = getattr(self, f"hicache_pages_{name}")
            gauge.labels(m).set(_pool_sum(with_host, f"hicache_pages_{name}"))
        with_disk = [s for s in live if s.hicache_disk_capacity_bytes]
        for name, gauge in self.disk_gauges.items() if with_disk else ():
            gauge.labels(m).set(sum(getattr(s, f"hicache_disk_{name}") for s in with_disk))

    def _observe_hicache(self, rank: int, s: EngineStats) -> None:
        for name, counter in self.hicache.items():
            self._advance(counter, rank, f"hicache_{name}", getattr(s, f"hicache_{name}"))
        for tier in ("device", "host"):
            self._advance(self.hicache_hit_tokens, rank, f"hicache_{tier}_hits",
                          getattr(s, f"hicache_{tier}_hit_tokens"), tier)
        if s.hicache_disk_capacity_bytes:
            for name, counter in self.disk.items():
                self._advance(counter, rank, f"hicache_disk_{name}",
                              getattr(s, f"hicache_disk_{name}"))

    def _observe_spec(self, rank: int, s: EngineStats) -> None:
        """Series that exist where a rank speculates (created at 0 with its first report)."""
        for name, counter in self.spec.items():
            self._advance(counter, rank, f"spec_{name}", getattr(s, f"spec_{name}"))
        for position, total in enumerate(s.spec_accepted_per_position):
            self._advance(self.spec_per_position, rank, f"spec_pos_{position}", total,
                          str(position))

    def _advance(self, counter: Counter, rank: int, key: str, total: float,
                 *labels: str) -> None:
        last = self._seen.get((rank, key), 0)
        child = counter.labels(self.model_name, *labels)  # created at 0 on a first report
        if total > last:
            child.inc(total - last)
        self._seen[(rank, key)] = total

    def observe_request(self, finish_reason: str, prompt_tokens: int, output_tokens: int,
                        ttft: float | None, itls: list[float], e2e: float, engine: int = 0,
                        n: int = 1, max_tokens: int | None = None,
                        phases: Phases | None = None) -> None:
        """One generation that ended; `engine`: the rank that served it; `phases`: where its
        time went on the rank (None when the rank did not finish it: aborted)."""
        m, e = self.model_name, str(engine)
        self.request_prompt_tokens.labels(m, e).observe(prompt_tokens)
        self.request_generation_tokens.labels(m, e).observe(output_tokens)
        self.request_params_n.labels(m, e).observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.labels(m, e).observe(max_tokens)
        if phases is not None:
            for name, histogram in self.phases.items():
                histogram.labels(m, e).observe(getattr(phases, name))
        self.requests.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        itl = self.itl.labels(m)  # once: labels() takes a lock and builds a key each call
        for gap in itls:
            itl.observe(gap)
        self.e2e.labels(m).observe(e2e)

    def connection_closed(self, reason: str) -> None:
        self.closed_connections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        files = CollectorRegistry()
        MultiProcessCollector(files)
        return generate_latest(files) + generate_latest(self.registry)
