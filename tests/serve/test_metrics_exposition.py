"""The whole /metrics exposition (ServerMetrics + RankCollector + EngineCollector +
TokenizerCollector), built from fake rank views, parsed with prometheus_client's own parser:
every family once, every sample once, zero counters present at 0, no NAME_created series, and
every family documented in docs/metrics.md as exposed."""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.models.moe.runtime import RebalanceReport
from deepinfer.serve.metrics.engine import EngineCollector
from deepinfer.serve.metrics.moe import MoECollector
from deepinfer.serve.metrics.ranks import RankCollector
from deepinfer.serve.metrics.server import ServerMetrics
from deepinfer.serve.metrics.tokenizer import TokenizerCollector
from deepinfer.serve.ranks.ipc import EngineStats, ExpertStats
from deepinfer.serve.ranks.router import Router
from deepinfer.serve.ranks.supervisor import RankView

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
IDLE = EngineStats(running=0, waiting=0, kv_usage=0.0, num_blocks=10, prefix_queries=0,
                   prefix_hits=0, preemptions=0)
HICACHE_IDLE = dataclasses.replace(IDLE, hicache_pages_total=8)
HICACHE_BUSY = dataclasses.replace(IDLE, running=1, prefix_queries=64, prefix_hits=16,
                                   hicache_pages_total=8, hicache_pages_used=3,
                                   hicache_lookups=2, hicache_device_hit_tokens=16,
                                   hicache_host_hit_tokens=32, hicache_stored_pages=5,
                                   hicache_load_bytes=4096, hicache_load_seconds=0.5)


@dataclass
class _FakeSegment:
    """The primary backend as TokenizerCollector reads it (segment: adds its cache series)."""

    name: str = "segment"

    def stats(self) -> dict[str, int]:
        return {"hits": 0, "cached_bytes": 0}


@dataclass
class _FakeTokenizer:
    primary: _FakeSegment = field(default_factory=_FakeSegment)

    def stats(self) -> dict[str, Any]:
        return {"name": "segment", "checks": 0, "mismatches": 0, "dropped": 0,
                "encode_latency": {"bounds_s": [0.001, 0.01], "counts": [0, 0, 0],
                                   "sum_s": 0.0}}


CACHE_INFO = {"block_size": "16", "num_gpu_blocks": "10", "enable_prefix_caching": "True"}
# An MoE rank after one EPLB rebalance: 2 MoE layers of 4 experts.
EXPERTS = ExpertStats(0, [[5, 0, 2, 1], [3, 3, 1, 1]], 1, RebalanceReport(0.02, 1.6, 1.1, 64, 3))


def _view(rank: int, stats: EngineStats, experts: ExpertStats | None = None) -> RankView:
    return RankView(rank, alive=True, pid=100 + rank, exitcode=None, in_flight=0,
                    load_tokens=0, lost_requests=0, stats=stats, experts=experts)


def _exposition(stats: list[EngineStats], experts: ExpertStats | None = None) -> str:
    """What GET /metrics answers with these rank stats (observe_engine runs at scrape time);
    with `experts`, every rank serves an MoE model and reports them."""
    views = [_view(rank, s, experts) for rank, s in enumerate(stats)]
    metrics = ServerMetrics("m")
    metrics.registry.register(TokenizerCollector(_FakeTokenizer(), "m"))
    metrics.registry.register(RankCollector(lambda: views, Router(len(views)), "m"))
    metrics.registry.register(MoECollector(lambda: views, "m"))
    metrics.registry.register(EngineCollector(lambda: views, "m", [CACHE_INFO] * len(views)))
    metrics.observe_engine(stats)
    return metrics.render().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return samples[name, tuple(sorted({"model_name": "m", **labels}.items()))]


CASES = {
    "1 rank, hicache off": [IDLE],
    "2 ranks, hicache off": [IDLE, IDLE],
    "1 rank, hicache on, zero": [HICACHE_IDLE],
    "1 rank, hicache on": [HICACHE_BUSY],
    "2 ranks, hicache on": [HICACHE_BUSY, HICACHE_IDLE],
}


@pytest.mark.parametrize("stats", CASES.values(), ids=CASES.keys())
def test_exposition_has_no_duplicate_families_or_samples(stats: list[EngineStats]):
    text = _exposition(stats)
    families = list(text_string_to_metric_families(text))
    names = Counter(f.name for f in families)
    assert [n for n, c in names.items() if c > 1] == []
    # HELP/TYPE blocks too: the parser would merge two blocks of one name only if adjacent.
    help_lines = Counter(line.split(" ")[2] for line in text.splitlines()
                         if line.startswith("# HELP "))
    assert [n for n, c in help_lines.items() if c > 1] == []
    keys = Counter((s.name, tuple(sorted(s.labels.items())))
                   for f in families for s in f.samples)
    assert [k for k, c in keys.items() if c > 1] == []


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_zero_counters_read_zero(num_ranks: int):
    samples = _samples(_exposition([HICACHE_IDLE] * num_ranks))
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "deepinfer:bad_requests_total",
                 "deepinfer:hicache_lookups_total", "deepinfer:hicache_load_seconds_total",
                 "vllm:time_to_first_token_seconds_count"):
        assert _value(samples, name) == 0, name
    for reason in ("stop", "length"):
        assert _value(samples, "vllm:request_success_total", finished_reason=reason) == 0
    for tier in ("device", "host"):
        assert _value(samples, "deepinfer:hicache_hit_tokens_total", tier=tier) == 0
    for rank in map(str, range(num_ranks)):
        assert _value(samples, "deepinfer:rank_lost_requests_total", rank=rank) == 0
        assert _value(samples, "deepinfer:rank_prefix_cache_hits_total", rank=rank) == 0
        assert _value(samples, "deepinfer:rank_hicache_stored_pages_total", rank=rank) == 0
        assert _value(samples, "deepinfer:router_decisions_total", rank=rank,
                      reason="affinity") == 0
        for tier in ("device", "host"):
            assert _value(samples, "deepinfer:rank_hicache_hit_tokens_total", rank=rank,
                          tier=tier) == 0


