"""EngineClient routes through deepinfer.core.router (fake ranks, no processes)."""
from __future__ import annotations

import asyncio
import os

import pytest

from deepinfer.core.router import NoLiveRankError, affinity_key
from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.cli import build_parser
from deepinfer.serve.engine_client import EngineClient, _Rank
from deepinfer.serve.ipc import AbortRequest, AddRequest, TokenDelta


class _Proc:
    def __init__(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive


class _Inbox:
    def __init__(self, client: EngineClient, rank: int, sent: list) -> None:
        self.client, self.rank, self.sent = client, rank, sent

    async def send_pyobj(self, msg) -> None:
        self.sent.append((self.rank, msg))
        if isinstance(msg, AddRequest):  # answer at once with one finishing token
            self.client._queues[msg.request_id].put_nowait(TokenDelta(
                msg.request_id, 0, [1], "x", True, "length", None, [], 0, 0))


_made: list[EngineClient] = []


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
    client = EngineClient(None, num_ranks, routing=routing)
    _made.append(client)
    sent: list = []
    client._ranks = [_Rank(_Proc(), _Inbox(client, r, sent)) for r in range(num_ranks)]
    return client, sent


async def _run(client, rid, key, n_tokens=10):
    out = []
    async for delta in client.generate(rid, list(range(n_tokens)), SamplingParams(max_tokens=1),
                                       route_key=key):
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
