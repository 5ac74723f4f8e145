"""A real server's guards against clients that hold its capacity, and its stop: a large body is
parsed in a worker process (an id list past the context answered 400 from there), a stream
nobody reads is aborted on its rank (its KV blocks freed, counted as an abort) and then
dropped, and SIGTERM drains: new requests get 503 while a stream in flight ends with a
terminal event and [DONE], and the server exits cleanly (served() checks: exit code, no child
left, no traceback in its log). Its own server: the last test stops it."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from conftest import TINY_BLOCK_SIZE, descendants, scrape_series, served, wait_until

MODEL = "tiny-conn"
CONTEXT = 512  # the tiny checkpoint's


@pytest.fixture(scope="module")
def server(module_servers, tmp_path_factory):
    args = ["--model", module_servers._tiny_checkpoint(), "--block-size", str(TINY_BLOCK_SIZE),
            "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--dtype", "float32",
            "--num-kv-blocks", "64", "--served-model-name", MODEL,
            "--max-stream-backlog", "4", "--socket-send-buffer-kb", "16",
            "--write-timeout", "2", "--shutdown-timeout", "2", "--large-body-kb", "64"]
    with served("conn", args, tmp_path_factory.mktemp("conn-logs"), MODEL) as proc:
        yield proc


def _series(server, name: str, **labels: str) -> float:
    return sum(v for k, v in scrape_series(server.url, name).items()
               if labels.items() <= dict(k).items())


def _spawned(server) -> set[int]:
    """The server's processes started by multiprocessing's spawn (ranks, body workers)."""
    out = set()
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.add(pid)
        except OSError:
            pass
    return out


def test_large_bodies_are_parsed_in_a_worker_process(server):
    before = _spawned(server)
    fits = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    padded = json.dumps(fits) + " " * (80 << 10)  # past --large-body-kb, still valid
    reply = httpx.post(f"{server.base_url}/completions", content=padded, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 3
    assert _spawned(server) - before, "no worker process parsed the body"
    huge = {"model": MODEL, "prompt": [7] * 200_000}
    reply = httpx.post(f"{server.base_url}/completions", json=huge, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == (f"This model's maximum context length is {CONTEXT} tokens. "
                                "However, your prompt has 200000 tokens.")


def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(server):
    server.wait_idle()
    aborts = _series(server, "vllm:request_success_total", finished_reason="abort")
    tokens = _series(server, "vllm:generation_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": "Go on:", "max_tokens": 480,
                       "ignore_eos": True, "stream": True, "logprobs": 20}).encode()
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", server.port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        # ... and reads nothing: its events pile up past --max-stream-backlog
        wait_until(lambda: _series(server, "vllm:request_success_total",
                                   finished_reason="abort") == aborts + 1, 60,
                   "the unread stream to be aborted")
        server.wait_idle(timeout=15)  # its blocks freed while the client still holds on
        assert _series(server, "vllm:generation_tokens_total") - tokens < 480
        conn.settimeout(30)  # then --write-timeout drops the connection
        try:
            while conn.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
    assert _series(server, "deepinfer:http_connections_closed_total",
                   reason="write_timeout") >= 1


def test_sigterm_drains_and_ends_a_stream_with_a_terminal_event(server):
    events: list[str] = []
    flowing = threading.Event()

    def read() -> None:
        body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.base_url}/completions", json=body,
                          timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    flowing.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert flowing.wait(60)
    server.terminate()
    refused = wait_until(lambda: _refused(server), 5, "new requests to be refused")
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == "the server is shutting down"
    reader.join(60)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last.get("error", {}).get("code") == 503 or \
        last["choices"][0]["finish_reason"] == "length", last
    # served() then checks the exit: code 0, no process left, no traceback in the log


def _refused(server) -> httpx.Response | None:
    reply = httpx.get(f"{server.url}/health", timeout=10)
    return reply if reply.status_code == 503 else None
