"""Rank HiCache totals become deepinfer:hicache_* metrics (no server needed)."""
from __future__ import annotations

import dataclasses

from deepinfer.serve.metrics.server import ServerMetrics
from deepinfer.serve.ranks.ipc import EngineStats


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_hicache_metrics_from_rank_stats():
    metrics = ServerMetrics("m")
    base = EngineStats(0, 0, 0.0, 10, 0, 0, 0)
    metrics.observe_engine([base])
    assert b"hicache_pages_total{" not in metrics.render()  # off: no host-tier gauges
    rank0 = dataclasses.replace(base, hicache_pages_used=3, hicache_pages_total=8,
                                hicache_lookups=2, hicache_device_hit_tokens=16,
                                hicache_host_hit_tokens=32, hicache_stored_pages=5,
                                hicache_load_bytes=4096, hicache_load_seconds=0.5)
    rank1 = dataclasses.replace(rank0, hicache_pages_used=1, hicache_host_hit_tokens=8)
    metrics.observe_engine([rank0, rank1])
    metrics.observe_engine([dataclasses.replace(rank0, hicache_host_hit_tokens=40), rank1])
    text = metrics.render().decode()
    assert _value(text, 'deepinfer:hicache_pages_used{model_name="m"}') == 4
    assert _value(text, 'deepinfer:hicache_pages_total{model_name="m"}') == 16
    assert _value(text, 'deepinfer:hicache_lookups_total{model_name="m"}') == 4
    assert _value(text, 'deepinfer:hicache_hit_tokens_total{model_name="m",tier="host"}') == 48
    assert _value(text, 'deepinfer:hicache_hit_tokens_total{model_name="m",tier="device"}') == 32
    assert _value(text, 'deepinfer:hicache_load_seconds_total{model_name="m"}') == 1.0
