"""What a rank sent for one request, as its stream reads it.

The receiver task puts each delta in the request's inbox; the request's one stream waits on it.
asyncio.Queue would do, but it pays for what one reader and an unbounded size never use (an
Event, two waiter deques, a loop check on every call), once per token of every stream.
"""
from __future__ import annotations

import asyncio
from collections import deque

from deepinfer.serve.ipc import TokenDelta


class Inbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
