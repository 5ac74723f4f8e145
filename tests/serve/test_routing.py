"""RankSupervisor routes through deepinfer.serve.ranks.router (fake ranks, no processes)."""
from __future__ import annotations

import asyncio
import os

import pytest

from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.flags import build_parser
from deepinfer.serve.ranks.health import RankHealthConfig, RankState
from deepinfer.serve.ranks.ipc import AbortRequest, AddRequest, TokenDelta
from deepinfer.serve.ranks.rank import RankDiedError, _Rank
from deepinfer.serve.ranks.request_stream import RequestStream
from deepinfer.serve.ranks.router import NoLiveRankError, affinity_key
from deepinfer.serve.ranks.supervisor import RankSupervisor


class _Proc:
    def __init__(self, pid: int) -> None:
        self.alive, self.pid, self.exitcode = True, pid, None

    def is_alive(self) -> bool:
        return self.alive


class _Inbox:
    def __init__(self, client: RankSupervisor, rank: int, sent: list) -> None:
        self.client, self.rank, self.sent = client, rank, sent
        self.answer = True

    def close(self, linger: int | None = None) -> None:
        pass

    async def send_pyobj(self, msg, flags: int = 0) -> None:
        self.sent.append((self.rank, msg))
        if isinstance(msg, AddRequest) and self.answer:  # one finishing token at once
            self.client.requests._queues[msg.request_id].put_nowait(TokenDelta(
                msg.request_id, 0, [1], "x", True, "length", None, [], 0, 0))


_made: list[RankSupervisor] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _made:  # an undestroyed zmq context would keep the interpreter from exiting
        client = _made.pop()
        client._ctx.destroy(linger=0)
        for name in os.listdir(client._dir):
            os.unlink(os.path.join(client._dir, name))
        os.rmdir(client._dir)


def _client(num_ranks: int, routing: str = "affinity"):
    # No restarts: these fake ranks have no process to start again.
    client = RankSupervisor(None, num_ranks, routing=routing,
                          health=RankHealthConfig(max_restarts=0))
    RequestStream(client)  # the supervisor's requests: client.requests
    _made.append(client)
    sent: list = []
    client._ranks = [_Rank(_Proc(1000 + r), _Inbox(client, r, sent), state=RankState.SERVING)
                     for r in range(num_ranks)]
    return client, sent


async def _run(client, rid, key, n_tokens=10):
    out = []
    async for delta in client.requests.generate(rid, list(range(n_tokens)),
                                                SamplingParams(max_tokens=1), route_key=key):
        out.append(delta)
    return out


def test_cli_routing_flag():
    assert build_parser().parse_args([]).routing == "affinity"
    assert build_parser().parse_args(["--routing", "least-loaded"]).routing == "least-loaded"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--routing", "random"])


def test_generate_routes_by_key_and_tracks_load():
    client, sent = _client(4)
    key = affinity_key({}, None, [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "hello"}])
    home = client.router.home(key)
    for i in range(5):
        asyncio.run(_run(client, f"r{i}", key))
    assert [rank for rank, m in sent if isinstance(m, AddRequest)] == [home] * 5
    assert not any(isinstance(m, AbortRequest) for _, m in sent)
    assert client.router.load == [0] * 4 and client.router.requests == [0] * 4
    assert client.router.decisions["affinity"] == 5


def test_dead_process_is_routed_around_then_503():
    client, sent = _client(2)
    key = "h:session-1"
    home = client.router.home(key)
    client._ranks[home].process.alive = False
    asyncio.run(_run(client, "a", key))
    assert sent[-1][0] == 1 - home
    assert client.router.decisions["rerouted_dead"] == 1
    client._ranks[1 - home].process.alive = False
    with pytest.raises(NoLiveRankError):
        asyncio.run(_run(client, "b", key))
    assert client.router.load == [0, 0]


def test_rank_death_fails_its_in_flight_requests_at_once():
    client, sent = _client(2, routing="least-loaded")
    for r in client._ranks:
        r.inbox.answer = False  # requests stay in flight until we act

    async def scenario():
        streams = [client.requests.generate(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=5))
                   for i in range(4)]
        tasks = [asyncio.create_task(_drain(s)) for s in streams]
        await asyncio.sleep(0)  # let every request reach its rank
        assert client.router.requests == [2, 2]
        client._ranks[1].process.alive, client._ranks[1].process.exitcode = False, -9
        client._rank_died(1)
        owners = [rank for rank, m in sent if isinstance(m, AddRequest)]
        on_dead = [t for t, rank in zip(tasks, owners) if rank == 1]
        _, pending = await asyncio.wait(on_dead, timeout=5)
        assert not pending, "requests of the dead rank must end at once"
        for task in tasks:  # the live rank's requests are still running: leave them
            if task not in on_dead:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [None if t.cancelled() else t.exception() for t in tasks]

    errors = asyncio.run(scenario())
    owners = [rank for rank, m in sent if isinstance(m, AddRequest)]
    assert [isinstance(e, RankDiedError) for e in errors] == [rank == 1 for rank in owners]
    assert owners.count(1) == 2
    # Nothing is sent to the dead rank; the live rank's requests are aborted when cancelled.
    assert not [m for rank, m in sent if rank == 1 and isinstance(m, AbortRequest)]
    assert len([m for rank, m in sent if rank == 0 and isinstance(m, AbortRequest)]) == 2
    assert client.router.load == [0, 0] and client.router.requests == [0, 0]
    view = client.ranks()[1]
    assert (view.alive, view.pid, view.exitcode, view.lost_requests) == (False, 1001, -9, 2)
    route = client.requests.route("any", 1)
    assert route.rank == 0
    route.release()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_control_skips_dead_ranks():
    client, sent = _client(3)
    client._rank_died(2)
    client._ranks[2].process.alive = False

    async def scenario():
        task = asyncio.create_task(client.control("stats"))
        await asyncio.sleep(0)
        for call_id, (rank, fut) in list(client._calls.items()):
            fut.set_result(rank * 10)
        return await task

    assert asyncio.run(scenario()) == [0, 10]
    assert {rank for rank, _ in sent} == {0, 1}
