"""Expert parallel through the real server, on a tiny random Qwen3-MoE checkpoint (8 experts,
top-2, one MoE layer) with the SmolLM2 tokenizer, driven with token-id prompts:

* `--dp 2` (expert parallel by default for an MoE checkpoint) answers as `--dp 1`, its ranks
  step in lockstep, and /metrics counts top-k expert routes for every token;
* `--eplb-interval 1 --eplb-redundant-experts 2` rebalances and still answers as `--dp 1`;
* `--dp 2 --accelerator neuron` (the Neuron backend's static graphs on the host,
  DEEPINFER_NEURON_DEVICE=cpu: static MoE with its packed route exchange) answers as `--dp 1`;
* two "hosts" on this machine (`--nnodes 2`, one rank each, gloo over loopback) answer as
  `--dp 1`, each its own requests, and both come back on their `--master-port` after one
  host's rank is killed;
* a rank killed mid-generation fails its group's requests: every in-flight request ends with a
  503 and /health says 503; only the killed rank restarts, the survivor (same process, its
  KV pool freed) joins a new group with it, and they answer as before;
* the EPLB server, its experts moved, loses a rank too: the replacement loads the placement
  the survivor uses, and the answers stay equal to `--dp 1`'s.

RankSupervisor's group bookkeeping (the regroup, its fallback to restarting the whole group, the
port, the restart limit) is also checked on fake rank processes, and torchrun's environment on
a fake environ.

A checkpoint with no tokenizer would get an empty one (transformers makes a 1-token tokenizer)
and the answers' text would say nothing; hence the SmolLM2 tokenizer and its vocabulary.

Every server the collected tests need is launched at once (their start-ups overlap on the few
cores) and stopped, checked for leaks and tracebacks, at the end of the module. The rank-death
tests run after the others of their server.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import (
    ServerProcess,
    free_port,
    openai_client,
    per_rank,
    scrape,
    scrape_series,
    wait_until,
)
from test_routing import _close_clients, _Inbox, _made, _Proc  # noqa: F401 - the fixture

from deepinfer.core.config import EngineConfig, ModelSpec, ParallelConfig, torchrun_parallel
from deepinfer.serve.ranks.health import RankHealthConfig, RankState
from deepinfer.serve.ranks.ipc import Ready, Regroup
from deepinfer.serve.ranks.rank import RankDiedError, _Rank
from deepinfer.serve.ranks.request_stream import RequestStream
from deepinfer.serve.ranks.router import Router, route_key
from deepinfer.serve.ranks.supervisor import RankSupervisor

MODEL = "tiny-moe"
TOP_K, MOE_LAYERS = 2, 1  # tests/checkpoints.py's qwen3_moe: layer 0 dense, layer 1 MoE
MAX_TOKENS = 10
# Distinct first tokens (no shared prefix-cache pages), lengths across block boundaries.
PROMPTS = [[100 + 7 * i + 13 * j for j in range(n)] for i, n in
           enumerate((5, 9, 16, 17, 23, 40))]
FAIL_WITHIN_S = 10.0  # a dead rank's group must have failed every request this soon
# A restarted rank's start (imports, the model, warm-up) takes seconds alone, but over a minute
# on two cores while the module's other servers and the other pytest worker start beside it.
BACK_WITHIN_S = 240.0
COMMON_ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--block-size", "16",
               "--num-kv-blocks", "128", "--max-num-seqs", "8"]
# fixture -> the servers it needs; each server's flags beyond COMMON_ARGS
FIXTURE_SERVERS = {"dp1": ("dp1",), "dp2": ("dp2",), "eplb": ("eplb",),
                   "two_hosts": ("host0", "host1"), "neuron_dp2": ("neuron_dp2",)}
# Servers with environment variables of their own.
SERVER_ENV = {"neuron_dp2": {"DEEPINFER_NEURON_DEVICE": "cpu"}}


def _server_args(master_port: int) -> dict[str, list[str]]:
    hosts = {f"host{n}": ["--dp", "1", "--nnodes", "2", "--node-rank", str(n),
                          "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
             for n in (0, 1)}
    return {"dp1": ["--dp", "1"], "dp2": ["--dp", "2"],
            "neuron_dp2": ["--dp", "2", "--accelerator", "neuron", "--max-model-len", "256"],
            "eplb": ["--dp", "2", "--eplb-interval", "1", "--eplb-redundant-experts", "2"],
            **hosts}


def make_moe_checkpoint(path: str) -> str:
    from checkpoints import make_moe_chat_checkpoint

    return make_moe_chat_checkpoint(path)


# ---- servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    here = [item for item in request.session.items
            if getattr(item, "module", None) is request.module]
    wanted = {s for item in here for f in item.fixturenames for s in FIXTURE_SERVERS.get(f, ())}
    ckpt = make_moe_checkpoint(str(tmp_path_factory.mktemp("tiny-moe")))
    logs = tmp_path_factory.mktemp("ep-logs")
    started: dict[str, ServerProcess] = {}
    try:
        for name, args in _server_args(free_port()).items():
            if name in wanted:
                started[name] = ServerProcess(name, ["--model", ckpt, *COMMON_ARGS, *args],
                                              str(logs / f"{name}.log"), MODEL,
                                              env=SERVER_ENV.get(name, {}))
                started[name].start()
        yield started
    finally:
        for server in started.values():  # all at once: the two hosts leave their group together
            server.terminate()
        problems = [p for server in started.values() for p in server.finish_stop()]
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


def _ready(servers: dict[str, ServerProcess], name: str) -> ServerProcess:
    servers[name].wait_ready()
    return servers[name]


@pytest.fixture(scope="module")
def dp1(servers) -> ServerProcess:
    return _ready(servers, "dp1")


@pytest.fixture(scope="module")
def dp2(servers) -> ServerProcess:
    return _ready(servers, "dp2")


@pytest.fixture(scope="module")
def neuron_dp2(servers) -> ServerProcess:
    return _ready(servers, "neuron_dp2")


@pytest.fixture(scope="module")
def eplb(servers) -> ServerProcess:
    return _ready(servers, "eplb")


@pytest.fixture(scope="module")
def two_hosts(servers) -> tuple[ServerProcess, ServerProcess]:
    return _ready(servers, "host0"), _ready(servers, "host1")


@pytest.fixture(scope="module")
def reference(dp1) -> list[str]:
    """The one-rank server's greedy answers to PROMPTS."""
    return [text for text, _, _ in _complete_all(dp1, PROMPTS)]


