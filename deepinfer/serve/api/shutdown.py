"""Stopping the HTTP server without cutting requests off.

uvicorn's own shutdown closes the listener, waits for the connections a while and then cancels
the request tasks: a stream ends mid-body with no terminal event and a traceback in the log.
Here the server first drains (Drain.run, before uvicorn's shutdown): new requests are answered
503 with Retry-After and an OpenAI error body (the listener stays open meanwhile, so a client
is told rather than refused), requests in flight may finish for up to --shutdown-timeout
seconds, and those still running then are ended through the request stream: each stream with an
error event and [DONE], each other request with a 503. uvicorn's shutdown then finds no request
left to cancel.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import uvicorn

from deepinfer.serve.api.connections import RETRY_AFTER_S
from deepinfer.serve.api.errors import error_response

log = logging.getLogger("deepinfer.serve")

END_GRACE_S = 5.0  # for the requests ended at the deadline to write their last events
POLL_S = 0.05


class Drain:
    """Whether the server admits requests, and how many it is answering."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.admitting = True
        self.in_flight = 0

    async def run(self, end_requests: Callable[[], None], forced: Callable[[], bool]) -> None:
        """Stop admitting, wait for the requests in flight, then end what is left."""
        self.admitting = False
        if self.in_flight:
            log.info("waiting up to %g s (--shutdown-timeout) for %d request(s) in flight",
                     self.timeout_s, self.in_flight)
        if await self._settled(self.timeout_s, forced):
            return
        log.warning("ending %d request(s) still in flight after %g s (--shutdown-timeout)",
                    self.in_flight, self.timeout_s)
        end_requests()
        await self._settled(END_GRACE_S, forced)

    async def _settled(self, seconds: float, forced: Callable[[], bool]) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.in_flight and not forced() and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.in_flight


class AdmissionMiddleware:
    """Counts the requests in flight; once the server drains, answers every new one 503."""

    def __init__(self, app, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.drain.admitting:
            response = error_response("the server is shutting down", 503,
                                      headers={"retry-after": str(RETRY_AFTER_S),
                                               "connection": "close"})
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining before its own shutdown. `end_requests` ends the requests
    still in flight at the deadline; `on_stop` runs as the drain begins."""

    def __init__(self, config: uvicorn.Config, drain: Drain, end_requests: Callable[[], None],
                 on_stop: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.drain, self.end_requests, self.on_stop = drain, end_requests, on_stop

    async def shutdown(self, sockets=None) -> None:
        self.on_stop()
        await self.drain.run(self.end_requests, lambda: self.force_exit)
        await super().shutdown(sockets)
