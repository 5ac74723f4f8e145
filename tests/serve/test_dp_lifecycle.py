"""A `--dp 2 --routing least-loaded` server run through `deepinfer server` (serve/server.sh):
status, least-loaded balance, a rank killed mid-request, no rank left, and stop leaving no
process behind.

The first four tests share one server and run in file order: the kill tests take its ranks
one by one. The stop test starts a server of its own.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import httpx
import openai
import psutil
import pytest
from conftest import START_TIMEOUT_S, free_port, make_tiny_chat_checkpoint, openai_client, per_rank

NAME = "tiny-ll"
FAIL_WITHIN_S = 5.0  # a dead rank's requests must end this soon after the kill
# The killed rank's requests: long enough that none ends between the first streamed text and
# the kill, however fast a decode step is (the checkpoint's context and the KV pool fit four).
KILL_TOKENS, CONTEXT, KV_BLOCKS = 2000, 2048, 600


@dataclass
class ShServer:
    url: str
    env: dict
    run_dir: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def sh(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deepinfer.cli", "server", *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    @property
    def pid_file(self) -> str:
        return os.path.join(self.run_dir, "server.pid")

    @property
    def log(self) -> str:
        with open(os.path.join(self.run_dir, "server.log"), errors="replace") as f:
            return f.read()

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def rank_pids(self) -> list[int]:
        return [r["pid"] for r in self.health().json()["ranks"]]


    @property
    def leader(self) -> int:
        with open(self.pid_file) as f:
            return int(f.read())


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    return make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny-ll")), CONTEXT)


@contextlib.contextmanager
def _sh_server(run_dir: str, ckpt: str, *args: str) -> Iterator[ShServer]:
    """A `--dp 2` server started with `deepinfer server start`; whatever the test left running
    of it is stopped afterwards, and its log must hold no traceback."""
    env = dict(os.environ, DEEPINFER_RUN_DIR=run_dir, DEEPINFER_CPU_THREADS="1",
               DEEPINFER_START_TIMEOUT=str(int(START_TIMEOUT_S)), DEEPINFER_STOP_TIMEOUT="30",
               TOKENIZERS_PARALLELISM="false")
    port = free_port()
    server = ShServer(f"http://127.0.0.1:{port}", env, run_dir)
    started = server.sh("start", "--model", ckpt, "--port", str(port), "--dp", "2",
                        "--served-model-name", NAME, "--block-size", "16", "--num-kv-blocks",
                        str(KV_BLOCKS), "--dtype", "float32", *args, timeout=START_TIMEOUT_S + 60)
    assert started.returncode == 0, started.stdout + started.stderr
    leader = server.leader
    try:
        yield server
    finally:
        if os.path.exists(server.pid_file):
            server.sh("stop")
        for proc in _group(leader):  # only what this server started
            proc.kill()
    assert "Traceback (most recent call last)" not in server.log, server.log[-4000:]


@pytest.fixture(scope="module")
def ll(tmp_path_factory, tiny_ckpt) -> Iterator[ShServer]:
    # These tests freeze ranks (SIGSTOP) to hold requests in place, and check what a dead
    # rank leaves behind: no heartbeat verdicts and no restarts here (test_rank_recovery.py
    # covers those).
    with _sh_server(str(tmp_path_factory.mktemp("run")), tiny_ckpt, "--routing",
                    "least-loaded", "--max-num-seqs", "2", "--rank-unhealthy-after", "600",
                    "--rank-fail-after", "600", "--max-rank-restarts", "0") as server:
        yield server


def _group(pgid: int) -> list[psutil.Process]:
    """Live processes of process group `pgid` (zombies have exited and hold nothing)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return out