# ---- requests --------------------------------------------------------------------------------
def _key_for(rank: int, start: int = 0) -> str:
    """A `user` that affinity routing sends to `rank` of two."""
    router = Router(2)
    return next(k for k in (f"user-{i}" for i in range(start, start + 200))
                if router.home(route_key(None, user=k).value) == rank)


KEYS = [_key_for(i % 2, 10 * i) for i in range(len(PROMPTS))]  # alternate ranks 0, 1, 0, ...


RAN: Counter = Counter()  # per server: tokens its MoE layers ran for _complete's requests
_ran_lock = threading.Lock()


def _complete(server: ServerProcess, prompt: list[int], user: str | None = None,
              max_tokens: int = MAX_TOKENS) -> tuple[str, int, int]:
    """(greedy text, serving rank, tokens the MoE layers ran: prompt not cached + generated
    but the last)."""
    raw = openai_client(server).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, user=user)
    reply, usage = raw.parse(), raw.parse().usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    ran = usage.prompt_tokens - (cached or 0) + usage.completion_tokens - 1
    with _ran_lock:
        RAN[server.name] += ran
    return reply.choices[0].text, int(raw.headers["x-deepinfer-rank"]), ran


def _complete_all(server: ServerProcess, prompts: list[list[int]],
                  users: list[str | None] | None = None) -> list[tuple[str, int, int]]:
    """All prompts at once (they share engine steps)."""
    users = users or [None] * len(prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda a: _complete(server, *a), zip(prompts, users)))


def _expert_tokens(server: ServerProcess) -> float:
    return sum(scrape_series(server.url, "deepinfer:moe_expert_tokens_total").values())





