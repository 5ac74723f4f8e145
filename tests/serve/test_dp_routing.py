"""`--dp 2` on the CPU backend through the real server: affinity routing, per-rank metrics,
/health, and greedy answers identical to the one-rank server (the `tiny` checkpoint)."""
from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import openai_client, per_rank, scrape

SYSTEM = "You are a terse assistant. Answer in one short sentence."  # shared by every session
FOLLOW_UPS = ("Why is that?", "Say it again, shorter.", "Thanks. Anything else?")


@pytest.fixture(scope="module")
def dp2(dp2_server):
    return openai_client(dp2_server)


def _chat(client, messages: list[dict], max_tokens: int = 8,
          headers: dict | None = None) -> tuple[str, int, int]:
    """(answer, serving rank, cached prompt tokens) of one greedy chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=messages, temperature=0, max_tokens=max_tokens,
        extra_headers=headers)
    reply = raw.parse()
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].message.content, int(raw.headers["x-deepinfer-rank"]), cached


def _conversation(client, opening: str, turns: int = 3, max_tokens: int = 8,
                  headers: dict | None = None) -> tuple[list[str], list[int], list[int]]:
    """Run a multi-turn chat (each answer goes back into the history); per turn: answer,
    rank, cached tokens."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening}]
    answers, ranks, cached = [], [], []
    for turn in range(turns):
        text, rank, hit = _chat(client, messages, max_tokens, headers)
        answers.append(text)
        ranks.append(rank)
        cached.append(hit)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    return answers, ranks, cached


def test_affinity_keeps_every_turn_of_a_conversation_on_one_rank(dp2):
    # Keyed by the first user message: the shared system prompt must not collapse them.
    by_message = [_conversation(dp2, f"Tell me about topic number {i}.") for i in range(8)]
    # Keyed by the session header alone: every session opens with the same message.
    by_header = [_conversation(dp2, "Hello!", headers={"X-Session-Affinity": f"session-{i}"})
                 for i in range(6)]
    for answers, ranks, cached in by_message + by_header:
        assert len(set(ranks)) == 1, f"a conversation moved between ranks: {ranks}"
        # Later turns extend the earlier prompt, so the same rank's prefix cache hits.
        assert all(c > 0 for c in cached[1:]), cached
    assert {r[0] for _, r, _ in by_message} == {0, 1}
    assert {r[0] for _, r, _ in by_header} == {0, 1}


def _two_turns_home(client, i: int) -> tuple[int, int]:
    """The ranks that served the two turns of conversation i."""
    headers = {"X-Session-Affinity": f"conversation-{i}"}
    messages = [{"role": "user", "content": "Hi"}]
    _, first, _ = _chat(client, messages, max_tokens=1, headers=headers)
    messages += [{"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "Bye"}]
    _, second, _ = _chat(client, messages, max_tokens=1, headers=headers)
    return first, second


def test_affinity_spreads_100_conversations_within_20_percent(dp2, dp2_server):
    before = per_rank(dp2_server.url, "deepinfer:router_decisions_total", reason="affinity")
    # Eight conversations at a time: their loads (a few tokens) stay far below the overload
    # fallback's threshold, so every pick is by affinity as it would be one at a time.
    with ThreadPoolExecutor(8) as pool:
        turns = list(pool.map(lambda i: _two_turns_home(dp2, i), range(100)))
    assert all(first == second for first, second in turns), turns
    homes = [first for first, _ in turns]
    counts = Counter(homes)
    assert all(40 <= counts[rank] <= 60 for rank in (0, 1)), counts
    after = per_rank(dp2_server.url, "deepinfer:router_decisions_total", reason="affinity")
    assert {r: after.get(r, 0) - before.get(r, 0) for r in (0, 1)} == \
        {r: 2.0 * counts[r] for r in (0, 1)}


def test_dp2_greedy_multi_turn_answers_equal_dp1(dp2, client):
    for i in range(4):
        opening = f"Describe item {i} of a shopping list."
        on_two, ranks, _ = _conversation(dp2, opening, turns=3, max_tokens=12)
        on_one, _, _ = _conversation(client, opening, turns=3, max_tokens=12)
        assert on_two == on_one, f"conversation {i} (rank {ranks[0]}) differs from dp=1"


def test_health_and_per_rank_metrics(dp2, dp2_server):
    health = httpx.get(f"{dp2_server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["live"] == [0, 1] and health["dead"] == []
    pids = [r["pid"] for r in health["ranks"]]
    assert len(set(pids)) == 2 and all(r["alive"] and r["exitcode"] is None
                                       for r in health["ranks"])
    for pid in pids:
        os.kill(pid, 0)  # the named processes exist
    _conversation(dp2, "Count to three.", turns=2)
    url = dp2_server.url
    assert per_rank(url, "deepinfer:rank_up") == {0: 1.0, 1: 1.0}
    assert set(per_rank(url, "deepinfer:rank_num_requests_running")) == {0, 1}
    assert set(per_rank(url, "deepinfer:rank_kv_cache_usage_perc")) == {0, 1}
    # The per-rank totals add up to the unlabelled (vLLM-named) series.
    totals = scrape(url)
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        assert sum(per_rank(url, f"deepinfer:rank_{name}_total").values()) == \
            totals[f"vllm:{name}_total"]
    assert sum(per_rank(url, "deepinfer:rank_prefix_cache_hits_total").values()) > 0
    assert per_rank(url, "deepinfer:rank_lost_requests_total") == {0: 0.0, 1: 0.0}


def _pinned(client, rank: int) -> dict:
    """A session header that affinity routes to `rank`."""
    for i in range(64):
        headers = {"X-Session-Affinity": f"lockstep-{i}"}
        if _chat(client, [{"role": "user", "content": "Hi"}], 1, headers)[1] == rank:
            return headers
    raise AssertionError(f"no session went to rank {rank}")


def test_ranks_step_in_lockstep(dp2, dp2_server):
    """--ep: a rank with no request of its own runs a dummy step for each of its peer's."""
    to_zero, to_one = _pinned(dp2, 0), _pinned(dp2, 1)
    before = per_rank(dp2_server.url, "deepinfer:rank_dummy_steps_total")
    _chat(dp2, [{"role": "user", "content": "Name five colours."}], 24, to_zero)
    # Rank 1 reports its counters when it handles a message: give it one.
    _chat(dp2, [{"role": "user", "content": "Hi"}], 1, to_one)
    after = per_rank(dp2_server.url, "deepinfer:rank_dummy_steps_total")
    assert after[1] - before.get(1, 0) >= 24  # a prefill and 23 decodes of rank 0, at least