def _until(condition, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


@dataclass
class Outcome:
    rank: int | None = None
    error: Exception | None = None
    status: int | None = None  # HTTP status of a failed non-streaming request
    ended: float = 0.0
    prompt_tokens: int = 0
    chunks: list = field(default_factory=list)


def _request(server: ShServer, i: int, stream: bool, max_tokens: int, out: Outcome) -> None:
    client = openai_client(server, timeout=120.0)
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": f"Question number {i}"}],
                  max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    try:
        if stream:
            raw = client.chat.completions.with_raw_response.create(
                stream=True, stream_options={"include_usage": True}, **kwargs)
            out.rank = int(raw.headers["x-deepinfer-rank"])
            for chunk in raw.parse():
                out.chunks.append(chunk)
                if chunk.usage is not None:
                    out.prompt_tokens = chunk.usage.prompt_tokens
        else:
            raw = client.chat.completions.with_raw_response.create(**kwargs)
            out.rank = int(raw.headers["x-deepinfer-rank"])
            out.prompt_tokens = raw.parse().usage.prompt_tokens
    except openai.APIStatusError as exc:
        out.error, out.status = exc, exc.status_code
    except Exception as exc:  # noqa: BLE001 - an error event in the stream, or anything else
        out.error = exc
    finally:
        out.ended = time.monotonic()


def _launch(server: ShServer, n: int, max_tokens: int) -> tuple[list[Outcome], list]:
    """n concurrent greedy requests, alternately streaming and not."""
    outcomes = [Outcome() for _ in range(n)]
    threads = [threading.Thread(target=_request, args=(server, i, i % 2 == 0, max_tokens, o))
               for i, o in enumerate(outcomes)]
    for t in threads:
        t.start()
    return outcomes, threads


def _in_flight(server: ShServer) -> list[int]:
    """Requests the API process has routed to each rank and not seen finish."""
    return [r["in_flight"] for r in server.health().json()["ranks"]]


def _streamed_text(out: Outcome) -> bool:
    """Whether a streaming request has received generated text (not just its role chunk)."""
    return any(c.choices and c.choices[0].delta.content for c in list(out.chunks))


def test_status_names_the_process_group(ll):
    status = ll.sh("status")
    assert status.returncode == 0, status.stdout + status.stderr
    leader = ll.leader
    assert f"pid {leader}" in status.stdout and ll.url in status.stdout
    for pid in ll.rank_pids():
        assert f"\n  {pid} {leader} " in status.stdout  # a rank: in the group, child of leader
    assert '"status":"ok"' in status.stdout


def test_least_loaded_balances_concurrent_requests(ll):
    ranks = ll.rank_pids()
    # Frozen ranks finish nothing, so the split is exactly what the router decided.
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        outcomes, threads = _launch(ll, 8, max_tokens=4)

        def all_routed() -> list[int] | None:
            flight = _in_flight(ll)
            return flight if sum(flight) == 8 else None

        flight = _until(all_routed, what="8 requests in flight")
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join(timeout=120)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert len({o.prompt_tokens for o in outcomes}) == 1  # equal loads: an even split
    assert flight == [4, 4]
    assert Counter(o.rank for o in outcomes) == {0: 4, 1: 4}


def test_killing_a_rank_ends_its_requests_at_once(ll):
    rank_pids = ll.rank_pids()
    for pid in rank_pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        # Routed one at a time onto frozen ranks, least-loaded alternates 0, 1, 0, 1, ...:
        # each rank gets two streaming and two non-streaming requests.
        outcomes, threads = [], []
        for i, stream in enumerate((True, True, False, False) * 2):
            out = Outcome()
            threads.append(threading.Thread(target=_request,
                                            args=(ll, i, stream, KILL_TOKENS, out)))
            outcomes.append(out)
            threads[-1].start()
            _until(lambda: sum(_in_flight(ll)) == i + 1, what=f"request {i} routed")
        assert _in_flight(ll) == [4, 4]
        os.kill(rank_pids[1], signal.SIGCONT)
        # Kill rank 1 once its engine streams its first request's tokens: its four reached it
        # together while it was frozen (two running, two queued), and KILL_TOKENS each are far
        # from done. (Its load as the heartbeat reports it, every 0.5 s, can miss a fast
        # rank's busy spell.)
        _until(lambda: _streamed_text(outcomes[1]), what="rank 1 to stream its first request")
        killed_at = time.monotonic()
        os.kill(rank_pids[1], signal.SIGKILL)
    finally:
        for pid in rank_pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join(timeout=120)
    on_dead, on_live = outcomes[1::2], outcomes[0::2]
    assert all(o.error is None and o.rank == 0 for o in on_live), [o.error for o in on_live]
    for o in on_dead:
        assert o.error is not None and o.ended - killed_at < FAIL_WITHIN_S
        assert "engine rank 1 was killed by SIGKILL" in str(o.error)
    streamed = [o for o in on_dead if o.status is None]
    assert len(streamed) == 2 and all(o.rank == 1 and o.chunks for o in streamed)  # started
    plain = [o for o in on_dead if o.status is not None]  # an OpenAI error body with 503
    assert len(plain) == 2
    assert all(o.status == 503 and o.error.body["type"] == "ServiceUnavailable" for o in plain)
    # The live rank serves new requests, and the server says what happened.
    client = openai_client(ll)
    for i in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=NAME, messages=[{"role": "user", "content": f"after {i}"}], max_tokens=2)
        assert raw.headers["x-deepinfer-rank"] == "0"
    health = ll.health()
    body = health.json()
    # --max-rank-restarts 0: the rank is given up on at once, and /health's top status says so.
    assert health.status_code == 200 and body["status"] == "failed"
    assert body["live"] == [0] and body["dead"] == [1] and body["failed"] == [1]
    assert body["ranks"][1]["exitcode"] == -signal.SIGKILL
    assert body["ranks"][1]["lost_requests"] == 4
    assert per_rank(ll.url, "deepinfer:rank_up") == {0: 1.0, 1: 0.0}
    assert per_rank(ll.url, "deepinfer:rank_failed") == {0: 0.0, 1: 1.0}
    assert per_rank(ll.url, "deepinfer:rank_lost_requests_total") == {0: 0.0, 1: 4.0}


