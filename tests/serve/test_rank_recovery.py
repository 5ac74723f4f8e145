"""A rank that dies or freezes never leaves a dead server: heartbeats, 503s, restarts.

One real `--dp 2` server with short heartbeat limits. Requests are pinned to rank 1 with a
session header whose rendezvous hash lands there. Each test measures how long the server
took to notice and to serve from the rank again, and prints it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from conftest import make_tiny_chat_checkpoint, served, wait_until

from deepinfer.serve.ranks.router import Router

UNHEALTHY_AFTER_S, FAIL_AFTER_S = 1.0, 4.0
SLACK_S = 3.0  # heartbeat interval, the watchdog's period and a busy 2-core machine


def _key_for(rank: int) -> str:
    router = Router(2)
    return next(k for k in (f"session-{i}" for i in range(100)) if router.home(k) == rank)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("ckpt")))
    with served("recovery", [
            "--model", ckpt, "--served-model-name", "tiny", "--dp", "2", "--block-size", "16",
            "--num-kv-blocks", "64", "--dtype", "float32", "--max-num-seqs", "4",
            "--rank-unhealthy-after", str(UNHEALTHY_AFTER_S), "--rank-fail-after",
            str(FAIL_AFTER_S), "--max-rank-restarts", "3"],
            tmp_path_factory.mktemp("logs"), "tiny") as proc:
        yield proc


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def _rank(server, rank: int) -> dict:
    return _health(server)["ranks"][rank]



def _chat(server, key: str, content: str = "hello", max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                      headers={"x-session-affinity": key},
                      json={"messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0})


@dataclass
class _Stream:
    first_chunk: threading.Event = field(default_factory=threading.Event)
    events: list[dict] = field(default_factory=list)
    ended: float = 0.0


def _stream(server, key: str, out: _Stream) -> None:
    body = {"messages": [{"role": "user", "content": "tell a long story"}], "stream": True,
            "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60,
                      headers={"x-session-affinity": key}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                out.events.append(json.loads(line[6:]))
                out.first_chunk.set()
    out.ended = time.monotonic()


def _wait_serving(server, rank: int, restarts: int, timeout: float = 120.0) -> dict:
    return wait_until(lambda: (r := _rank(server, rank))["state"] == "serving"
                  and r["restarts"] == restarts and r, timeout, f"rank {rank} serving again")


def test_killed_rank_is_restarted_and_serves_again(server):
    key = _key_for(1)
    before = _rank(server, 1)
    assert _chat(server, key).headers["x-deepinfer-rank"] == "1"
    killed = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    dead = wait_until(lambda: (r := _rank(server, 1))["state"] in ("dead", "starting") and r, 10,
                  "the death to show")
    assert not dead["alive"]
    reply = _chat(server, key)  # its sessions go to the live rank meanwhile
    assert reply.status_code == 200 and reply.headers["x-deepinfer-rank"] == "0"
    back = _wait_serving(server, 1, restarts=before["restarts"] + 1)
    recovered = time.monotonic() - killed
    assert back["pid"] != before["pid"]
    reply = _chat(server, key)
    assert reply.status_code == 200 and reply.headers["x-deepinfer-rank"] == "1"
    print(f"\nkilled rank: serving again after {recovered:.1f} s")


def _freeze_mid_stream(server, key: str) -> tuple[dict, _Stream, threading.Thread, float]:
    """Start a long stream on rank 1, SIGSTOP the rank once tokens flow, and wait until the
    server marks it unhealthy. The caller sends SIGCONT."""
    before = _wait_serving(server, 1, restarts=_rank(server, 1)["restarts"])
    out = _Stream()
    reader = threading.Thread(target=_stream, args=(server, key, out))
    reader.start()
    assert out.first_chunk.wait(60)
    os.kill(before["pid"], signal.SIGSTOP)
    frozen = time.monotonic()
    wait_until(lambda: _rank(server, 1)["state"] == "unhealthy", UNHEALTHY_AFTER_S + SLACK_S,
           "the frozen rank to be marked unhealthy")
    return before, out, reader, frozen


def test_frozen_rank_is_routed_around_failed_and_restarted(server):
    key = _key_for(1)
    before, out, reader, frozen = _freeze_mid_stream(server, key)
    try:
        noticed = time.monotonic() - frozen
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        reply = _chat(server, key)
        assert reply.status_code == 200 and reply.headers["x-deepinfer-rank"] == "0"
        reader.join(FAIL_AFTER_S + SLACK_S + 5)
        assert not reader.is_alive(), "the frozen rank's stream must end"
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone once it was killed
            os.kill(before["pid"], signal.SIGCONT)
    failed_after = out.ended - frozen
    assert FAIL_AFTER_S - 0.5 <= failed_after <= FAIL_AFTER_S + SLACK_S
    error = out.events[-1]["error"]
    assert error["code"] == 503 and "stopped responding" in error["message"]
    back = _wait_serving(server, 1, restarts=before["restarts"] + 1)
    assert back["pid"] != before["pid"]
    assert _chat(server, key).headers["x-deepinfer-rank"] == "1"
    print(f"\nfrozen rank: unhealthy after {noticed:.1f} s, its stream failed after "
          f"{failed_after:.1f} s, serving again after {time.monotonic() - frozen:.1f} s")


def test_rank_that_thaws_in_time_keeps_its_requests(server):
    try:
        before, out, reader, _ = _freeze_mid_stream(server, _key_for(1))
    finally:
        for pid in [r["pid"] for r in _health(server)["ranks"]]:
            os.kill(pid, signal.SIGCONT)
    wait_until(lambda: _rank(server, 1)["state"] == "serving", SLACK_S, "the rank to recover")
    reader.join(60)
    assert not any("error" in e for e in out.events)
    assert out.events[-1]["choices"][0]["finish_reason"] == "length"
    after = _rank(server, 1)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])