def test_nonzero_hicache_values_once_each():
    samples = _samples(_exposition([HICACHE_BUSY, HICACHE_IDLE]))
    assert _value(samples, "deepinfer:rank_hicache_hit_tokens_total", rank="0",
                  tier="host") == 32
    assert _value(samples, "deepinfer:rank_hicache_hit_tokens_total", rank="1",
                  tier="host") == 0
    assert _value(samples, "deepinfer:hicache_hit_tokens_total", tier="device") == 16
    assert _value(samples, "vllm:prefix_cache_queries_total") == 64


def _exposed_name(family_name: str, family_type: str) -> str:
    """The name as it appears on the wire (the parser strips a counter's _total)."""
    return f"{family_name}_total" if family_type == "counter" else family_name


def _documented() -> dict[str, str]:
    """{exposed name: type} from the tables of docs/metrics.md (first cell: names, second:
    type)."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1 and cells[1] in ("counter", "gauge",
                                                                    "histogram"):
            for name in re.findall(r"`([a-z_]+:[a-z0-9_]+)`", cells[0]):
                out[name] = cells[1]
    return out


def test_docs_list_every_family_as_exposed():
    parsed = list(text_string_to_metric_families(_exposition([HICACHE_BUSY] * 2, EXPERTS)))
    families = {_exposed_name(f.name, f.type): f.type for f in parsed}
    documented = _documented()
    assert {n: t for n, t in families.items() if documented.get(n) != t} == {}
    assert {n: t for n, t in documented.items() if families.get(n) != t} == {}


def test_moe_series_sum_the_ranks_and_show_the_latest_rebalance():
    samples = _samples(_exposition([IDLE, IDLE], EXPERTS))
    assert _value(samples, "deepinfer:moe_expert_tokens_total", moe_layer="0", expert="0") == 10
    assert _value(samples, "deepinfer:moe_expert_tokens_total", moe_layer="1", expert="3") == 2
    assert _value(samples, "deepinfer:eplb_rebalances_total") == 1
    assert _value(samples, "deepinfer:eplb_imbalance", when="before") == 1.6
    assert _value(samples, "deepinfer:eplb_imbalance", when="after") == 1.1
    assert _value(samples, "deepinfer:eplb_last_stall_seconds") == 0.02
    dense = {name for name, _ in _samples(_exposition([IDLE]))}
    assert not any("moe" in name or "eplb" in name for name in dense)


def test_no_created_series():
    """prometheus_client's NAME_created sample of each counter and histogram is switched
    off."""
    metrics = ServerMetrics("m")
    metrics.observe_request("stop", 3, 2, 0.1, [0.01], 0.2)
    text = _exposition([HICACHE_BUSY] * 2, EXPERTS) + metrics.render().decode()
    assert [line for line in text.splitlines() if "_created" in line] == []


def test_engine_families_per_rank():
    """Rank 0 waits on 2 requests for room and 1 for its grammar, and stepped 3 times (1, 9
    and 600 tokens); rank 1 is dead: its waiting reads 0, its steps stay counted."""
    counts = [0] * 14
    counts[0], counts[2], counts[8] = 1, 1, 1  # (.., 1], (8, 16], (512, 1024]
    busy = dataclasses.replace(IDLE, waiting=3, waiting_deferred=1,
                               step_token_counts=tuple(counts), step_tokens_sum=610)
    views = [_view(0, busy), dataclasses.replace(_view(1, busy), alive=False)]
    metrics = ServerMetrics("m")
    metrics.registry.register(EngineCollector(lambda: views, "m", [CACHE_INFO] * 2))
    samples = _samples(metrics.render().decode())
    waiting = "vllm:num_requests_waiting_by_reason"
    assert _value(samples, waiting, engine="0", reason="capacity") == 2
    assert _value(samples, waiting, engine="0", reason="deferred") == 1
    assert _value(samples, waiting, engine="1", reason="capacity") == 0
    steps = "vllm:iteration_tokens_total"
    for engine in ("0", "1"):
        assert [_value(samples, f"{steps}_bucket", engine=engine, le=le)
                for le in ("1.0", "8.0", "16.0", "512.0", "1024.0", "+Inf")] == [1, 1, 2, 2, 3, 3]
        assert _value(samples, f"{steps}_sum", engine=engine) == 610
        assert _value(samples, f"{steps}_count", engine=engine) == 3
    assert _value(samples, "vllm:cache_config_info", engine="1", **CACHE_INFO) == 1
