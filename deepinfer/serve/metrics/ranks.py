"""Per-rank Prometheus series and the router's decisions, read at scrape time.

The unlabelled (vllm:*, deepinfer:hicache_*) series of ServerMetrics stay the sums over ranks;
this collector adds a twin of each engine series named deepinfer:rank_* with a `rank` label,
plus what only the API process knows per rank: liveness, in-flight requests, routed load,
requests lost to a rank's death, and the router's decisions by rank and reason.

Ranks report running totals, so the per-rank counters are exposed as those totals directly;
a dead rank keeps its last report (counters never go back) and its gauges read 0.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.serve.ranks.ipc import EngineStats
from deepinfer.serve.ranks.router import DECISIONS, Router
from deepinfer.serve.ranks.supervisor import RankView

# (series suffix, EngineStats field, help): gauges, then running totals (counters).
_GAUGES = (
    ("num_requests_running", "running", "Requests in the rank's running batch"),
    ("num_requests_waiting", "waiting", "Requests queued on the rank"),
    ("kv_cache_usage_perc", "kv_usage", "Fraction of the rank's KV blocks in use"),
    ("hicache_pages_used", "hicache_pages_used", "Host KV pages holding data on the rank"),
    ("hicache_pages_total", "hicache_pages_total", "Host KV pages of the rank"),
)
_TOTALS = (
    ("prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "prefix_hits", "Prompt tokens served from the device prefix cache"),
    ("num_preemptions", "preemptions", "Requests preempted"),
    ("dummy_steps", "dummy_steps", "Steps run with no request of the rank's own, to match "
     "busy peers' collectives (--ep: ranks step in lockstep)"),
    ("hicache_lookups", "hicache_lookups", "Admitted requests that looked up the host tier"),
    ("hicache_stored_pages", "hicache_stored_pages", "KV pages written through to host"),
    ("hicache_loaded_pages", "hicache_loaded_pages", "KV pages loaded from host on a hit"),
    ("hicache_evicted_pages", "hicache_evicted_pages", "Host KV pages evicted"),
    ("hicache_load_bytes", "hicache_load_bytes", "Bytes copied host to device"),
    ("hicache_store_bytes", "hicache_store_bytes", "Bytes copied device to host"),
    ("hicache_load_seconds", "hicache_load_seconds", "Seconds spent copying host to device"),
    ("hicache_store_seconds", "hicache_store_seconds", "Seconds spent copying device to host"),
    ("spec_decode_num_drafts", "spec_drafts", "Decode steps of a sequence that verified drafts"),
    ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens verified"),
    ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
)


def _reports(suffix: str, stats: EngineStats) -> bool:
    """Whether the rank has the series: HiCache's only with HiCache on, speculative decoding's
    only where it speculates."""
    if suffix.startswith("hicache"):
        return bool(stats.hicache_pages_total)
    if suffix.startswith("spec_decode"):
        return bool(stats.spec_tokens)
    return True


class RankCollector(Collector):
    def __init__(self, ranks: Callable[[], list[RankView]], router: Router,
                 model_name: str) -> None:
        self.ranks, self.router, self.model_name = ranks, router, model_name

    def collect(self) -> Iterator[Metric]:
        views = self.ranks()
        yield from self._api_side(views)
        yield self._decisions()
        reported = [(v, v.stats) for v in views if v.stats is not None]
        yield from self._engine_series(reported, _GAUGES, GaugeMetricFamily, True)
        yield from self._engine_series(reported, _TOTALS, CounterMetricFamily, False)
        yield self._hicache_hits(reported)
        yield from self._regions(reported)

    def _regions(self, reported: list[tuple[RankView, EngineStats]]) -> Iterator[Metric]:
        """Device time per region of the steps (backends that time them, e.g. the Neuron
        backend with DEEPINFER_NEURON_REGION_TIMING=1)."""
        seconds = self._family(CounterMetricFamily, "backend_region_seconds", "Device seconds "
                               "spent in each region of the rank's steps", ("region",))
        calls = self._family(CounterMetricFamily, "backend_region_calls", "Times each region "
                             "of the rank's steps ran", ("region",))
        for v, stats in reported:
            for region, totals in sorted(stats.regions.items()):
                labels = [self.model_name, str(v.rank), region]
                seconds.add_metric(labels, totals["seconds"])
                calls.add_metric(labels, totals["calls"])
        yield from (seconds, calls)

    def _family(self, kind, name: str, doc: str, extra: tuple[str, ...] = ()) -> Metric:
        return kind(f"deepinfer:{name}", doc, labels=["model_name", "rank", *extra])

    def _api_side(self, views: list[RankView]) -> Iterator[Metric]:
        up = self._family(GaugeMetricFamily, "rank_up", "1 while the rank process serves, "
                          "0 once it has died")
        failed = self._family(GaugeMetricFamily, "rank_failed", "1 once the rank is given "
                              "up on (it died --max-rank-restarts times in a row; not "
                              "restarted)")
        in_flight = self._family(GaugeMetricFamily, "rank_in_flight_requests",
                                 "Requests the API process has on the rank")
        load = self._family(GaugeMetricFamily, "rank_load_tokens", "Prompt tokens of the "
                            "rank's in-flight requests (what least-loaded routing compares)")
        lost = self._family(CounterMetricFamily, "rank_lost_requests", "In-flight requests "
                            "failed with 503 because the rank died")
        for v in views:
            labels = [self.model_name, str(v.rank)]
            up.add_metric(labels, 1.0 if v.alive else 0.0)
            failed.add_metric(labels, 1.0 if v.state == "failed" else 0.0)
            in_flight.add_metric(labels, v.in_flight)
            load.add_metric(labels, v.load_tokens)
            lost.add_metric(labels, v.lost_requests)
        yield from (up, failed, in_flight, load, lost)

    def _decisions(self) -> Metric:
        family = self._family(CounterMetricFamily, "router_decisions", "Routing decisions by "
                              "the rank chosen and the reason", ("reason",))
        # Every (rank, reason) pair from the start, at 0 until it happens: a series that
        # appears only with its first increment loses that increment to rate().
        for rank in range(self.router.num_ranks):
            for reason in DECISIONS:
                count = self.router.decisions_by_rank.get((reason, rank), 0)
                family.add_metric([self.model_name, str(rank), reason], count)
        return family

    def _engine_series(self, reported: list[tuple[RankView, EngineStats]],
                       table: tuple[tuple[str, str, str], ...], family_cls: type[Metric],
                       dead_reads_zero: bool) -> Iterator[Metric]:
        """One family per (suffix, field, doc) row. A dead rank's gauges read 0; its counters
        keep their last value (counters never go down)."""
        for suffix, field, doc in table:
            family = self._family(family_cls, f"rank_{suffix}", doc)
            for v, s in reported:
                if not _reports(suffix, s):
                    continue
                value = getattr(s, field) if v.alive or not dead_reads_zero else 0.0
                family.add_metric([self.model_name, str(v.rank)], value)
            yield family

    def _hicache_hits(self, reported: list[tuple[RankView, EngineStats]]) -> Metric:
        """Hit tokens by tier. Its own family, built once per scrape: built inside
        _engine_series it came out once per table, a duplicate family."""
        hits = self._family(CounterMetricFamily, "rank_hicache_hit_tokens", "Prompt tokens "
                            "served from a cache tier (device or host) where HiCache is on",
                            ("tier",))
        for v, s in reported:
            if s.hicache_pages_total:
                for tier in ("device", "host"):
                    hits.add_metric([self.model_name, str(v.rank), tier],
                                    getattr(s, f"hicache_{tier}_hit_tokens"))
        return hits
