"""More API processes on the same port (--api-server-count N, as vLLM's): processes 1..N-1.

One API process is a single event loop: at hundreds of streams over several ranks its HTTP,
JSON and SSE work becomes the limit. Each extra process accepts on the listening socket that
process 0 bound (the kernel hands every connection to one of them), talks to every rank
directly over sockets of its own (its requests go in on its own input address of each rank, its
results come back on its own output address: ranks/outbox.py) and serves /health and /metrics
too. Process 0 alone starts, watches and restarts the ranks; it tells the others what becomes
of each rank (RankEvent): a rank that dies fails their requests on it as well, and a restarted
rank is served through the new input addresses its spawn number names. If an API process dies,
process 0 stops the server; if process 0 dies, the others exit.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
from dataclasses import dataclass

import zmq
import zmq.asyncio

from deepinfer.serve.ranks.health import RankState
from deepinfer.serve.ranks.ipc import RankEvent, Ready
from deepinfer.serve.ranks.rank import RankDiedError, RemoteProcess, _Rank
from deepinfer.serve.ranks.supervisor import RankSupervisor, events_addr

log = logging.getLogger("deepinfer.serve")
PARENT_CHECK_S = 1.0
CONNECT_GRACE_S = 2.0  # how long a send waits for a serving rank to connect to a new inbox


class AttachedRankSupervisor(RankSupervisor):
    """The rank supervisor of an API process that does not own the ranks: their lives come
    from process 0's RankEvents instead of their processes."""

    async def attach(self, events: list[RankEvent], ready: list[Ready]) -> list[Ready]:
        self._event_inbox = self._ctx.socket(zmq.PULL)
        self._event_inbox.bind(events_addr(self._dir, self.client_id))
        self._own_lost = [0] * self.num_ranks
        self._ranks = [_Rank(RemoteProcess(e.pid), None, ready=ready[e.rank],
                             stats=ready[e.rank].stats) for e in events]
        for event in events:
            self._apply(event)
        self.background(self._receive())
        self.background(self._follow())
        return ready

    async def _follow(self) -> None:
        while True:
            self._apply(await self._event_inbox.recv_pyobj())

    def _apply(self, event: RankEvent) -> None:
        r = self._ranks[event.rank]
        if r.inbox is None or event.spawn != r.spawn:  # a new process: its own addresses
            if r.inbox is not None:
                r.inbox.close(linger=0)
            r.inbox, r.spawn = self._bind_inbox(event.rank, event.spawn), event.spawn
        state = RankState(event.state)
        r.process = RemoteProcess(event.pid, event.exitcode, not state.gone)
        r.restarts, r.kill_reason = event.restarts, event.reason
        # A serving rank that starts again without dying left its step in a regroup.
        if state.gone and not r.state.gone or \
                state is RankState.STARTING and r.state in (RankState.SERVING,
                                                            RankState.UNHEALTHY):
            error = RankDiedError(event.rank, event.exitcode, event.reason)
            self._own_lost[event.rank] += self._fail_requests(event.rank, error)
        r.lost_requests = event.lost_requests + self._own_lost[event.rank]
        r.state = state
        if state is RankState.SERVING:
            self.router.mark_alive(event.rank)
        else:
            self.router.mark_dead(event.rank)

    def check_alive(self) -> None:
        pass  # process 0 watches the ranks and says when one dies

    async def send(self, rank: int, message: object, missing_ok: bool = False) -> None:
        """A rank connects to a freshly bound input address within its reconnect interval: a
        send that cannot queue yet is retried for a moment while the rank serves."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_GRACE_S
        while True:
            try:
                await self._ranks[rank].inbox.send_pyobj(message, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                r = self._ranks[rank]
                if r.state.gone or loop.time() > deadline:
                    if missing_ok:
                        return
                    raise RankDiedError(rank, r.process.exitcode, r.kill_reason) from None
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        self._ctx.destroy(linger=0)  # the ranks and the IPC folder are process 0's


@dataclass
class WorkerSpec:
    client_id: int
    args: argparse.Namespace
    model_dir: str
    supervisor: dict  # RankSupervisor's settings (config, ranks, routing, health, intervals, dir)
    ranks: list[RankEvent]
    ready: list[Ready]
    listener: socket.socket  # process 0's, shared
    started: "mp.synchronize.Event"  # set once it attached to the ranks and loaded its tokenizer


async def start_workers(args: argparse.Namespace, model_dir: str, supervisor: RankSupervisor,
                        ready: list[Ready], listener: socket.socket
                        ) -> list[mp.process.BaseProcess]:
    """Processes 1..N-1, returned once each serves (so /health answers only when all do);
    RuntimeError if one exits first."""
    spawn = mp.get_context("spawn")
    settings = dict(config=supervisor.config, num_ranks=supervisor.num_ranks,
                    routing=supervisor.router.policy, health=supervisor.health,
                    stream_interval=supervisor.stream_interval,
                    api_servers=supervisor.api_servers, ipc_dir=supervisor.ipc_dir)
    workers, started = [], []
    for k in range(1, supervisor.api_servers):
        started.append(spawn.Event())
        spec = WorkerSpec(k, args, model_dir, settings, supervisor.rank_events(), ready,
                          listener, started[-1])
        process = spawn.Process(target=run_worker, args=(spec,), name=f"deepinfer-api{k}",
                                daemon=True)
        process.start()
        workers.append(process)
    for process, event in zip(workers, started):
        while not await asyncio.to_thread(event.wait, 0.2):
            if not process.is_alive():
                await stop_workers(workers)
                raise RuntimeError(f"API process {process.name} exited during start-up "
                                   f"with code {process.exitcode}")
    return workers


async def stop_workers(workers: list[mp.process.BaseProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM each (it drains its requests and stops: serve/api/shutdown.py), killed after
    `timeout_s`."""
    for process in workers:
        if process.is_alive():
            process.terminate()
    for process in workers:
        await asyncio.to_thread(process.join, timeout_s)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, 5)


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of API process spec.client_id (multiprocessing spawn target)."""
    from deepinfer.serve.http_server import run_event_loop

    logging.basicConfig(level=spec.args.log_level.upper(),
                        format=f"%(levelname)s %(name)s[api {spec.client_id}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # process 0 stops us (SIGTERM)
    run_event_loop(_serve(spec))


async def _serve(spec: WorkerSpec) -> None:
    from deepinfer.serve.http_server import load_tokenizers, serve_http

    supervisor = AttachedRankSupervisor(client_id=spec.client_id, **spec.supervisor)
    await supervisor.attach(spec.ranks, spec.ready)
    tokenizer, prompt_tokenizer = await asyncio.to_thread(load_tokenizers, spec.args,
                                                          spec.model_dir)
    spec.started.set()
    watch = asyncio.ensure_future(_exit_with_parent(os.getppid()))
    try:
        await serve_http(spec.args, spec.model_dir, supervisor, spec.ready, tokenizer,
                         prompt_tokenizer, spec.listener, observes_engine=False)
    finally:
        watch.cancel()
        spec.listener.close()
        await supervisor.shutdown()
        prompt_tokenizer.close()


async def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("API process 0 is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)
