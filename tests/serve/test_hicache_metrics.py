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


def test_disk_tier_metrics_from_rank_stats():
    metrics = ServerMetrics("m")
    base = EngineStats(0, 0, 0.0, 10, 0, 0, 0, hicache_pages_total=8)
    metrics.observe_engine([base])
    assert b"hicache_disk_pages{" not in metrics.render()  # no disk tier: no disk samples
    rank0 = dataclasses.replace(base, hicache_disk_capacity_bytes=1000, hicache_disk_pages=3,
                                hicache_disk_bytes_used=300, hicache_disk_written_pages=3,
                                hicache_disk_read_pages=2, hicache_disk_corrupt_pages=1)
    rank1 = dataclasses.replace(rank0, hicache_disk_pages=1, hicache_disk_write_stopped=1,
                                hicache_disk_write_errors=4)
    metrics.observe_engine([rank0, rank1])
    metrics.observe_engine([dataclasses.replace(rank0, hicache_disk_read_pages=5), rank1])
    text = metrics.render().decode()
    assert _value(text, 'deepinfer:hicache_disk_pages{model_name="m"}') == 4
    assert _value(text, 'deepinfer:hicache_disk_capacity_bytes{model_name="m"}') == 2000
    assert _value(text, 'deepinfer:hicache_disk_write_stopped{model_name="m"}') == 1
    assert _value(text, 'deepinfer:hicache_disk_read_pages_total{model_name="m"}') == 7
    assert _value(text, 'deepinfer:hicache_disk_corrupt_pages_total{model_name="m"}') == 2
    assert _value(text, 'deepinfer:hicache_disk_write_errors_total{model_name="m"}') == 4


def test_a_shared_pool_is_counted_once():
    """Ranks of the node's shared pool each report the whole pool: its gauges count it once,
    beside a rank with a pool of its own (pinned pages too)."""
    metrics = ServerMetrics("m")
    base = EngineStats(0, 0, 0.0, 10, 0, 0, 0)
    shared = dataclasses.replace(base, hicache_pages_used=5, hicache_pages_total=16,
                                 hicache_pages_pinned=2, hicache_shared=True)
    own = dataclasses.replace(base, hicache_pages_used=1, hicache_pages_total=8,
                              hicache_pages_pinned=1)
    metrics.observe_engine([shared, shared, own])
    text = metrics.render().decode()
    assert _value(text, 'deepinfer:hicache_pages_used{model_name="m"}') == 6
    assert _value(text, 'deepinfer:hicache_pages_total{model_name="m"}') == 24
    assert _value(text, 'deepinfer:hicache_pages_pinned{model_name="m"}') == 3


def test_the_start_log_names_a_shared_pool_once(caplog):
    from deepinfer.serve.api_server import log_hicache
    from deepinfer.serve.ranks.ipc import Ready

    stats = EngineStats(0, 0, 0.0, 10, 0, 0, 0, hicache_pages_total=64, hicache_shared=True)
    ready = [Ready(r, 10, 16, 1024, "cpu", 64, stats) for r in range(2)]
    with caplog.at_level("INFO", logger="deepinfer.serve"):
        log_hicache(ready)
        log_hicache([dataclasses.replace(r, hicache_pages=32, stats=None) for r in ready])
    assert "one host pool of 64 pages of 16 tokens, shared by 2 of 2 ranks" in caplog.text
    assert "32 host pages of 16 tokens per rank (2 ranks)" in caplog.text
