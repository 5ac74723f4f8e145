"""Grammar compilation for the API process: a few worker processes, a time limit, a cache.

The event loop only awaits a worker's answer. A compile that runs past the time limit has its
worker killed (another starts on the next need) and the request gets a 400; results are
cached by constraint, and requests that ask for a constraint being compiled wait on that one
compile. Workers start on the first constrained request.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import sys
from dataclasses import dataclass

from deepinfer.core.sampling import StructuredOutput
from deepinfer.serve.grammar.cache import (
    CompiledConstraint,
    GrammarCache,
    InvalidConstraint,
    Outcome,
)
from deepinfer.serve.grammar.worker import HEADER, READY, Compiled, WorkerSetup, frame

log = logging.getLogger("deepinfer.serve")
START_TIMEOUT_S = 300.0  # a worker's start (imports, tokenizer): not the request's limit
CACHE_ENTRIES = 256
CACHE_BYTES = 256 << 20


class GrammarError(ValueError):
    """A constraint that cannot be served: invalid, or over the compile time limit."""


class GrammarUnavailable(RuntimeError):
    """No grammar worker could take the constraint (one died idle, or none could start):
    the server's fault, not the constraint's; a retry gets a fresh worker."""


@dataclass(eq=False)
class _Worker:
    process: asyncio.subprocess.Process

    async def send(self, message: object) -> None:
        self.process.stdin.write(frame(message))
        await self.process.stdin.drain()

    async def receive(self) -> object:
        out = self.process.stdout
        size = HEADER.unpack(await out.readexactly(HEADER.size))[0]
        return pickle.loads(await out.readexactly(size))

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


class GrammarPool:
    def __init__(self, setup: WorkerSetup, workers: int, timeout_s: float,
                 timeout_flag: str = "--grammar-compile-timeout") -> None:
        self.setup, self.timeout_s, self.timeout_flag = setup, timeout_s, timeout_flag
        self.cache = GrammarCache(CACHE_ENTRIES, CACHE_BYTES)
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._starting = 0
        self._refills: set[asyncio.Future] = set()
        self._closed = False
        self._workers = workers
        self._compiling: dict[StructuredOutput, asyncio.Future] = {}

    async def compile(self, spec: StructuredOutput) -> CompiledConstraint:
        """The constraint compiled (from the cache, or a worker); GrammarError if it is
        invalid or its compile ran past the time limit."""
        outcome = self.cache.get(spec)
        if outcome is None:
            task = self._compiling.get(spec)
            if task is None:
                task = asyncio.ensure_future(self._compile(spec))
                self._compiling[spec] = task
                task.add_done_callback(lambda _: self._compiling.pop(spec, None))
            # A client that leaves does not stop a compile others may be waiting on.
            outcome = await asyncio.shield(task)
        if isinstance(outcome, InvalidConstraint):
            raise GrammarError(outcome.message)
        return outcome

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._compiling.values()) + list(self._refills)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._refills, return_exceptions=True)
        workers, self._idle = self._idle + list(self._busy), []
        for worker in workers:
            await worker.kill()

    async def _compile(self, spec: StructuredOutput) -> Outcome:
        async with self._slots:
            worker = await self._take()
            self._busy.add(worker)
            try:
                result = await self._run(worker, spec)
            except GrammarError as exc:  # over the time limit, or it took its worker down
                self._busy.discard(worker)
                await self._replace(worker)
                self.cache.put(spec, InvalidConstraint(str(exc)))  # refused at once next time
                raise
            except BaseException:
                self._busy.discard(worker)
                await self._replace(worker)
                raise
            self._busy.discard(worker)
            if result.retiring:
                await self._replace(worker)
            else:
                self._idle.append(worker)
        outcome: Outcome = InvalidConstraint(result.error) if result.error is not None \
            else CompiledConstraint(result.serialized, result.seconds)
        self.cache.put(spec, outcome)
        return outcome

    async def _run(self, worker: _Worker, spec: StructuredOutput) -> Compiled:
        try:
            await worker.send(spec)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:  # it died while idle
            raise GrammarUnavailable("a grammar worker exited; retry the request") from exc
        try:
            return await asyncio.wait_for(worker.receive(), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(f"the constraint took longer than {self.timeout_s:g} s to "
                               f"compile ({self.timeout_flag}); simplify it") from None
        except asyncio.IncompleteReadError:
            raise GrammarError("the constraint could not be compiled: the grammar compiler "
                               "exited") from None

    async def _take(self) -> _Worker:
        while not self._idle and self._refills:  # a successor is starting: wait for it
            await asyncio.wait(set(self._refills))
        return self._idle.pop() if self._idle else await self._start()

    async def _replace(self, worker: _Worker) -> None:
        """Kill a worker and start its successor in the background, so the next request
        does not wait for a start."""
        await worker.kill()
        refill = asyncio.ensure_future(self._refill())
        self._refills.add(refill)
        refill.add_done_callback(self._refilled)

    def _refilled(self, task: asyncio.Future) -> None:
        self._refills.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("grammar worker could not start: %s", task.exception())

    async def _refill(self) -> None:
        if not self._closed and \
                len(self._idle) + len(self._busy) + self._starting < self._workers:
            self._idle.append(await self._start())

    async def _start(self) -> _Worker:
        self._starting += 1
        try:
            return await self._spawn()
        finally:
            self._starting -= 1

    async def _spawn(self) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deepinfer.serve.grammar.worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = _Worker(process)
        try:
            await worker.send(self.setup)
            ready = await asyncio.wait_for(worker.receive(), START_TIMEOUT_S)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            await worker.kill()
            raise GrammarUnavailable("a grammar worker could not start; retry the request") \
                from exc
        except BaseException:
            await worker.kill()
            raise
        if ready != READY:  # why it cannot compile (xgrammar is not installed)
            await worker.kill()
            raise GrammarError(str(ready))
        log.info("grammar worker started (pid %d)", process.pid)
        return worker
