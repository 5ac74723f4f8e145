"""Speculative decoding's counters reach /metrics: summed over ranks, advanced by what changed
since each rank's last report, present only where a rank speculates."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from deepinfer.serve.metrics.server import ServerMetrics
from deepinfer.serve.ranks.ipc import EngineStats


def _stats(**spec) -> EngineStats:
    return EngineStats(0, 0, 0.0, 10, 0, 0, 0, **spec)


def _samples(metrics: ServerMetrics) -> dict[tuple, float]:
    text = metrics.render().decode()
    return {(s.name, s.labels.get("position")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("deepinfer:spec_decode") and s.name.endswith("_total")}


def test_spec_decode_series_sum_rank_totals():
    metrics = ServerMetrics("m")
    assert _samples(metrics) == {}
    metrics.observe_engine([_stats(spec_tokens=2, spec_drafts=3, spec_draft_tokens=6,
                                   spec_accepted_tokens=4, spec_accepted_per_position=(3, 1)),
                            _stats()])
    metrics.observe_engine([_stats(spec_tokens=2, spec_drafts=4, spec_draft_tokens=8,
                                   spec_accepted_tokens=5, spec_accepted_per_position=(4, 1)),
                            _stats(spec_tokens=2, spec_drafts=1, spec_draft_tokens=2,
                                   spec_accepted_tokens=2, spec_accepted_per_position=(1, 1))])
    assert _samples(metrics) == {
        ("deepinfer:spec_decode_num_drafts_total", None): 5,
        ("deepinfer:spec_decode_num_draft_tokens_total", None): 10,
        ("deepinfer:spec_decode_num_accepted_tokens_total", None): 7,
        ("deepinfer:spec_decode_num_accepted_tokens_per_pos_total", "0"): 5,
        ("deepinfer:spec_decode_num_accepted_tokens_per_pos_total", "1"): 2}
