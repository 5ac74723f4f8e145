"""Restart policy of RankSupervisor on fake rank processes: backoff, limit, and the streak that
a rank which served long enough starts over."""
from __future__ import annotations

import asyncio

from test_routing import _close_clients, _Inbox, _made, _Proc  # noqa: F401 - the fixture

from deepinfer.serve.ranks.health import RankHealthConfig, RankState
from deepinfer.serve.ranks.ipc import Ready
from deepinfer.serve.ranks.rank import _Rank
from deepinfer.serve.ranks.request_stream import RequestStream
from deepinfer.serve.ranks.supervisor import RankSupervisor


def _client(max_restarts: int) -> tuple[RankSupervisor, list[float]]:
    health = RankHealthConfig(max_restarts=max_restarts, restart_backoff_s=0.001,
                              stable_after_s=60.0)
    client = RankSupervisor(None, 1, health=health)
    RequestStream(client)  # the supervisor's requests: client.requests
    _made.append(client)
    client._ranks = [_Rank(_Proc(1000), _Inbox(client, 0, []), state=RankState.SERVING,
                           serving_since=0.0)]
    pids = iter(range(2000, 3000))
    client._spawn = lambda rank, placement_from=None: _Rank(_Proc(next(pids)),
                                                            _Inbox(client, rank, []))
    client._watch_exit = lambda rank: None
    return client, []


async def _die_and_settle(client: RankSupervisor) -> _Rank:
    rank = client._ranks[0]
    rank.process.alive = False
    client._rank_died(0)
    for _ in range(50):  # the restart task sleeps its (tiny) backoff, then spawns
        await asyncio.sleep(0.002)
    return client._ranks[0]


def _ready(client: RankSupervisor) -> None:
    client._on_ready(Ready(0, 64, 16, 512, "fake"))


def test_restarts_stop_after_the_limit_in_a_row():
    client, _ = _client(max_restarts=2)

    async def scenario():
        for expected in (1, 2):
            rank = await _die_and_settle(client)
            assert (rank.state, rank.restarts, rank.streak) == (RankState.STARTING, expected,
                                                                expected)
            _ready(client)
            assert rank.state is RankState.SERVING and client.router.alive[0]
        rank = await _die_and_settle(client)  # a third death in a row: given up on
        assert rank.state is RankState.FAILED and not client.router.alive[0]
        assert client.ranks()[0].state == "failed"

    asyncio.run(scenario())


def test_a_rank_that_served_long_enough_starts_a_new_streak():
    client, _ = _client(max_restarts=1)

    async def scenario():
        rank = await _die_and_settle(client)
        _ready(client)
        rank.serving_since -= 61.0  # as if it had served for a minute since
        rank = await _die_and_settle(client)
        assert (rank.state, rank.restarts, rank.streak) == (RankState.STARTING, 2, 1)

    asyncio.run(scenario())
