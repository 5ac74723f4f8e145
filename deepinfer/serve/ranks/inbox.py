"""What a rank sent for one request, as its stream reads it.

The receiver task puts each delta in the request's inbox; the request's one stream waits on it.
asyncio.Queue would do, but it pays for what one reader and an unbounded size never use (an
Event, two waiter deques, a loop check on every call), once per token of every stream.

An inbox may be bounded: a stream whose client does not read stops reading its inbox (its
writes wait on the socket) while the rank goes on generating, and its deltas would pile up
without end. Past the bound the request stream aborts the request (RequestStream._shed).
"""
from __future__ import annotations

import asyncio
from collections import deque

from deepinfer.serve.ranks.ipc import TokenDelta

# Deltas a sample's stream may leave unread before it is aborted (--max-stream-backlog): a
# stream that keeps up reads its inbox every turn of the event loop, which brings at most 256
# rank messages (RankSupervisor._drain), one delta a sample each.
DEFAULT_STREAM_BACKLOG = 1024


class RequestAborted(Exception):
    """The server ended a request before its end (its client fell too far behind the stream,
    or the server is stopping); its rank was told to abort it. `status`: the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Inbox:
    __slots__ = ("_items", "_waiter", "limit")

    def __init__(self, limit: int = 0) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.limit = limit  # most items left unread (0: no bound)

    def put_nowait(self, item: object) -> bool:
        """Queue `item`; False when more than `limit` items now wait unread."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return not self.limit or len(self._items) <= self.limit

    def fail(self, error: Exception) -> None:
        """Drop what waits unread; the reader's next item is `error`."""
        self._items.clear()
        self.put_nowait(error)

    async def get(self) -> object:
        """The next item, waiting for it (one reader at a time)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> object:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


def coalesce(delta: TokenDelta, inbox: Inbox) -> tuple[TokenDelta, object | None]:
    """`delta` joined with the deltas of the same sample queued right behind it, and the first
    queued item that is not one of them (None if none). Under load the API falls behind the
    ranks' steps; a stream then gets the steps it missed as one delta, one SSE write, instead
    of a write each."""
    while not delta.finished and not inbox.empty():
        later = inbox.get_nowait()
        if not isinstance(later, TokenDelta) or later.index != delta.index:
            return delta, later
        delta = delta.then(later)
    return delta, None
