"""Per-rank series, router decisions and the /health body from rank views (no server)."""
from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.serve.api.app import health_body
from deepinfer.serve.metrics.ranks import RankCollector
from deepinfer.serve.ranks.ipc import EngineStats
from deepinfer.serve.ranks.router import Router
from deepinfer.serve.ranks.supervisor import RankView

BASE = EngineStats(running=2, waiting=1, kv_usage=0.25, num_blocks=10, prefix_queries=100,
                   prefix_hits=40, preemptions=0)


def _render(views: list[RankView], router: Router) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(RankCollector(lambda: views, router, "m"))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _view(rank: int, stats: EngineStats | None, alive: bool = True, **kw) -> RankView:
    fields = dict(pid=100 + rank, exitcode=None if alive else -9, in_flight=0, load_tokens=0,
                  lost_requests=0)
    fields.update(kw)
    return RankView(rank, alive, stats=stats, **fields)


def test_rank_series_and_router_decisions():
    router = Router(2)
    router.reserve("h:a", 10)
    router.mark_dead(router.home("h:a"))
    router.pick("h:a")  # moved off its dead home rank
    hosted = dataclasses.replace(BASE, hicache_pages_total=8, hicache_pages_used=3,
                                 hicache_host_hit_tokens=32, hicache_stored_pages=5)
    views = [_view(0, hosted, in_flight=1, load_tokens=10),
             _view(1, BASE, alive=False, lost_requests=3)]
    m = _render(views, router)
    r0, r1 = '{model_name="m",rank="0"}', '{model_name="m",rank="1"}'
    assert m[f"deepinfer:rank_up{r0}"] == 1 and m[f"deepinfer:rank_up{r1}"] == 0
    assert m[f"deepinfer:rank_num_requests_running{r0}"] == 2
    assert m[f"deepinfer:rank_num_requests_running{r1}"] == 0  # dead: its gauges read 0
    assert m[f"deepinfer:rank_prefix_cache_hits_total{r1}"] == 40  # totals stay
    assert m[f"deepinfer:rank_lost_requests_total{r1}"] == 3
    assert m[f"deepinfer:rank_in_flight_requests{r0}"] == 1
    assert m[f"deepinfer:rank_load_tokens{r0}"] == 10
    assert m[f"deepinfer:rank_hicache_stored_pages_total{r0}"] == 5
    assert m['deepinfer:rank_hicache_hit_tokens_total{model_name="m",rank="0",tier="host"}'] == 32
    assert f"deepinfer:rank_hicache_pages_total{r1}" not in m  # HiCache off there
    home = router.home("h:a")
    assert m[f'deepinfer:router_decisions_total{{model_name="m",rank="{home}",'
             f'reason="affinity"}}'] == 1
    assert m[f'deepinfer:router_decisions_total{{model_name="m",rank="{1 - home}",'
             f'reason="rerouted_dead"}}'] == 1


def test_backend_region_times_per_rank():
    """A backend's step regions (the Neuron backend's DEEPINFER_NEURON_REGION_TIMING) appear
    as per-rank counters; a rank that times nothing adds no series."""
    timed = dataclasses.replace(BASE, regions={"attention": {"seconds": 1.5, "calls": 30},
                                               "experts": {"seconds": 0.25, "calls": 15}})
    m = _render([_view(0, timed), _view(1, BASE)], Router(2))
    r0 = 'model_name="m",rank="0"'
    assert m[f'deepinfer:backend_region_seconds_total{{{r0},region="attention"}}'] == 1.5
    assert m[f'deepinfer:backend_region_calls_total{{{r0},region="experts"}}'] == 15
    assert not any('rank="1",region' in name for name in m)


def test_health_body_names_dead_ranks():
    ok = health_body([_view(0, BASE), _view(1, BASE)])
    assert (ok["status"], ok["live"], ok["dead"]) == ("ok", [0, 1], [])
    degraded = health_body([_view(0, BASE), _view(1, None, alive=False, lost_requests=2,
                                                   state="dead", restarts=1)])
    assert (degraded["status"], degraded["live"], degraded["dead"]) == ("degraded", [0], [1])
    assert degraded["ranks"][1] == {"rank": 1, "alive": False, "state": "dead", "restarts": 1,
                                    "pid": 101, "exitcode": -9, "in_flight": 0,
                                    "load_tokens": 0, "lost_requests": 2}
    # Without the API key, /health names no process.
    anonymous = health_body([_view(0, BASE)], detailed=False)["ranks"][0]
    assert "pid" not in anonymous and "exitcode" not in anonymous
    given_up = health_body([_view(0, BASE), _view(1, None, alive=False, state="failed")])
    assert (given_up["status"], given_up["dead"], given_up["failed"]) == ("failed", [1], [1])
    down = health_body([_view(0, None, alive=False)])
    assert (down["status"], down["live"]) == ("unavailable", [])


def test_spec_decode_twins_only_where_a_rank_speculates():
    speculating = dataclasses.replace(BASE, spec_tokens=2, spec_drafts=7, spec_draft_tokens=12,
                                      spec_accepted_tokens=9)
    m = _render([_view(0, speculating), _view(1, BASE)], Router(2))
    r0 = '{model_name="m",rank="0"}'
    assert m[f"deepinfer:rank_spec_decode_num_drafts_total{r0}"] == 7
    assert m[f"deepinfer:rank_spec_decode_num_draft_tokens_total{r0}"] == 12
    assert m[f"deepinfer:rank_spec_decode_num_accepted_tokens_total{r0}"] == 9
    assert not any(k.startswith("deepinfer:rank_spec_decode") and 'rank="1"' in k for k in m)