# ---- tests -----------------------------------------------------------------------------------
def test_torchrun_environment_gives_the_multi_host_settings():
    env = {"WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    derived = torchrun_parallel({"dp": 1}, env)
    # torchrun's own store holds MASTER_PORT: the rank group meets one port above.
    assert derived == {"dp": 1, "nnodes": 2, "node_rank": 1, "master_addr": "10.1.2.3",
                       "master_port": 29501}
    parallel = ParallelConfig(**derived)
    assert (parallel.world_size, parallel.first_rank) == (2, 1)
    explicit = {"nnodes": 4, "node_rank": 3, "master_addr": "node0", "master_port": 1234}
    assert torchrun_parallel(explicit, env) == explicit  # the flags win
    assert torchrun_parallel({"dp": 2}, {"MASTER_PORT": "1"}) == {"dp": 2}  # not torchrun
    two_per_host = torchrun_parallel({}, {**env, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert two_per_host["nnodes"] == 2


# ---- RankSupervisor's expert-parallel group, on fake rank processes ----------------------------
class _KillableProc(_Proc):
    killed = False

    def kill(self) -> None:
        self.killed = True


def _group_client(master_port: int, max_restarts: int = 5
                  ) -> tuple[RankSupervisor, list[int], list]:
    """A two-rank expert-parallel client of fake ranks; also the rendezvous port each spawn
    got, and what was sent to the ranks ((rank, message))."""
    nnodes = 1 if master_port == 0 else 2  # a given port: as on several hosts
    parallel = ParallelConfig(ep=True, nnodes=nnodes, master_port=master_port)
    client = RankSupervisor(EngineConfig(ModelSpec("unused"), parallel=parallel), 2,
                          health=RankHealthConfig(max_restarts=max_restarts,
                                                  restart_backoff_s=0.001))
    RequestStream(client)  # the supervisor's requests: client.requests
    _made.append(client)
    client._rendezvous()
    pids, ports, sent = itertools.count(1000), [], []

    def spawn(rank: int, placement_from: int | None = None) -> _Rank:
        ports.append(client.config.parallel.master_port)
        return _Rank(_KillableProc(next(pids)), _Inbox(client, rank, sent))

    client._spawn, client._watch_exit = spawn, lambda rank: None
    client._ranks = [spawn(rank) for rank in range(2)]
    for rank, r in enumerate(client._ranks):
        r.state, r.serving_since, r.ready = RankState.SERVING, 0.0, _ready_message(rank)
    return client, ports, sent


def _ready_message(rank: int, rebind_group: bool = True) -> Ready:
    return Ready(rank, 64, 16, 512, "fake", rebind_group=rebind_group)


async def _lose(client: RankSupervisor, rank: int) -> None:
    """`rank` exits; the peers the client kills exit too (their sentinels); the restart (if
    any) runs its tiny backoff."""
    client._ranks[rank].process.alive = False
    client._rank_died(rank)
    await _settle(client)


async def _settle(client: RankSupervisor) -> None:
    """Killed ranks exit (their sentinels) and restarts run their tiny backoff."""
    for _ in range(50):
        for peer, r in enumerate(client._ranks):
            if r.process.killed and r.process.alive:
                r.process.alive = False
                client._rank_died(peer)
        await asyncio.sleep(0.002)


def _with_requests(client: RankSupervisor) -> dict[int, asyncio.Queue]:
    queues = {rank: asyncio.Queue() for rank in (0, 1)}
    for rank, queue in queues.items():
        client.requests._queues[f"r{rank}"], client.requests._owner[f"r{rank}"] = queue, rank
    return queues


def test_a_dead_rank_of_a_one_host_group_is_replaced_alone():
    client, ports, sent = _group_client(0)
    assert client._group and client._regroups and ports[0] == ports[1] != 0

    async def scenario():
        queues = _with_requests(client)
        survivor = client._ranks[0]
        client._ranks[1].process.alive = False
        client._rank_died(1)
        # Every request of the group fails at once, and nothing is routed to it; the
        # survivor is not killed: it leaves its step and waits in a new group.
        for queue in queues.values():
            assert isinstance(queue.get_nowait(), RankDiedError)
        assert not survivor.process.killed and client.router.live_ranks() == []
        assert survivor.state is RankState.STARTING and survivor.lost_requests == 1
        await _settle(client)
        regroup = [m for rank, m in sent if isinstance(m, Regroup)]
        assert [rank for rank, m in sent if isinstance(m, Regroup)] == [0]
        # A fresh port for the new group, which the replacement is started on.
        assert regroup[0].master_port == ports[2] != ports[0]
        assert regroup[0].placement_from == 0 and len(ports) == 3
        assert client._ranks[0] is survivor and survivor.restarts == 0
        assert client._ranks[1].restarts == 1
        client._on_ready(_ready_message(1))
        assert client.router.live_ranks() == []  # until every member is in the new group
        client._on_ready(_ready_message(0))
        assert client.router.live_ranks() == [0, 1]
        assert all(r.state is RankState.SERVING for r in client._ranks)

    asyncio.run(scenario())


def test_a_death_during_a_regroup_restarts_the_whole_group():
    client, ports, _ = _group_client(0)

    async def scenario():
        await _lose(client, 1)
        survivor, replacement = client._ranks
        replacement.process.alive = False  # the replacement dies while it starts
        client._rank_died(1)
        assert survivor.process.killed and "group lost rank 1" in survivor.kill_reason
        await _settle(client)
        assert [r.restarts for r in client._ranks] == [1, 2]
        assert all(r.state is RankState.STARTING for r in client._ranks)
        assert client._regrouping is None and ports[3] == ports[4] != ports[2]
        for rank in (0, 1):
            client._on_ready(_ready_message(rank))
        assert client.router.live_ranks() == [0, 1]

    asyncio.run(scenario())


def test_a_regroup_not_done_in_time_restarts_the_whole_group():
    client, _, _ = _group_client(0)
    client.regroup_timeout_s = -4.9  # the deadline adds 5 s: 0.1 s

    async def scenario():
        await _lose(client, 1)
        client._on_ready(_ready_message(1))  # the survivor never reports
        await asyncio.sleep(0.2)
        await _settle(client)
        assert [r.restarts for r in client._ranks] == [1, 2]

    asyncio.run(scenario())


def test_a_backend_that_cannot_rebind_its_group_restarts_the_whole_group():
    client, _, sent = _group_client(0)
    client._ranks[0].ready = _ready_message(0, rebind_group=False)

    async def scenario():
        survivor = client._ranks[0]
        await _lose(client, 1)
        assert survivor.process.killed and not any(isinstance(m, Regroup) for _, m in sent)
        assert [r.restarts for r in client._ranks] == [1, 1]

    asyncio.run(scenario())


def test_a_dead_rank_across_hosts_takes_its_group_down_and_it_restarts_as_one():
    client, ports, _ = _group_client(29611)  # a given port and two hosts: no regroup
    assert client._group and not client._regroups and ports[0] == ports[1] != 0

    async def scenario():
        queues = _with_requests(client)
        old = list(client._ranks)
        old[1].process.alive = False
        client._rank_died(1)
        # The survivor is killed at once and nothing is routed to the group any more.
        assert old[0].process.killed and client.router.live_ranks() == []
        assert "expert-parallel group lost rank 1" in old[0].kill_reason
        assert isinstance(queues[1].get_nowait(), RankDiedError)
        assert client._ranks == old  # no lone restart
        await _lose(client, 0)  # (already dead: only its sentinel's bookkeeping runs)
        error = queues[0].get_nowait()
        assert isinstance(error, RankDiedError) and "group lost rank 1" in str(error)
        assert all(r.state is RankState.STARTING and r.restarts == 1 for r in client._ranks)
        assert ports[2] == ports[3] == ports[0]  # the given port is kept
        for rank in (0, 1):
            client._on_ready(_ready_message(rank))
        assert client.router.live_ranks() == [0, 1]

    asyncio.run(scenario())


def test_another_api_process_fails_its_requests_on_a_survivor_that_regroups():
    """--api-server-count: process 0's event that a serving rank starts again (same process:
    a regroup) fails the other process's requests on it."""
    from deepinfer.serve.api_workers import AttachedRankSupervisor
    from deepinfer.serve.ranks.ipc import RankEvent

    client = AttachedRankSupervisor(EngineConfig(ModelSpec("unused")), 2, client_id=1)
    RequestStream(client)  # the supervisor's requests: client.requests
    _made.append(client)
    client._own_lost = [0, 0]
    client._ranks = [_Rank(_Proc(1000 + rank), _Inbox(client, rank, []),
                           state=RankState.SERVING) for rank in (0, 1)]
    queue = asyncio.Queue()
    client.requests._queues["r0"], client.requests._owner["r0"] = queue, 0
    client._apply(RankEvent(0, "starting", 0, 1000, reason="left its step: its "
                            "expert-parallel group lost rank 1, which was killed by SIGKILL"))
    error = queue.get_nowait()
    assert isinstance(error, RankDiedError) and "group lost rank 1" in str(error)
    assert client.router.live_ranks() == [1] and client._ranks[0].lost_requests == 1


@pytest.mark.parametrize("given_port", [0, 29611], ids=["regroup", "across-hosts"])
def test_group_restarts_stop_at_the_limit(given_port):
    client, ports, _ = _group_client(given_port, max_restarts=1)

    async def scenario():
        await _lose(client, 1)
        restarted = [r.restarts for r in client._ranks]
        assert restarted == ([0, 1] if given_port == 0 else [1, 1])
        for rank in (0, 1):
            client._on_ready(_ready_message(rank))
        await _lose(client, 1)  # rank 1's second death in a row: the limit
        assert all(r.state is RankState.FAILED for r in client._ranks)  # given up on
        assert client.router.live_ranks() == [] and client._regrouping is None
        assert [r.restarts for r in client._ranks] == restarted

    asyncio.run(scenario())


def test_dp2_expert_parallel_answers_equal_dp1(dp2, reference):
    answers = _complete_all(dp2, PROMPTS, KEYS)
    assert {rank for _, rank, _ in answers} == {0, 1}
    assert [text for text, _, _ in answers] == reference
    assert all(text for text in reference)


def test_neuron_backend_dp2_expert_parallel_answers_equal_dp1(neuron_dp2, reference):
    """The Neuron backend, its graphs on the host: two EP ranks in static shapes (buckets,
    fixed pool, the packed route all-gather) answer as the CPU backend's one rank."""
    answers = _complete_all(neuron_dp2, PROMPTS, KEYS)
    assert {rank for _, rank, _ in answers} == {0, 1}
    assert [text for text, _, _ in answers] == reference


def test_dp2_steps_in_lockstep_and_counts_expert_routes(dp2):
    health = httpx.get(f"{dp2.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["live"] == [0, 1]
    before_steps = per_rank(dp2.url, "deepinfer:rank_dummy_steps_total")
    assert _complete(dp2, PROMPTS[2], _key_for(0), max_tokens=16)[1] == 0
    # Rank 1 had no request: it ran a dummy step for each of rank 0's (reported once it
    # handles a message of its own).
    assert _complete(dp2, PROMPTS[0], _key_for(1), max_tokens=1)[1] == 1
    after_steps = per_rank(dp2.url, "deepinfer:rank_dummy_steps_total")
    assert after_steps[1] - before_steps.get(1, 0) >= 16
    # Every token a MoE layer ran (on either rank, for any request since the start) went to
    # top_k experts, padding and dummy steps to none; ranks report every second.
    expected = RAN[dp2.name] * TOP_K * MOE_LAYERS
    wait_until(lambda: _expert_tokens(dp2) >= expected, 10, f"{expected} expert routes")
    time.sleep(1.5)  # and no more come
    assert _expert_tokens(dp2) == expected
    per_expert = scrape_series(dp2.url, "deepinfer:moe_expert_tokens_total")
    assert len(per_expert) == 8 * MOE_LAYERS
    assert sum(v > 0 for v in per_expert.values()) >= 2  # spread over experts of both ranks


def test_eplb_rebalances_and_answers_still_equal_dp1(eplb, reference):
    first = _complete_all(eplb, PROMPTS, KEYS)
    assert [text for text, _, _ in first] == reference
    # The 1 s timer rebalances on the tokens routed since the last one.
    wait_until(lambda: scrape(eplb.url).get("deepinfer:eplb_rebalances_total", 0) >= 1, 15,
           "an EPLB rebalance")
    gauges = scrape(eplb.url)
    imbalance = scrape_series(eplb.url, "deepinfer:eplb_imbalance")
    assert {dict(labels)["when"] for labels in imbalance} == {"before", "after"}
    assert all(v >= 1.0 for v in imbalance.values())  # max over mean tokens per rank
    assert "deepinfer:eplb_last_stall_seconds" in gauges
    again = _complete_all(eplb, PROMPTS, KEYS[::-1])  # each prompt on the other rank now
    assert [text for text, _, _ in again] == reference


def test_two_hosts_each_serve_their_own_requests(two_hosts, reference):
    host0, host1 = two_hosts
    for host in two_hosts:
        health = httpx.get(f"{host.url}/health", timeout=10).json()
        assert health["status"] == "ok" and len(health["ranks"]) == 1
    half = len(PROMPTS) // 2
    with ThreadPoolExecutor(2) as pool:  # both hosts busy at once
        on0 = pool.submit(_complete_all, host0, PROMPTS[:half])
        on1 = pool.submit(_complete_all, host1, PROMPTS[half:])
        answers = on0.result() + on1.result()
    assert [text for text, _, _ in answers] == reference
    # Lockstep across hosts: host 0's rank dummy-steps while host 1 alone generates.
    before = scrape(host0.url).get("deepinfer:rank_dummy_steps_total", 0)
    _complete(host1, PROMPTS[1], max_tokens=12)
    _complete(host0, PROMPTS[0], max_tokens=1)  # host 0's rank reports its counters
    assert scrape(host0.url)["deepinfer:rank_dummy_steps_total"] - before >= 12


def _serving(server: ServerProcess, restarts: int) -> dict | None:
    health = httpx.get(f"{server.url}/health", timeout=10)
    body = health.json()
    ok = health.status_code == 200 and body["status"] == "ok" and \
        all(r["restarts"] == restarts for r in body["ranks"])
    return body if ok else None


def test_a_rank_lost_on_one_host_restarts_both_hosts_on_the_given_port(two_hosts, reference):
    host0, host1 = two_hosts  # its rank's next vote fails: gloo says the peer closed
    lost = httpx.get(f"{host1.url}/health", timeout=10).json()["ranks"][0]["pid"]
    killed = time.monotonic()
    os.kill(lost, signal.SIGKILL)
    for host in two_hosts:  # both down: host 0's rank fails in the group's next collective
        wait_until(lambda: httpx.get(f"{host.url}/health", timeout=10).status_code == 503, 10,
               f"{host.name} to report its group down")
    # Both restart their rank, and the new ranks meet on the same --master-port.
    for host in two_hosts:
        wait_until(lambda: _serving(host, restarts=1), BACK_WITHIN_S, f"{host.name} back")
    recovered = time.monotonic() - killed
    answers = _complete_all(host0, PROMPTS[:2]) + _complete_all(host1, PROMPTS[2:])
    assert [text for text, _, _ in answers] == reference
    print(f"\ntwo hosts: both serving again {recovered:.1f} s after a rank was killed")


def _stream(server: ServerProcess, prompt: list[int], user: str, out: dict) -> None:
    """A long greedy stream; `out` gets its data events, how it ended, and when."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True, "user": user}
    out["events"] = []
    try:
        with httpx.stream("POST", f"{server.base_url}/completions", json=body,
                          timeout=120) as reply:
            out["rank"] = int(reply.headers["x-deepinfer-rank"])
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    out["events"].append(json.loads(line[6:]))
    except httpx.HTTPError as exc:
        out["exception"] = exc
    out["ended"] = time.monotonic()


def test_killed_rank_fails_its_groups_requests_and_is_replaced_alone(dp2, reference):
    outs = [{} for _ in range(4)]
    readers = [threading.Thread(target=_stream, args=(dp2, PROMPTS[i], KEYS[i], outs[i]))
               for i in range(4)]
    for reader in readers:
        reader.start()
    wait_until(lambda: all(len(o.get("events", ())) >= 3 for o in outs), 60, "every stream to flow")
    assert {o["rank"] for o in outs} == {0, 1}
    before = httpx.get(f"{dp2.url}/health", timeout=10).json()["ranks"]
    killed = time.monotonic()
    os.kill(before[1]["pid"], signal.SIGKILL)
    # Down at once (the replacement waits a 1 s backoff, then starts).
    down = wait_until(lambda: (h := httpx.get(f"{dp2.url}/health", timeout=10)).status_code == 503
                      and h.json(), 3, "/health to say 503")
    assert down["status"] == "unavailable" and down["live"] == []
    for reader in readers:
        reader.join(max(0.0, killed + FAIL_WITHIN_S - time.monotonic()))
    assert not any(r.is_alive() for r in readers), "a stream still hangs after the kill"
    for out in outs:
        assert out["ended"] - killed < FAIL_WITHIN_S and "exception" not in out
        error = out["events"][-1]["error"]
        assert error["code"] == 503, error
        if out["rank"] == 0:  # the survivor left its step with its group
            assert "expert-parallel group lost rank 1" in error["message"], error
    back = wait_until(lambda: (h := httpx.get(f"{dp2.url}/health", timeout=10)).status_code == 200
                      and h.json()["status"] == "ok" and h.json(), BACK_WITHIN_S,
                      "the group to serve again")
    recovered = time.monotonic() - killed
    # Only the killed rank was restarted; the survivor is the same process.
    assert [r["restarts"] - b["restarts"] for r, b in zip(back["ranks"], before)] == [0, 1]
    assert [r["pid"] == b["pid"] for r, b in zip(back["ranks"], before)] == [True, False]
    # The survivor dropped the streams it ran: nothing runs there, no KV block is held.
    assert per_rank(dp2.url, "deepinfer:rank_num_requests_running")[0] == 0
    assert per_rank(dp2.url, "deepinfer:rank_kv_cache_usage_perc")[0] == 0
    answers = _complete_all(dp2, PROMPTS, KEYS)
    assert [text for text, _, _ in answers] == reference
    assert {rank for _, rank, _ in answers} == {0, 1}
    dp2.wait_idle()
    print(f"\nkilled rank: every stream failed within "
          f"{max(o['ended'] for o in outs) - killed:.2f} s, group serving again after "
          f"{recovered:.1f} s")


def test_eplb_group_replaces_a_killed_rank_with_the_moved_placement(eplb, reference):
    """Rank 0 goes: its replacement takes rank 1's placement (EPLB moved experts since the
    start), and hosts the new group's store."""
    _complete_all(eplb, PROMPTS, KEYS)  # tokens for the 1 s timer's rebalance
    wait_until(lambda: scrape(eplb.url).get("deepinfer:eplb_rebalances_total", 0) >= 1, 15,
               "an EPLB rebalance")
    before = httpx.get(f"{eplb.url}/health", timeout=10).json()["ranks"]
    killed = time.monotonic()
    os.kill(before[0]["pid"], signal.SIGKILL)
    back = wait_until(lambda: (h := httpx.get(f"{eplb.url}/health", timeout=10)).status_code
                      == 200 and (b := h.json())["ranks"][0]["pid"] != before[0]["pid"] and b,
                      BACK_WITHIN_S, "the group to serve again with a new rank 0")
    recovered = time.monotonic() - killed
    assert back["status"] == "ok" and back["ranks"][1]["pid"] == before[1]["pid"]
    assert [r["restarts"] - b["restarts"] for r, b in zip(back["ranks"], before)] == [1, 0]
    answers = _complete_all(eplb, PROMPTS, KEYS)
    assert [text for text, _, _ in answers] == reference
    print(f"\nEPLB group: serving again {recovered:.1f} s after rank 0 was killed")
