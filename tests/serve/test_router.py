"""The data-parallel router: affinity keys, rendezvous hashing, load fallback, dead ranks."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from deepinfer.serve.ranks.router import NoLiveRankError, Router, affinity_key, route_key

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 20}
TOOLS_SYSTEM = {"role": "system", "content": "You can call tools: get_weather, search."}


def _conversation(i: int, turns: int) -> list[dict]:
    messages = [SYSTEM, {"role": "user", "content": f"Conversation {i}: tell me about topic {i}."}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t} for {i}"},
                     {"role": "user", "content": f"follow-up {t}"}]
    return messages


def _key(messages, headers=None, user=None, prompt=None) -> str:
    return affinity_key(headers or {}, user, messages, prompt)


# ---- keys ------------------------------------------------------------------------------------
def test_headers_beat_user_beat_messages_beat_prompt():
    msgs = _conversation(1, 1)
    both = {"X-Correlation-ID": "corr", "x-session-affinity": "sess"}
    assert route_key(both, "alice", msgs, "p").source == "header"
    assert _key(msgs, both, "alice") == _key(None, {"X-SESSION-AFFINITY": "sess"})
    assert _key(msgs, {"x-correlation-id": "corr"}, "alice") == \
        _key(None, {"X-Correlation-Id": "corr"})
    assert route_key({"content-type": "json"}, "alice", msgs).source == "user"
    assert _key(msgs, user="alice") == _key(_conversation(2, 3), user="alice")
    assert route_key({}, None, msgs, "prompt").source == "message"
    assert route_key({}, None, None, "x" * 1000).source == "prompt"
    assert _key(None, prompt="x" * 256 + "a") == _key(None, prompt="x" * 256 + "b")
    assert _key(None, prompt=list(range(300))) == _key(None, prompt=list(range(256)) + [7])
    assert _key(None, prompt=[1, 2]) != _key(None, prompt="1,2")  # distinct namespaces
    assert _key(None, prompt=[1, 2]).startswith("t:")
    assert route_key({}, None, [SYSTEM], None).source == "none"
    assert _key([SYSTEM]) == ""


def test_key_ignores_system_prompt_and_tools_and_later_turns():
    first = _key(_conversation(7, 1))
    assert all(_key(_conversation(7, t)) == first for t in range(1, 6))
    other_system = [TOOLS_SYSTEM] + _conversation(7, 3)[1:]
    assert _key(other_system) == first
    assert _key(_conversation(8, 1)) != first
    parts = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Conversation 7: "},
                                                  {"type": "text",
                                                   "text": "tell me about topic 7."}]}]
    assert _key(parts) == first


# ---- affinity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_same_conversation_same_rank(num_ranks):
    router = Router(num_ranks)
    for i in range(50):
        ranks = {router.pick(_key(_conversation(i, t)), 100 * t) for t in range(1, 8)}
        assert len(ranks) == 1
    # ... and in another process / router instance too (blake2b, not hash()).
    again = Router(num_ranks)
    assert all(again.pick(_key(_conversation(i, 1))) == router.pick(_key(_conversation(i, 1)))
               for i in range(50))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_shared_system_prompt_conversations_spread(num_ranks):
    router = Router(num_ranks)
    counts = Counter(router.pick(_key(_conversation(i, 1)), 500) for i in range(100))
    mean = 100 / num_ranks
    assert set(counts) == set(range(num_ranks))
    assert all(0.8 * mean <= counts[r] <= 1.2 * mean for r in range(num_ranks)), counts
    # Many keys: the spread tightens as hashing promises.
    many = Counter(router.pick(_key([SYSTEM, {"role": "user", "content": f"q{i}"}]))
                   for i in range(10000))
    assert all(abs(many[r] - 10000 / num_ranks) <= 0.05 * 10000 / num_ranks
               for r in range(num_ranks)), many
    assert router.decisions["affinity"] == 100 + 10000


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_overload_falls_back_and_returns_to_affinity(num_ranks):
    router = Router(num_ranks, overload_factor=2.0, overload_min_tokens=100)
    key = _key(_conversation(3, 1))
    home = router.pick(key, 10)
    others = [r for r in range(num_ranks) if r != home]
    for r in others:
        router.started(r, 200)
    router.started(home, 500)  # 500 <= 2 * 200 + 100: still home
    assert router.pick(key, 10) == home
    router.started(home, 1)  # 501 > 500: overloaded
    fallback = router.pick(key, 10)
    assert fallback != home and fallback in others
    assert router.decisions["fallback_overloaded"] == 1
    router.finished(home, 1)  # load drops: back home
    assert router.pick(key, 10) == home
    assert router.decisions["affinity"] == 3
    # Other keys homed elsewhere are unaffected by the busy rank.
    assert all(router.pick(k) == Router(num_ranks).pick(k)
               for k in (f"k{i}" for i in range(50)) if Router(num_ranks).home(k) != home)


def test_overload_fallback_goes_to_least_loaded():
    router = Router(4, overload_factor=1.5, overload_min_tokens=0)
    key = _key(_conversation(11, 1))
    home = router.pick(key)
    others = [r for r in range(4) if r != home]
    router.started(home, 4000)
    router.started(others[0], 1000)
    router.started(others[1], 10)
    router.started(others[2], 500)
    assert router.pick(key, 100) == others[1]


# ---- least-loaded -----------------------------------------------------------------------------
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_least_loaded_balances_random_sizes(num_ranks):
    rng = random.Random(0)
    router = Router(num_ranks, policy="least-loaded")
    for step in range(500):  # arrivals only: loads never drift more than one request apart
        tokens = rng.randint(1, 4000)
        router.started(router.pick(f"same-key-{step % 3}", tokens), tokens)
        assert max(router.load) - min(router.load) <= 4000
    assert max(router.load) / min(router.load) < 1.05, router.load
    router = Router(num_ranks, policy="least-loaded")
    total = [0] * num_ranks
    in_flight = []
    for step in range(2000):
        tokens = rng.randint(1, 4000)
        rank = router.pick(f"same-key-{step % 3}", tokens)
        router.started(rank, tokens)
        total[rank] += tokens
        in_flight.append((rank, tokens))
        if len(in_flight) > 16:  # requests finish in a random order
            done = in_flight.pop(rng.randrange(len(in_flight)))
            router.finished(*done)
    assert max(total) / min(total) < 1.2, total
    assert router.decisions["least_loaded"] == 2000
    assert router.decisions["affinity"] == 0


def test_empty_key_uses_least_loaded():
    router = Router(2)
    router.started(0, 100)
    assert router.pick("", 10) == 1
    assert router.decisions["least_loaded"] == 1


# ---- dead ranks -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_dead_rank_keys_move_others_stay(num_ranks):
    router = Router(num_ranks)
    keys = [_key(_conversation(i, 1)) for i in range(400)]
    before = {k: router.pick(k) for k in keys}
    dead = 1
    router.mark_dead(dead)
    after = {k: router.pick(k) for k in keys}
    moved = [k for k in keys if before[k] == dead]
    assert moved
    assert all(after[k] != dead for k in keys)
    assert all(after[k] == before[k] for k in keys if before[k] != dead)
    assert router.decisions["rerouted_dead"] == len(moved)
    if num_ranks > 2:  # the dead rank's keys spread over the others, not onto one
        assert len({after[k] for k in moved}) > 1
    router.mark_alive(dead)
    assert {k: router.pick(k) for k in keys} == before


def test_no_live_rank_raises():
    router = Router(2)
    router.mark_dead(0)
    router.mark_dead(1)
    with pytest.raises(NoLiveRankError, match="no live engine rank"):
        router.pick("k", 1)
    single = Router(1, policy="least-loaded")
    single.mark_dead(0)
    with pytest.raises(NoLiveRankError):
        single.pick("", 1)


def test_bad_arguments():
    with pytest.raises(ValueError):
        Router(0)
    with pytest.raises(ValueError):
        Router(2, policy="random")
    with pytest.raises(ValueError):
        Router(2, overload_factor=0.5)


def test_reserve_counts_load_until_released():
    router = Router(2, "least-loaded")
    first = router.reserve("", 100)
    second = router.reserve("", 100)  # sees the first one's load before it starts
    assert {first.rank, second.rank} == {0, 1}
    assert router.load == [100, 100] and router.requests == [1, 1]
    first.release()
    first.release()  # idempotent: every path that ends a request may call it
    assert router.load[first.rank] == 0 and router.requests[first.rank] == 0
    assert router.decisions_by_rank == {("least_loaded", 0): 1, ("least_loaded", 1): 1}


def test_least_loaded_ties_take_turns():
    # Requests that each find every rank idle (one at a time, finishing before the next).
    router = Router(3, "least-loaded")
    order = []
    for _ in range(7):
        route = router.reserve("", 50)
        order.append(route.rank)
        route.release()
    assert order == [0, 1, 2, 0, 1, 2, 0]
    router.started(1, 10)  # a busy rank is skipped, the others still alternate
    assert [router.pick("", 1) for _ in range(4)] == [2, 0, 2, 0]
