"""The API process's requests on the ranks: submit one, stream its deltas, abort it.

Each request in flight has an inbox (serve/ranks/inbox.py) that the supervisor's receiver
fills from the ranks' step results; its stream reads the inbox, and a stream that ends early
(its client gone, an error) aborts the request on its rank.
"""
from __future__ import annotations

from typing import AsyncIterator

from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.ranks.inbox import DEFAULT_STREAM_BACKLOG, Inbox, RequestAborted, coalesce
from deepinfer.serve.ranks.ipc import AbortRequest, AddRequest, StepResult, TokenDelta
from deepinfer.serve.ranks.rank import EngineRequestError, RankDiedError
from deepinfer.serve.ranks.router import Route
from deepinfer.serve.ranks.supervisor import RankSupervisor


class RequestStream:
    """This API process's requests in flight on the ranks that `supervisor` keeps."""

    def __init__(self, supervisor: RankSupervisor,
                 backlog: int = DEFAULT_STREAM_BACKLOG) -> None:
        self.supervisor = supervisor
        self.backlog = backlog  # deltas a sample may leave unread before it is aborted
        self._ended: Exception | None = None  # set by end_requests: the server is stopping
        self._queues: dict[str, Inbox] = {}
        self._owner: dict[str, int] = {}  # request id -> rank
        supervisor.requests = self

    def route(self, route_key: str = "", prompt_tokens: int = 0) -> Route:
        """Pick a rank and count the request's load there until the route is released;
        raises NoLiveRankError."""
        self.supervisor.check_alive()
        return self.supervisor.router.reserve(route_key, prompt_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, prefix_cache: bool = True,
                       route_key: str = "", route: Route | None = None,
                       final_only: bool = False,
                       grammar: str | None = None) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas; leaving early (disconnect, cancel) aborts it.

        `route` (from :meth:`route`) says where it runs and is released when it ends; without
        one, `route_key` picks the rank (affinity routing pins a conversation's key to a
        rank). `final_only`: the caller reads the answer at its end, so the rank sends each
        sample's first token and then the rest at its end. `grammar`: the constraint compiled
        (serialized), which the rank loads. Raises RankDiedError if the rank dies."""
        if route is None:
            route = self.route(route_key, len(prompt_token_ids))
        rank, supervisor = route.rank, self.supervisor
        queue = Inbox(self.backlog * params.n)
        finished = 0
        try:
            if self._ended is not None:
                raise self._ended
            if not supervisor.router.alive[rank]:
                raise RankDiedError(rank, supervisor.exitcode(rank))
            self._queues[request_id] = queue
            self._owner[request_id] = rank
            await supervisor.send(rank, AddRequest(request_id, prompt_token_ids, params,
                                                   prefix_cache, final_only,
                                                   supervisor.client_id, grammar))
            held = None
            while finished < params.n:
                item = held if held is not None else await queue.get()
                if isinstance(item, Exception):
                    raise item
                item, held = coalesce(item, queue)
                finished += item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._owner.pop(request_id, None)
            route.release()
            if finished < params.n and not supervisor.gone(rank):
                await supervisor.send(rank, AbortRequest(request_id), missing_ok=True)

    def end_requests(self, error: Exception) -> None:
        """End every request in flight, and every later one, with `error` (the server is
        stopping); each is aborted on its rank as its stream ends."""
        self._ended = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    def num_in_flight(self) -> int:
        return len(self._queues)

    def fail_rank(self, rank: int, error: Exception) -> int:
        """End the requests on `rank` with `error` (it died, or left its step); how many."""
        lost = [rid for rid, owner in self._owner.items() if owner == rank]
        for rid in lost:
            self._queues[rid].put_nowait(error)
        return len(lost)

    def dispatch(self, result: StepResult) -> None:
        """A step's deltas and errors, each to the inbox of its request."""
        for delta in result.deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None and not queue.put_nowait(delta):
                self._shed(delta.request_id, queue)
        for error in result.errors:
            queue = self._queues.get(error.request_id)
            if queue is not None:
                queue.put_nowait(EngineRequestError(error.message, error.status))

    def _shed(self, request_id: str, queue: Inbox) -> None:
        """A stream that left more than its bound of deltas unread (its client does not read):
        aborted on its rank now, its deltas dropped, and the error left for its stream.
        (Its generate sends the rank a second abort as it ends: a no-op there.)"""
        rank = self._owner.pop(request_id)
        del self._queues[request_id]
        queue.fail(RequestAborted(
            f"the stream was aborted: its client left more than {queue.limit} events unread "
            "(--max-stream-backlog)", 408))
        self.supervisor.background(
            self.supervisor.send(rank, AbortRequest(request_id), missing_ok=True))
