"""Guards of each HTTP connection: deadlines for a request's headers and body and for a response
write that cannot go out, and a cap on open connections.

uvicorn has none of them. A connection that trickles its headers or its body holds a socket and
a file descriptor for as long as it likes; a response write to a client that stopped reading
waits forever (uvicorn's send awaits the transport's drain while its write buffer is above the
high-water mark), and a stream that waits so also holds its engine request (KV blocks, a batch
slot). Only the protocol sees a connection before it has a request, and sees the transport's
write buffer fill and drain, so the guards live in a subclass of uvicorn's httptools protocol
(the one uvicorn picks when httptools is installed), given to uvicorn.Config(http=...).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deepinfer.serve.api.errors import error_body, error_response

log = logging.getLogger("deepinfer.serve")

RETRY_AFTER_S = 1  # what a client refused for capacity is told to wait
FD_RESERVE = 256  # descriptors left for the process's own files, pipes and IPC sockets
# A deadline that falls due is acted on only after one more pass over the sockets: uvloop runs
# due timers before it reads the sockets, so after a long turn of the event loop a deadline may
# fall due just before the bytes that meet it are read.
CONFIRM_S = 0.01


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 30.0  # from accepting (or a keep-alive request's first byte)
    body_timeout_s: float = 60.0  # from the headers to the body's last byte
    write_timeout_s: float = 30.0  # one response write blocked on a client that does not read
    max_connections: int = 0  # 0: from the open-file limit (default_max_connections)
    # The kernel's send buffer of a connection (0: its own, autotuned to megabytes): what a
    # client that stops reading holds before a write waits and write_timeout_s starts. An SSE
    # stream moves kilobytes a second, far below what 256 KiB carries at any round-trip time.
    send_buffer_kb: int = 256

    def __post_init__(self) -> None:
        if min(self.header_timeout_s, self.body_timeout_s, self.write_timeout_s) <= 0:
            raise ValueError("--header-timeout, --body-timeout and --write-timeout must be "
                             "> 0 seconds")
        if self.max_connections < 0:
            raise ValueError(f"--max-connections must be >= 0, got {self.max_connections}")
        if self.send_buffer_kb < 0:
            raise ValueError(f"--socket-send-buffer-kb must be >= 0, got {self.send_buffer_kb}")

    @property
    def connection_cap(self) -> int:
        return self.max_connections or default_max_connections()


def default_max_connections() -> int:
    """As many connections as the open-file limit allows, less a reserve: past it accept()
    fails with EMFILE, which clients see as a hang or a reset instead of a 503."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(64, soft - FD_RESERVE)


def raw_error(status: int, message: str) -> bytes:
    """A whole HTTP response with an OpenAI error body that closes the connection, for the
    protocol to write itself when no app can answer."""
    body = json.dumps(error_body(message, status)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards of `limits` (see guarded_protocol)."""

    limits: ClassVar[ConnectionLimits]
    cap: ClassVar[int]
    on_close: ClassVar[Callable[[str], None]]  # told why the server closed a connection early

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None  # the request's headers or body
        self._write_deadline: asyncio.TimerHandle | None = None
        self._refused = False

    # ---- a request's headers and body ----------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limits.send_buffer_kb:
            # Linux autotunes a send buffer up to 4 MB: that much of a stream can wait in the
            # kernel for a client that does not read before a write blocks at all.
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_kb << 10)
        # Judged once, as it opens: a connection let in keeps serving however many come later.
        self._refused = len(self.connections) > self.cap
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # (a first request's deadline runs from the accept)
            self._arm(self.limits.header_timeout_s, self._headers_late)

    def on_headers_complete(self) -> None:
        self._disarm()
        self.app = self._over_capacity if self._refused else self.config.loaded_app
        super().on_headers_complete()
        # (Without a body, on_message_complete comes next and disarms it.)
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_write()
        super().connection_lost(exc)

    def _arm(self, seconds: float, late: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._confirm, late)

    def _confirm(self, late: Callable[[], None]) -> None:
        self._deadline = self.loop.call_later(CONFIRM_S, late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        self._close("header_timeout")

    def _body_late(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # The app's reads now end (http.disconnect) and its writes go nowhere: the 408 is
            # the only response.
            cycle.disconnected = True
            self.transport.write(raw_error(408, f"the request body did not arrive within "
                                                f"{self.limits.body_timeout_s:g} s "
                                                "(--body-timeout)"))
            cycle.message_event.set()
        self._close("body_timeout")

    def _close(self, reason: str) -> None:
        log.debug("closing connection from %s: %s", self.client, reason)
        self.on_close(reason)
        self.transport.close()

    async def _over_capacity(self, scope, receive, send) -> None:
        self.on_close("over_capacity")
        response = error_response(
            f"the server is at its limit of {self.cap} open connections (--max-connections); "
            "retry later", 503, headers={"retry-after": str(RETRY_AFTER_S),
                                         "connection": "close"})
        await response(scope, receive, send)

    # ---- response writes -----------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.limits.write_timeout_s,
                                                        self._confirm_write)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write()

    def _disarm_write(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _confirm_write(self) -> None:
        self._write_deadline = self.loop.call_later(CONFIRM_S, self._write_late)

    def _write_late(self) -> None:
        self._write_deadline = None
        log.debug("aborting connection from %s: a write waited %g s on a client that does "
                  "not read", self.client, self.limits.write_timeout_s)
        self.on_close("write_timeout")
        # abort, not close: close would first wait for the buffer to drain, which it never
        # does. The app then sees a disconnect: a stream's engine request is aborted.
        self.transport.abort()


def guarded_protocol(limits: ConnectionLimits,
                     on_close: Callable[[str], None] = lambda reason: None
                     ) -> type[GuardedProtocol]:
    """The protocol class for uvicorn.Config(http=...) with these limits."""
    return type("GuardedProtocol", (GuardedProtocol,),
                {"limits": limits, "cap": limits.connection_cap,
                 "on_close": staticmethod(on_close)})
