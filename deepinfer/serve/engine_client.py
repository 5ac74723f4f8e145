"""The API process's side of the rank processes: start them, stream their results.

One receiver task reads every rank's results and routes each delta to the asyncio queue of
its request, so no request ever waits on model work in the event loop.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import tempfile
from dataclasses import dataclass
from typing import AsyncIterator

import zmq
import zmq.asyncio

from deepinfer.core.config import EngineConfig
from deepinfer.core.router import Router
from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.engine_proc import RankSpec, run_rank
from deepinfer.serve.ipc import (AbortRequest, AddRequest, Control, ControlReply, EngineStats,
                                 Failed, Ready, RequestError, StepResult, TokenDelta)

START_TIMEOUT_S = 600.0  # a first start may convert a checkpoint


class EngineRequestError(ValueError):
    """The engine refused the request; the message is meant for the user."""


@dataclass
class _Rank:
    process: mp.process.BaseProcess
    inbox: zmq.asyncio.Socket
    ready: Ready | None = None
    stats: EngineStats | None = None


class EngineClient:
    def __init__(self, config: EngineConfig, num_ranks: int = 1,
                 routing: str = "affinity") -> None:
        self.config = config
        self.num_ranks = num_ranks
        self.router = Router(num_ranks, routing)
        self._ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._dir}/output")
        self._ranks: list[_Rank] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, int] = {}  # request id -> rank
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._receiver: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> list[Ready]:
        spawn = mp.get_context("spawn")
        for rank in range(self.num_ranks):
            inbox = self._ctx.socket(zmq.PUSH)
            addr = f"ipc://{self._dir}/input-{rank}"
            inbox.bind(addr)
            spec = RankSpec(rank, self.num_ranks, self.config, addr, f"ipc://{self._dir}/output")
            process = spawn.Process(target=run_rank, args=(spec,), name=f"deepinfer-rank{rank}",
                                    daemon=True)
            process.start()
            self._ranks.append(_Rank(process, inbox))
        await self._await_ready()
        self._receiver = asyncio.create_task(self._receive())
        return [r.ready for r in self._ranks]

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
                raise RuntimeError(f"rank {message.rank} failed to start:\n{message.error}")
            if isinstance(message, Ready):
                self._ranks[message.rank].ready = message
                pending.discard(message.rank)

    async def shutdown(self) -> None:
        if self._receiver is not None:
            for rank in self._ranks:
                if rank.process.is_alive():
                    await rank.inbox.send_pyobj(Control("shutdown", next(self._call_ids)))
            self._receiver.cancel()
        for rank in self._ranks:
            await asyncio.to_thread(rank.process.join, 10)
            if rank.process.is_alive():
                rank.process.kill()
                await asyncio.to_thread(rank.process.join, 5)
        self._ctx.destroy(linger=0)
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)

    # ---- requests ------------------------------------------------------------------------
    @property
    def ready(self) -> Ready:
        return self._ranks[0].ready

    def pick_rank(self, route_key: str = "", prompt_tokens: int = 0) -> int:
        """The rank for a request (see deepinfer.core.router); raises NoLiveRankError."""
        for rank, r in enumerate(self._ranks):
            if self.router.alive[rank] and not r.process.is_alive():
                self.router.mark_dead(rank)
        return self.router.pick(route_key, prompt_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, prefix_cache: bool = True,
                       route_key: str = "") -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas; leaving early (disconnect, cancel) aborts it.

        `route_key` pins the request's conversation to a rank (affinity routing)."""
        queue: asyncio.Queue = asyncio.Queue()
        tokens = len(prompt_token_ids)
        rank = self.pick_rank(route_key, tokens)
        self._queues[request_id] = queue
        self._owner[request_id] = rank
        self.router.started(rank, tokens)
        finished = 0
        try:
            await self._ranks[rank].inbox.send_pyobj(
                AddRequest(request_id, prompt_token_ids, params, prefix_cache))
            while finished < params.n:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished += item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._owner.pop(request_id, None)
            self.router.finished(rank, tokens)
            if finished < params.n:
                await self._ranks[rank].inbox.send_pyobj(AbortRequest(request_id))

    async def control(self, command: str) -> list[object]:
        """Send a command to every rank and gather the replies."""
        loop = asyncio.get_running_loop()
        futures = []
        for rank in self._ranks:
            call_id = next(self._call_ids)
            self._calls[call_id] = fut = loop.create_future()
            futures.append(fut)
            await rank.inbox.send_pyobj(Control(command, call_id))
        return list(await asyncio.wait_for(asyncio.gather(*futures), timeout=30))

    def stats(self) -> list[EngineStats | None]:
        return [r.stats for r in self._ranks]

    def num_in_flight(self) -> int:
        return len(self._queues)

    async def _receive(self) -> None:
        while True:
            message = await self._output.recv_pyobj()
            if isinstance(message, StepResult):
                self._dispatch(message)
            elif isinstance(message, ControlReply):
                fut = self._calls.pop(message.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(message.result)

    def _dispatch(self, result: StepResult) -> None:
        if result.stats is not None:
            self._ranks[result.rank].stats = result.stats
        for delta in result.deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        for error in result.errors:
            queue = self._queues.get(error.request_id)
            if queue is not None:
                queue.put_nowait(EngineRequestError(error.message))
