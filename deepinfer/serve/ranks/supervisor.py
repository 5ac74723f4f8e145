"""The API process's side of the rank processes' lives: start them, watch them, restart them.

One receiver task reads every rank's messages; a step's results go on to the request stream
(serve/ranks/request_stream.py), so no request ever waits on model work in the event loop.
Each rank's process sentinel is watched by the event loop: when a rank exits, its in-flight
requests fail at once (RankDiedError), the router stops sending it work, and it is restarted
after a backoff. A watchdog reads the ranks' heartbeats (serve/ranks/health.py): a silent rank
is routed around, and killed (then restarted) if it stays silent.

Ranks in one expert-parallel group (lockstep, collectives in every MoE layer) fail together:
a rank that dies fails every in-flight request of the group and /health says 503. Only the dead
rank is restarted: the survivors keep their model and KV pool and join a new torch.distributed
group with the replacement (serve/ranks/group_recovery.py); where that cannot be done, the whole
group is taken down and restarts as one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
from typing import Mapping, Protocol

import zmq
import zmq.asyncio

from deepinfer.core.config import EngineConfig
from deepinfer.models.registry import has_experts
from deepinfer.serve.ranks.entry import run_rank
from deepinfer.serve.ranks.group_recovery import GroupRecovery, Regrouping
from deepinfer.serve.ranks.health import RankHealthConfig, RankState, Verdict, judge
from deepinfer.serve.ranks.ipc import (
    Control,
    ControlReply,
    EngineStats,
    ExpertStats,
    Failed,
    Heartbeat,
    RankEvent,
    Ready,
    StepResult,
)
from deepinfer.serve.ranks.node_pool import make_node_pool, place, remove_node_pool
from deepinfer.serve.ranks.rank import RankDiedError, RankStartError, RankView, _Rank, describe_exit
from deepinfer.serve.ranks.router import Router
from deepinfer.serve.ranks.spec import RankSpec, regroups
from deepinfer.serve.ranks.stream_pacing import DEFAULT_STREAM_INTERVAL
from deepinfer.serve.settings import process_env

START_TIMEOUT_S = 600.0  # a first start may convert a checkpoint
MAX_DRAIN = 256  # messages read in one go before the streams run (RankSupervisor._drain)
log = logging.getLogger("deepinfer.serve")


class RequestSink(Protocol):
    """The request stream as the supervisor sees it (serve/ranks/request_stream.py)."""

    def dispatch(self, result: StepResult) -> None:
        """Hand a step's deltas and errors to their requests."""

    def fail_rank(self, rank: int, error: Exception) -> int:
        """End the requests on `rank` with `error`; how many."""


class _NoRequests:
    def dispatch(self, result: StepResult) -> None:
        pass

    def fail_rank(self, rank: int, error: Exception) -> int:
        return 0


