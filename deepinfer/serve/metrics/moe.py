"""MoE series of /metrics, read at scrape time from the ranks' latest ExpertStats: tokens
routed to each expert of each MoE layer (summed over ranks: the load EPLB balances), and the
EPLB rebalances with the stall and the imbalance (max/mean tokens per rank) before and after
the latest one. Nothing is exported for a dense model."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.serve.ranks.rank import RankView


class MoECollector(Collector):
    def __init__(self, ranks: Callable[[], list[RankView]], model_name: str) -> None:
        self.ranks, self.model_name = ranks, model_name

    def collect(self) -> Iterator[Metric]:
        reports = [v.experts for v in self.ranks() if v.experts is not None]
        if not reports:
            return
        yield self._expert_tokens(reports)
        yield from self._rebalances(reports)

    def _expert_tokens(self, reports: list) -> Metric:
        family = CounterMetricFamily("deepinfer:moe_expert_tokens", "Tokens routed to the "
                                     "expert (top-k routes, all ranks)",
                                     labels=["model_name", "moe_layer", "expert"])
        layers = len(reports[0].load)
        for layer in range(layers):
            for expert in range(len(reports[0].load[layer])):
                total = sum(r.load[layer][expert] for r in reports)
                family.add_metric([self.model_name, str(layer), str(expert)], total)
        return family

    def _rebalances(self, reports: list) -> Iterator[Metric]:
        # Every rank rebalances at the same step: the furthest-along report speaks for all.
        latest = max(reports, key=lambda r: r.rebalances)
        labels = [self.model_name]
        count = CounterMetricFamily("deepinfer:eplb_rebalances", "EPLB rebalances (expert "
                                    "placement recomputed, weights moved)",
                                    labels=["model_name"])
        count.add_metric(labels, latest.rebalances)
        yield count
        report = latest.last_rebalance
        if report is None:
            return
        stall = GaugeMetricFamily("deepinfer:eplb_last_stall_seconds", "Seconds the ranks "
                                  "stopped serving for the latest rebalance",
                                  labels=["model_name"])
        stall.add_metric(labels, report.stall_s)
        imbalance = GaugeMetricFamily("deepinfer:eplb_imbalance", "Max over mean tokens per "
                                      "rank over the latest rebalance's window, under the "
                                      "placement before and after it",
                                      labels=["model_name", "when"])
        imbalance.add_metric([*labels, "before"], report.imbalance_before)
        imbalance.add_metric([*labels, "after"], report.imbalance_after)
        yield from (stall, imbalance)
