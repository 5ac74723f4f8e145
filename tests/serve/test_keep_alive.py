"""Idle keep-alive connections stay open past uvicorn's own 5 s (--timeout-keep-alive, 60 s by
default): a client that opened its connections first and sends later must not find one closed
under its request (on uvloop a due keep-alive timer runs before the socket's pending request is
read, so a short timeout cut streams once a burst made one event-loop turn last seconds)."""
from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

from deepinfer.serve.cli import main

IDLE_S = 6.0  # past uvicorn's default of 5 s


def _get_health(conn: socket.socket, host: str) -> bytes:
    """One GET /health on the open connection: the whole response (headers, then a body of
    its Content-Length), or what came before the server closed the connection."""
    conn.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    reply = _read_until(conn, b"", lambda got: b"\r\n\r\n" in got)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + b"\r\n\r\n" + _read_until(conn, body, lambda got: len(got) >= length)


def _read_until(conn: socket.socket, got: bytes, done) -> bytes:
    while not done(got):
        chunk = conn.recv(4096)
        if not chunk:
            break  # the server closed the connection
        got += chunk
    return got


def test_an_idle_connection_outlives_five_seconds(tiny_server):
    url = urlparse(tiny_server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        assert _get_health(conn, url.netloc).startswith(b"HTTP/1.1 200")
        time.sleep(IDLE_S)
        assert _get_health(conn, url.netloc).startswith(b"HTTP/1.1 200"), \
            "the server closed an idle keep-alive connection"


def test_keep_alive_must_be_positive(capsys):
    assert main(["--port", "0", "--accelerator", "cpu", "--timeout-keep-alive", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "deepinfer-serve: error: --timeout-keep-alive must be > 0 seconds, got 0.0"