class RankSupervisor(GroupRecovery):
    """Starts the rank processes, watches their heartbeats and exits, restarts them, and reads
    everything they send (a step's results go on to the request stream)."""

    def __init__(self, config: EngineConfig, num_ranks: int = 1,
                 routing: str = "affinity", health: RankHealthConfig | None = None,
                 stream_interval: int = DEFAULT_STREAM_INTERVAL, api_servers: int = 1,
                 client_id: int = 0, ipc_dir: str | None = None) -> None:
        self.config = config
        self.requests: RequestSink = _NoRequests()  # the request stream, once one attaches
        self.num_ranks = num_ranks
        self.stream_interval = stream_interval
        self.health = health or RankHealthConfig()
        self.router = Router(num_ranks, routing)
        # API processes (--api-server-count): this one is client_id; process 0 owns the ranks.
        self.api_servers, self.client_id = api_servers, client_id
        self._ctx = zmq.asyncio.Context()
        self._dir = ipc_dir or tempfile.mkdtemp(prefix="deepinfer-ipc-")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_addr(self._dir, client_id))
        # Process 0 tells the others what becomes of the ranks (connected now, queued until
        # they bind: nothing is lost while they start).
        self._events = [self._connect_push(events_addr(self._dir, k))
                        for k in range(1, api_servers)] if client_id == 0 else []
        self._ranks: list[_Rank] = []
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (rank, reply)
        self._call_ids = itertools.count()
        self._spawns = itertools.count()  # a fresh inbox address for every process started
        self._tasks: set[asyncio.Task] = set()  # receiver, watchdog, pending restarts
        self._closing = False
        self._group = False  # the ranks form one expert-parallel group (set by start)
        self._auto_port = False  # the group's rendezvous port was picked here, not given
        self._group_failed_start = False  # a rank of the group died while (re)starting
        self._regroups = False  # a dead rank of the group is replaced alone (set by start)
        self._regrouping: Regrouping | None = None  # the one in progress
        self.regroup_timeout_s = START_TIMEOUT_S  # a replacement's start, as a first start's
        self._envs: list[dict[str, str]] = [{} for _ in range(num_ranks)]  # set by start
        self._node_pool: str | None = None  # the ranks' shared HiCache pool (set by start)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> list[Ready]:
        self._rendezvous()
        # All at once, before any rank starts: an impossible layout is one error, not a rank.
        self._envs = rank_envs(self.config.accelerator, self.num_ranks, process_env())
        self._node_pool = make_node_pool(self.config.cache, self.num_ranks)
        self._ranks = [self._spawn(rank) for rank in range(self.num_ranks)]
        await self._await_ready()
        now = asyncio.get_running_loop().time()
        for rank, r in enumerate(self._ranks):
            self._watch_exit(rank)
            r.state, r.last_beat, r.serving_since = RankState.SERVING, now, now
        self.background(self._receive())
        self.background(self._watchdog())
        return [r.ready for r in self._ranks]

    def _rendezvous(self) -> None:
        """Settle expert parallel and the group's port (see _with_rendezvous), and whether
        the ranks live and die as one group."""
        self._auto_port = self.config.parallel.master_port == 0
        self.config = _with_rendezvous(self.config, self.num_ranks)
        parallel = self.config.parallel
        self._group = parallel.ep and parallel.world_size > 1
        self._regroups = regroups(self.config, self.num_ranks)

    def _fresh_port(self) -> None:
        """A new group meets on a port picked afresh: the old group's may still be held (its
        store, sockets in TIME_WAIT). A port that was given is kept (several hosts: the other
        hosts' ranks come back to it)."""
        if self._auto_port:
            self.config = _with_rendezvous(_without_port(self.config), self.num_ranks)

    def _spawn(self, rank: int, placement_from: int | None = None) -> _Rank:
        spawn = next(self._spawns)
        inbox = self._bind_inbox(rank, spawn)
        clients = range(self.api_servers)
        spec = RankSpec(rank, self.num_ranks, self.config,
                        tuple(input_addr(self._dir, rank, spawn, k) for k in clients),
                        tuple(output_addr(self._dir, k) for k in clients),
                        self.health.heartbeat_interval_s,
                        logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                        self._envs[rank], self.stream_interval, placement_from,
                        place(self._node_pool, self.num_ranks, rank))
        process = mp.get_context("spawn").Process(target=run_rank, args=(spec,),
                                                  name=f"deepinfer-rank{rank}", daemon=True)
        process.start()
        return _Rank(process, inbox, spawn=spawn)

    def _bind_inbox(self, rank: int, spawn: int) -> zmq.asyncio.Socket:
        inbox = self._ctx.socket(zmq.PUSH)
        # No high-water mark: a send to a live rank never waits, so a send that cannot queue
        # means the rank is gone (see _send).
        inbox.setsockopt(zmq.SNDHWM, 0)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(input_addr(self._dir, rank, spawn, self.client_id))
        return inbox

    def _connect_push(self, addr: str) -> zmq.asyncio.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(addr)
        return push

    # ---- the other API processes ---------------------------------------------------------
    @property
    def ipc_dir(self) -> str:
        return self._dir

    def rank_events(self) -> list[RankEvent]:
        """Every rank as it is now (what another API process starts from)."""
        return [self._event(rank) for rank in range(len(self._ranks))]

    def _event(self, rank: int) -> RankEvent:
        r = self._ranks[rank]
        return RankEvent(rank, r.state.value, r.spawn, r.process.pid, r.process.exitcode,
                         r.kill_reason or r.group_reason, r.restarts, r.lost_requests)

    def _publish(self, rank: int) -> None:
        """Tell the other API processes what became of the rank."""
        if not self._events:
            return
        event = self._event(rank)
        for push in self._events:
            push.send_pyobj(event, flags=zmq.NOBLOCK)  # no high-water mark: never waits

    def background(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _watch_exit(self, rank: int) -> None:
        # The sentinel becomes readable the moment the process ends: no polling delay.
        process = self._ranks[rank].process
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_rank_exit, rank)

    async def _await_ready(self) -> None:
        pending = set(range(self.num_ranks))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while pending:
            if not await self._output.poll(timeout=1000):
                dead = [r for r in pending if not self._ranks[r].process.is_alive()]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited during start-up")
                if loop.time() > deadline:
                    raise TimeoutError("ranks did not report ready in time")
                continue
            message = await self._output.recv_pyobj()
            if isinstance(message, Failed):
                raise RankStartError(message.rank, message.error)
            if isinstance(message, Ready):
                self._ranks[message.rank].ready = message
                self._ranks[message.rank].stats = message.stats
                self._ranks[message.rank].spawned_at = None
                pending.discard(message.rank)

    async def shutdown(self) -> None:
        self._closing = True
        loop = asyncio.get_running_loop()
        for rank, r in enumerate(self._ranks):
            loop.remove_reader(r.process.sentinel)
            if r.state is RankState.STARTING:
                r.process.kill()  # a restart still loading has nothing to drain
            elif r.process.is_alive():
                await self.send(rank, Control("shutdown", next(self._call_ids)),
                                 missing_ok=True)
        for task in list(self._tasks):
            task.cancel()
        for rank in self._ranks:
            await asyncio.to_thread(rank.process.join, 10)
            if rank.process.is_alive():
                rank.process.kill()
                await asyncio.to_thread(rank.process.join, 5)
        self._ctx.destroy(linger=0)
        remove_node_pool(self._node_pool)
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)

    # ---- rank death and restart ----------------------------------------------------------
    def _on_rank_exit(self, rank: int) -> None:
        process = self._ranks[rank].process
        asyncio.get_running_loop().remove_reader(process.sentinel)
        # Reap it for its exit code: the sentinel closes as the process exits, so this wait is
        # over at once (bounded all the same, as it runs on the event loop).
        process.join(timeout=1.0)
        self._rank_died(rank)

    def _rank_died(self, rank: int) -> None:
        """Fail everything the rank owed us at once, route around it, and restart it (in an
        expert-parallel group: see GroupRecovery)."""
        r = self._ranks[rank]
        if self._closing or r.state.gone:
            return
        was_starting = r.state is RankState.STARTING
        r.state = RankState.DEAD
        self.router.mark_dead(rank)
        lost = self._fail_requests(rank, RankDiedError(rank, r.process.exitcode, r.kill_reason))
        r.lost_requests += lost
        what = r.kill_reason or describe_exit(r.process.exitcode)
        log.error("engine rank %d (pid %s) %s; failing its %d in-flight request(s); %d "
                  "rank(s) left", rank, r.process.pid, what, lost,
                  len(self.router.live_ranks()))
        self._publish(rank)
        if self._group:
            self._group_rank_died(rank, what, was_starting)
        else:
            self._schedule_restart([rank], failed_start=was_starting)

    def _fail_requests(self, rank: int, error: Exception) -> int:
        """End this process's requests and calls on the rank with `error`; how many
        requests."""
        for call_id, (owner, fut) in list(self._calls.items()):
            if owner == rank:
                del self._calls[call_id]
                if not fut.done():
                    fut.set_result(None)
        return self.requests.fail_rank(rank, error)

    def _schedule_restart(self, ranks: list[int], failed_start: bool = False,
                          placement_from: int | None = None) -> asyncio.Task | None:
        """Restart `ranks` together (one rank, or a whole expert-parallel group): the backoff
        and the limit count their deaths in a row, as one. The restart's task; None when the
        limit says no."""
        members = [self._ranks[rank] for rank in ranks]
        if self._served_long_enough(members):
            for m in members:
                m.streak = 0  # it served long enough: this death starts a new streak
        streak = max(m.streak for m in members)
        who = f"engine rank {ranks[0]}" if len(ranks) == 1 else \
            f"the expert-parallel group (ranks {', '.join(map(str, ranks))})"
        if streak >= self.health.max_restarts:
            log.error("%s is not restarted: it died %d time(s) in a row after restarts "
                      "(--max-rank-restarts)", who, streak + 1)
            for rank in ranks:  # /health and deepinfer:rank_failed say so from now on
                self._ranks[rank].state = RankState.FAILED
                self._publish(rank)
            return None
        delay = self.health.backoff_s(streak)
        log.warning("restarting %s in %.1f s (restart %d in a row, at most %d)%s", who, delay,
                    streak + 1, self.health.max_restarts,
                    "; its last start failed" if failed_start else "")
        return self.background(self._restart(ranks, delay, placement_from))

    def _served_long_enough(self, members: list[_Rank]) -> bool:
        if any(m.serving_since is None for m in members):
            return False  # (asked first: a rank that never served needs no event loop here)
        now = asyncio.get_running_loop().time()
        return all(now - m.serving_since >= self.health.stable_after_s for m in members)

    async def _restart(self, ranks: list[int], delay: float,
                       placement_from: int | None = None) -> None:
        await asyncio.sleep(delay)
        if self._closing:
            return
        for rank in ranks:
            old = self._ranks[rank]
            old.inbox.close(linger=0)
            new = self._spawn(rank, placement_from)
            new.restarts, new.streak, new.lost_requests = \
                old.restarts + 1, old.streak + 1, old.lost_requests
            new.ready, new.stats = old.ready, old.stats  # shown until the new process reports
            self._ranks[rank] = new
            self._watch_exit(rank)  # a restart that dies while loading is retried too
            self._publish(rank)

    def _on_ready(self, message: Ready) -> None:
        """A restarted rank loaded its model: it serves again (in a regroup: once every
        member of the group is ready)."""
        r = self._ranks[message.rank]
        if r.state is not RankState.STARTING or r.kill_reason:  # (killed with its group)
            return
        if r.spawned_at is not None:
            log.info("engine rank %d (pid %s) ready %.2f s after its spawn", message.rank,
                     r.process.pid, time.monotonic() - r.spawned_at)
            r.spawned_at = None
        if self._regrouping is not None and message.rank in self._regrouping.waiting:
            self._regroup_ready(message)
            return
        r.ready, r.stats, r.kill_reason = message, message.stats, ""
        r.state = RankState.SERVING
        r.last_beat = r.serving_since = asyncio.get_running_loop().time()
        self.router.mark_alive(message.rank)
        log.info("engine rank %d (pid %s) restarted and serving", message.rank, r.process.pid)
        self._publish(message.rank)

    # ---- heartbeats ----------------------------------------------------------------------
    def _on_heartbeat(self, beat: Heartbeat) -> None:
        r = self._ranks[beat.rank]
        if beat.pid != r.process.pid or r.state not in (RankState.SERVING, RankState.UNHEALTHY):
            return  # a late beat of a process that was replaced
        r.last_beat, r.busy_s = asyncio.get_running_loop().time(), beat.busy_s
        if r.state is RankState.UNHEALTHY and not r.kill_reason:  # (killed: it is dying)
            r.state = RankState.SERVING
            self.router.mark_alive(beat.rank)
            log.warning("engine rank %d responds again; routing to it", beat.rank)
            self._publish(beat.rank)

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.health.heartbeat_interval_s)
            for rank, r in enumerate(self._ranks):
                if r.state in (RankState.SERVING, RankState.UNHEALTHY):
                    self._judge(rank, r, loop.time() - r.last_beat)

    def _judge(self, rank: int, r: _Rank, silent_s: float) -> None:
        verdict, reason = judge(self.health, silent_s, r.busy_s)
        if verdict is Verdict.UNHEALTHY and r.state is RankState.SERVING:
            r.state = RankState.UNHEALTHY
            self.router.mark_dead(rank)
            log.warning("engine rank %d (pid %s) %s; routing around it", rank, r.process.pid,
                        reason)
            self._publish(rank)
        elif verdict is Verdict.KILL and not r.kill_reason:
            r.kill_reason = f"stopped responding ({reason}) and was killed"
            log.error("engine rank %d (pid %s) %s; killing it", rank, r.process.pid, reason)
            r.process.kill()  # its sentinel fires: _rank_died fails its requests, restarts it

    def check_alive(self) -> None:
        # The sentinel callback may not have run yet when a request arrives.
        for rank, r in enumerate(self._ranks):
            if not r.state.gone and not r.process.is_alive():
                self._rank_died(rank)

    async def send(self, rank: int, message: object, missing_ok: bool = False) -> None:
        """Send without waiting: a PUSH to a rank whose process is gone would wait forever."""
        try:
            await self._ranks[rank].inbox.send_pyobj(message, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.check_alive()
            if not missing_ok:
                raise RankDiedError(rank, self._ranks[rank].process.exitcode) from None

    # ---- the ranks as the API sees them ---------------------------------------------------
    @property
    def ready(self) -> Ready:
        return self._ranks[0].ready

    def exitcode(self, rank: int) -> int | None:
        return self._ranks[rank].process.exitcode

    def gone(self, rank: int) -> bool:
        """Whether the rank's process is dead or given up on (nothing to abort there)."""
        return self._ranks[rank].state.gone

    async def control(self, command: str) -> list[object]:
        """Send a command to every live rank and gather the replies (None from a rank that
        died meanwhile)."""
        loop = asyncio.get_running_loop()
        futures = []
        for rank in self.router.live_ranks():
            call_id = next(self._call_ids)
            fut = loop.create_future()
            self._calls[call_id] = (rank, fut)
            futures.append(fut)
            try:
                await self.send(rank, Control(command, call_id, self.client_id))
            except RankDiedError:
                self._calls.pop(call_id, None)
                fut.set_result(None)
        return list(await asyncio.wait_for(asyncio.gather(*futures), timeout=30))

    def stats(self) -> list[EngineStats | None]:
        """The latest stats of each rank; None for a rank that has not reported or is dead."""
        return [r.stats if self.router.alive[i] else None for i, r in enumerate(self._ranks)]

    def ranks(self) -> list[RankView]:
        self.check_alive()
        return [RankView(i, self.router.alive[i], r.process.pid, r.process.exitcode,
                         self.router.requests[i], self.router.load[i], r.lost_requests, r.stats,
                         r.state.value, r.restarts, r.experts)
                for i, r in enumerate(self._ranks)]

    async def _receive(self) -> None:
        while True:
            self._on_message(await self._output.recv_pyobj())
            self._drain()

    def _drain(self) -> None:
        """Read every message already here before any stream runs. A stream that fell behind
        the ranks' steps then finds the steps it missed in its inbox and writes them as one
        (coalesce); read one at a time, each step's deltas would be written before the next
        was read, and a busy API process would fall further behind every step."""
        for _ in range(MAX_DRAIN):  # bounded: ranks faster than this loop cannot starve it
            try:  # a non-blocking recv's future is done at once: no turn of the loop
                frame = self._output.recv(zmq.NOBLOCK).result()
            except zmq.Again:
                return
            self._on_message(pickle.loads(frame))

    def _on_message(self, message: object) -> None:
        if isinstance(message, StepResult):
            if message.stats is not None:
                self._ranks[message.rank].stats = message.stats
            self.requests.dispatch(message)
        elif isinstance(message, Heartbeat):
            self._on_heartbeat(message)
        elif isinstance(message, ExpertStats):
            self._ranks[message.rank].experts = message
        elif isinstance(message, ControlReply):
            _, fut = self._calls.pop(message.call_id, (None, None))
            if fut is not None and not fut.done():
                fut.set_result(message.result)
        elif isinstance(message, Ready):
            self._on_ready(message)
        elif isinstance(message, Failed):  # a restart that failed; its exit restarts it
            log.error("engine rank %d failed to restart:\n%s", message.rank, message.error)


def rank_envs(accelerator: str | None, num_ranks: int,
              environ: Mapping[str, str]) -> list[dict[str, str]]:
    """The extra environment of each rank, from the rank_env of `accelerator`, the backend the
    preflight chose (by its exact name: nothing is chosen or probed here, and the backend is
    never imported into this process). No backend chosen: nothing extra."""
    if not accelerator:
        return [{} for _ in range(num_ranks)]
    from deepinfer.core.plugins import find_accelerator, load_plugins

    info = find_accelerator(load_plugins().accelerators(), accelerator)
    rank_env = None if info is None else info.rank_env
    return [rank_env(rank, num_ranks, environ) if rank_env else {} for rank in range(num_ranks)]


def _without_port(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                    master_port=0))


