"""vLLM's request and engine families on a live server (the shared tiny server), checked
against what the responses themselves report (usage), the server's flags, and arithmetic of the
steps; no NAME_created series; and every query of the Grafana dashboard names only series the
server exports."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from conftest import TINY_BLOCK_SIZE, TINY_NUM_KV_BLOCKS
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "deepinfer.json"
MODEL = "tiny-chat"
# The families added for vLLM's dashboards: type, and labels besides model_name.
FAMILIES = {
    "vllm:request_prompt_tokens": ("histogram", {"engine"}),
    "vllm:request_generation_tokens": ("histogram", {"engine"}),
    "vllm:request_params_n": ("histogram", {"engine"}),
    "vllm:request_params_max_tokens": ("histogram", {"engine"}),
    "vllm:request_queue_time_seconds": ("histogram", {"engine"}),
    "vllm:request_prefill_time_seconds": ("histogram", {"engine"}),
    "vllm:request_decode_time_seconds": ("histogram", {"engine"}),
    "vllm:request_inference_time_seconds": ("histogram", {"engine"}),
    "vllm:iteration_tokens_total": ("histogram", {"engine"}),
    "vllm:num_requests_waiting_by_reason": ("gauge", {"engine", "reason"}),
    "vllm:cache_config_info": ("gauge", {"engine", "block_size", "num_gpu_blocks",
                                         "num_gpu_blocks_override", "num_cpu_blocks",
                                         "enable_prefix_caching", "gpu_memory_utilization"}),
}
# Bodies sent (all end by length: ignore_eos, so the steps they take are known), with the
# number of generations (prompts) and samples (prompts x n) each makes.
REQUESTS = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 7, "n": 2}, 1, 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there!"}],
                              "max_tokens": 5}, 1, 1),
    ("/v1/completions", {"prompt": ["One two three", "Four five six seven"], "max_tokens": 4},
     2, 2),
]


def _text(server) -> str:
    import httpx

    return httpx.get(f"{server.url}/metrics", timeout=10.0).text


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


@pytest.fixture(scope="module")
def traffic(tiny_server, http):
    """The scrapes before and after REQUESTS, and their responses."""
    tiny_server.wait_idle()  # nothing of an earlier module still finishing
    before = _text(tiny_server)
    responses = []
    for path, body, _, _ in REQUESTS:
        r = http.post(path, json={"model": MODEL, "ignore_eos": True, "prefix_cache": False,
                                  **body})
        assert r.status_code == 200, r.text
        responses.append(r.json())
    tiny_server.wait_idle()
    return _samples(before), _text(tiny_server), responses


def test_new_families_have_vllm_types_and_labels(traffic):
    _, after, _ = traffic
    families = {f.name: f for f in text_string_to_metric_families(after)}
    for name, (kind, extra) in FAMILIES.items():
        assert families[name].type == kind, name
        label_sets = {frozenset(s.labels) - {"le"} for s in families[name].samples}
        assert label_sets == {frozenset({"model_name", *extra})}, name


def test_no_created_series(traffic):
    _, after, _ = traffic
    assert [line for line in after.splitlines() if "_created" in line] == []


def test_request_histograms_follow_the_responses(traffic):
    before, after_text, responses = traffic
    after = _samples(after_text)

    def grew(name: str) -> float:
        return _value(after, name, engine="0") - _value(before, name, engine="0")

    generations = sum(g for _, _, g, _ in REQUESTS)
    completion = sum(r["usage"]["completion_tokens"] for r in responses)
    prompt = sum(r["usage"]["prompt_tokens"] for r in responses)
    assert grew("vllm:request_generation_tokens_count") == generations
    assert grew("vllm:request_generation_tokens_sum") == completion
    assert grew("vllm:request_prompt_tokens_sum") == prompt
    assert grew("vllm:request_params_n_sum") == sum(b.get("n", 1) * g for _, b, g, _ in REQUESTS)
    assert grew("vllm:request_params_max_tokens_sum") == \
        sum(b["max_tokens"] * g for _, b, g, _ in REQUESTS)
    phases = {p: grew(f"vllm:request_{p}_time_seconds_sum")
              for p in ("queue", "prefill", "decode", "inference")}
    for p in phases:
        assert grew(f"vllm:request_{p}_time_seconds_count") == generations, p
    assert phases["prefill"] > 0 and phases["decode"] > 0 and phases["queue"] >= 0
    # inference = prefill + decode for each request, so for their sums too.
    assert math.isclose(phases["inference"], phases["prefill"] + phases["decode"],
                        rel_tol=1e-6, abs_tol=1e-9)
    # The rank's part of a request lies inside what the API process timed (one machine clock).
    e2e = _value(after, "vllm:e2e_request_latency_seconds_sum") - \
        _value(before, "vllm:e2e_request_latency_seconds_sum")
    assert e2e >= phases["queue"] + phases["inference"]


def test_iteration_tokens_count_every_computed_token(traffic):
    """Without the prefix cache every sample computes its whole prompt, then one token per
    output token but its last (the last is sampled and never fed back)."""
    before, after_text, responses = traffic
    after = _samples(after_text)
    samples = sum(s for _, _, _, s in REQUESTS)
    prompt_per_sample = sum(r["usage"]["prompt_tokens"] * (b.get("n", 1))
                            for (_, b, _, _), r in zip(REQUESTS, responses))
    completion = sum(r["usage"]["completion_tokens"] for r in responses)
    name = "vllm:iteration_tokens_total"
    grew = _value(after, f"{name}_sum", engine="0") - _value(before, f"{name}_sum", engine="0")
    assert grew == prompt_per_sample + completion - samples
    steps = _value(after, f"{name}_count", engine="0") - \
        _value(before, f"{name}_count", engine="0")
    assert steps >= max(b["max_tokens"] for _, b, _, _ in REQUESTS)
    assert _value(after, f"{name}_bucket", engine="0", le="+Inf") == \
        _value(after, f"{name}_count", engine="0")


def test_engine_families_read_the_rank(traffic):
    _, after_text, _ = traffic
    after = _samples(after_text)
    for reason in ("capacity", "deferred"):  # idle: both present, at 0
        assert ("vllm:num_requests_waiting_by_reason", tuple(sorted(
            {"model_name": MODEL, "engine": "0", "reason": reason}.items()))) in after
        assert _value(after, "vllm:num_requests_waiting_by_reason", engine="0",
                      reason=reason) == 0
    info = {"engine": "0", "block_size": str(TINY_BLOCK_SIZE),
            "num_gpu_blocks": str(TINY_NUM_KV_BLOCKS),
            "num_gpu_blocks_override": str(TINY_NUM_KV_BLOCKS), "num_cpu_blocks": "0",
            "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9"}
    assert _value(after, "vllm:cache_config_info", **info) == 1


# PromQL words that are not metric names: functions (followed by "("), aggregation
# modifiers and keywords; label lists after by/without/on/ignoring/group_* are dropped first.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # dashboard variables
    expr = re.sub(r"\boffset\s+-?\w+", " ", expr)  # offset durations
    names = set()
    for m in re.finditer(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        following = expr[m.end():].lstrip()[:1]
        if following != "(" and m.group().lower() not in _KEYWORDS:
            names.add(m.group())
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(vllm:x_bucket'
                        '{model_name=~"$model_name"}[$__rate_interval])))') == {"vllm:x_bucket"}
    assert metric_names("sum(rate(a:b[5m])) / on (engine) sum(c_total offset 1m) > 2e3") == \
        {"a:b", "c_total"}


def test_dashboard_queries_name_exported_series(traffic):
    _, after_text, _ = traffic
    exported = {name for name, _ in _samples(after_text)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    variable = dashboard["templating"]["list"][1]["query"]["query"]
    exprs.append(re.fullmatch(r"label_values\((.+), model_name\)", variable).group(1))
    assert exprs
    missing = {e: metric_names(e) - exported for e in exprs if metric_names(e) - exported}
    assert missing == {}
    assert all(metric_names(e) for e in exprs)  # each selects something
