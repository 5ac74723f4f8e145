"""The connection guards (serve/api/connections.py) on a real uvicorn server in a thread, with a
small ASGI app: header and body deadlines, the connection cap, the write deadline; and the
drain's admission (serve/api/shutdown.py) and the bounded inbox, in-process."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest
import uvicorn
from starlette.responses import StreamingResponse

from deepinfer.serve.api.connections import ConnectionLimits, guarded_protocol
from deepinfer.serve.api.shutdown import AdmissionMiddleware, Drain
from deepinfer.serve.ranks.inbox import Inbox, RequestAborted


class _App:
    """GET /stream: 64 KiB chunks until the client goes (a StreamingResponse, as the server's
    streams are); anything else: its body read, then "ok"."""

    def __init__(self) -> None:
        self.stream_ended = threading.Event()

    async def _chunks(self):
        try:
            while True:
                yield b"x" * 65536
                await asyncio.sleep(0)  # as a stream waits on its inbox
        finally:
            self.stream_ended.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] == "/stream":
            await StreamingResponse(self._chunks())(scope, receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _server(app, **limits) -> Iterator[tuple[int, list[str]]]:
    """The app behind the guarded protocol on a free port; yields (port, close reasons)."""
    closed: list[str] = []
    config = uvicorn.Config(app, http=guarded_protocol(ConnectionLimits(**limits), closed.append),
                            ws="none", lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield listener.getsockname()[1], closed
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def _connect(port: int, **opts) -> socket.socket:
    conn = socket.socket()
    for opt, value in opts.items():
        conn.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), value)
    conn.settimeout(10)
    conn.connect(("127.0.0.1", port))
    return conn


def _read_all(conn: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    got = b""
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_headers_that_do_not_arrive_in_time_close_the_connection():
    with _server(_App(), header_timeout_s=0.3) as (port, closed):
        with _connect(port) as slow, _connect(port) as prompt:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
            prompt.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read_all(prompt).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert _read_all(slow) == b""
            assert time.monotonic() - t0 < 3
    assert closed == ["header_timeout"]


def test_a_body_that_does_not_arrive_in_time_is_answered_408():
    with _server(_App(), body_timeout_s=0.3) as (port, closed):
        with _connect(port) as conn:
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
            reply = _read_all(conn)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head
    error = json.loads(body)["error"]
    assert error["code"] == 408 and "--body-timeout" in error["message"]
    assert closed == ["body_timeout"]


def test_connections_over_the_cap_get_503_with_retry_after():
    with _server(_App(), max_connections=2) as (port, closed):
        first, second = _connect(port), _connect(port)
        time.sleep(0.1)  # both accepted before the third
        with _connect(port) as third:
            third.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head, _, body = _read_all(third).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head
        assert json.loads(body)["error"]["code"] == 503
        assert "--max-connections" in json.loads(body)["error"]["message"]
        first.close()
        time.sleep(0.1)
        with _connect(port) as fourth:  # under the cap again
            fourth.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read_all(fourth).startswith(b"HTTP/1.1 200")
        second.close()
    assert closed == ["over_capacity"]


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout():
    app = _App()
    with _server(app, write_timeout_s=0.5, send_buffer_kb=16) as (port, closed):
        with _connect(port, SO_RCVBUF=4096) as conn:
            conn.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
            assert app.stream_ended.wait(10), "the stream to a client that does not read " \
                                              "must end"
    assert closed == ["write_timeout"]


# ---- the drain's admission, the bounded inbox --------------------------------------------
async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_draining_server_answers_new_requests_503():
    drain = Drain(1.0)
    app = AdmissionMiddleware(_ok, drain)

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://x") as client:
            return await client.get("/health")

    assert asyncio.run(get()).status_code == 200
    drain.admitting = False
    reply = asyncio.run(get())
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == "the server is shutting down"


def test_the_drain_waits_then_ends_what_is_left():
    drain = Drain(0.2)
    ended: list[float] = []

    def end_requests() -> None:
        ended.append(time.monotonic())
        drain.in_flight = 0  # the requests answer their end at once

    drain.in_flight = 1
    t0 = time.monotonic()
    asyncio.run(drain.run(end_requests, lambda: False))
    assert not drain.admitting and len(ended) == 1 and ended[0] - t0 >= 0.2
    asyncio.run(drain.run(lambda: pytest.fail("nothing left to end"), lambda: False))


def test_an_inbox_past_its_bound_says_so_and_fails_its_reader():
    inbox = Inbox(limit=2)
    assert inbox.put_nowait(1) and inbox.put_nowait(2)
    assert not inbox.put_nowait(3)
    inbox.fail(RequestAborted("too slow", 408))
    assert inbox.qsize() == 1 and isinstance(inbox.get_nowait(), RequestAborted)
    assert Inbox().put_nowait(1)  # unbounded