def _with_rendezvous(config: EngineConfig, num_ranks: int) -> EngineConfig:
    """The config every rank gets: dp is this host's rank count, expert parallel decided (on
    by default for MoE models with several ranks), and ranks that form a torch.distributed
    group meet on a port free on this host (one host) or node 0's (several)."""
    parallel = dataclasses.replace(config.parallel, dp=num_ranks)
    if not parallel.ep and parallel.auto_ep and parallel.world_size > 1 and \
            has_experts(config.model.path):
        parallel = dataclasses.replace(parallel, ep=True)
    if parallel.ep and parallel.world_size > 1 and parallel.master_port == 0:
        with socket.socket() as probe:
            probe.bind((parallel.master_addr, 0))
            parallel = dataclasses.replace(parallel, master_port=probe.getsockname()[1])
    return dataclasses.replace(config, parallel=parallel)


def input_addr(ipc_dir: str, rank: int, spawn: int, client: int) -> str:
    """Where API process `client` sends requests to start `spawn` of `rank`."""
    return f"ipc://{ipc_dir}/input-{rank}-{spawn}" + (f"-{client}" if client else "")


def output_addr(ipc_dir: str, client: int) -> str:
    """Where the ranks send API process `client` its results."""
    return f"ipc://{ipc_dir}/output" + (f"-{client}" if client else "")


def events_addr(ipc_dir: str, client: int) -> str:
    """Where API process `client` (> 0) hears from process 0 what becomes of the ranks."""
    return f"ipc://{ipc_dir}/events-{client}"