def test_no_live_rank_is_a_503_and_unhealthy(ll):
    os.kill(ll.rank_pids()[0], signal.SIGKILL)
    _until(lambda: ll.health().status_code == 503, timeout=10, what="/health to say 503")
    body = ll.health().json()
    assert body["status"] == "unavailable" and body["live"] == [] and body["dead"] == [0, 1]
    reply = httpx.post(f"{ll.url}/v1/chat/completions", timeout=10, json={
        "model": NAME, "messages": [{"role": "user", "content": "anyone?"}], "stream": True})
    assert reply.status_code == 503  # before any stream starts
    assert reply.json()["error"]["message"].startswith("no live engine rank")


@pytest.mark.parametrize("hung", [False, True], ids=["graceful", "hung-api-process"])
def test_server_sh_stop_leaves_no_process(tmp_path, tiny_ckpt, hung):
    with _sh_server(str(tmp_path), tiny_ckpt) as server:
        leader = server.leader
        group = {p.pid for p in _group(leader)}
        # The API process, both ranks and multiprocessing's resource tracker.
        assert {leader, *server.rank_pids()} < group
        if hung:  # SIGTERM cannot stop it: stop must SIGKILL the whole group
            os.kill(leader, signal.SIGSTOP)
            server.env["DEEPINFER_STOP_TIMEOUT"] = "2"
        stopped = server.sh("stop")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert ("killing" in stopped.stdout) == hung
        assert _group(leader) == []
        for pid in group:
            assert not psutil.pid_exists(pid) or \
                psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"pid {pid} still runs"
        assert not os.path.exists(server.pid_file)
        status = server.sh("status")
        assert status.returncode == 3 and "not running" in status.stdout
