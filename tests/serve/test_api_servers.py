"""`--api-server-count 2`: two API processes on one port, each talking to both ranks of a
`--dp 2` server. Every process answers as the one-process `tiny` server does (official openai
client, greedy, streamed and not), /metrics counts the requests of both, a rank killed mid-
stream fails the requests of both processes at once and serves both again once restarted, and
the server stops with nothing left behind (served() checks)."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import TINY_BLOCK_SIZE, TINY_NUM_KV_BLOCKS, scrape, served, wait_until

PROMPTS = ("Describe item 0 of a shopping list.", "Name a colour.", "Count to three.")


@pytest.fixture(scope="module")
def api2(module_servers, tmp_path_factory):
    """The tiny checkpoint behind --dp 2 --api-server-count 2 (its own server: ranks die)."""
    ckpt = module_servers._tiny_checkpoint()
    args = ["--model", ckpt, "--block-size", str(TINY_BLOCK_SIZE), "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--dtype", "float32", "--num-kv-blocks",
            str(TINY_NUM_KV_BLOCKS), "--served-model-name", "tiny-chat", "--dp", "2",
            "--api-server-count", "2", "--rank-fail-after", "30"]
    with served("api2", args, tmp_path_factory.mktemp("api2-logs"), "tiny-chat") as proc:
        yield proc


def _per_process(url: str) -> dict[int, httpx.Client]:
    """One keep-alive connection to each API process (new connections land on either)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        conn = httpx.Client(base_url=url, timeout=60.0,
                            limits=httpx.Limits(max_connections=1))
        which = conn.get("/health").json()["api_process"]
        if which in found:
            conn.close()
        else:
            found[which] = conn
        if len(found) == 2:
            return found
    raise AssertionError(f"only API process(es) {sorted(found)} answered 200 connections")


def _fresh(url: str) -> openai.OpenAI:
    """An openai client that opens a new connection (so either process) for every request."""
    conn = httpx.Client(timeout=60.0, limits=httpx.Limits(max_keepalive_connections=0))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         http_client=conn)


def _answer(client: openai.OpenAI, prompt: str, stream: bool) -> tuple[int, str]:
    """(the API process that answered, the greedy answer)."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=12, stream=stream)
    which, reply = int(raw.headers["x-deepinfer-api-process"]), raw.parse()
    if not stream:
        return which, reply.choices[0].message.content
    return which, "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


def _on_each_process(url: str, ask) -> dict[int, object]:
    """ask(client) -> (process, result) over new connections until both processes answered."""
    client, got = _fresh(url), {}
    for _ in range(60):
        which, result = ask(client)
        got.setdefault(which, result)
        if len(got) == 2:
            return got
    raise AssertionError(f"only API process(es) {sorted(got)} answered 60 requests")


def _requests_done(url: str) -> float:
    return scrape(url).get("vllm:request_success_total", 0.0)


def test_every_process_answers_as_one_process_does(api2, client):
    for prompt in PROMPTS:
        want = _answer(client, prompt, stream=False)[1]
        for stream in (False, True):
            got = _on_each_process(api2.url, lambda c: _answer(c, prompt, stream))
            assert got == {0: want, 1: want}, (prompt, stream)


def test_metrics_count_the_requests_of_every_process(api2):
    conns = _per_process(api2.url)
    before = _requests_done(api2.url)
    client, served = _fresh(api2.url), []
    while len(served) < 6 or len(set(served)) < 2:
        served.append(_answer(client, PROMPTS[len(served) % 3], stream=True)[0])
        assert len(served) < 60, "one API process answered every request"
    for which, conn in conns.items():  # whichever process is scraped sees all of them
        text = conn.get("/metrics").text
        assert conn.get("/health").json()["api_process"] == which
        total = sum(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("vllm:request_success_total{"))
        assert total - before == len(served), which
        conn.close()
    api2.wait_idle()


def _session_on(client: openai.OpenAI, rank: int) -> dict:
    for i in range(64):
        headers = {"X-Session-Affinity": f"api2-{i}"}
        raw = client.completions.with_raw_response.create(
            model="tiny-chat", prompt="Once upon a time", max_tokens=1, extra_headers=headers)
        if int(raw.headers["x-deepinfer-rank"]) == rank:
            return headers
    raise AssertionError(f"no session went to rank {rank}")


def _long_stream_on(client: openai.OpenAI, process: int, headers: dict):
    """A long streamed completion that API process `process` serves (others are aborted)."""
    for _ in range(60):
        raw = client.completions.with_raw_response.create(
            model="tiny-chat", prompt="Once upon a time", max_tokens=400, temperature=0,
            stream=True, extra_body={"ignore_eos": True}, extra_headers=headers)
        stream = raw.parse()
        if int(raw.headers["x-deepinfer-api-process"]) == process:
            return stream
        stream.close()
    raise AssertionError(f"API process {process} answered none of 60 requests")


def _read_to_end(stream, out: dict, key: int) -> None:
    try:
        for _ in stream:
            pass
        out[key] = "finished"
    except openai.APIError as exc:
        out[key] = str(exc)


def test_a_rank_killed_mid_stream_fails_every_process_requests_then_serves_both(api2):
    client = _fresh(api2.url)
    to_zero = _session_on(client, 0)
    streams = {which: _long_stream_on(client, which, to_zero) for which in (0, 1)}
    outcome: dict = {}
    threads = [threading.Thread(target=_read_to_end, args=(s, outcome, which))
               for which, s in streams.items()]
    for t in threads:
        t.start()
    pid = httpx.get(f"{api2.url}/health", timeout=10).json()["ranks"][0]["pid"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert time.monotonic() - killed < 10
    for which in (0, 1):
        assert "engine rank 0 was killed by SIGKILL" in outcome[which], (which, outcome)
    wait_until(lambda: httpx.get(f"{api2.url}/health", timeout=10).json()["status"] == "ok",
               120, "rank 0 restarted")

    def short(c: openai.OpenAI) -> tuple[int, str]:
        raw = c.completions.with_raw_response.create(
            model="tiny-chat", prompt="Once upon a time", max_tokens=4, temperature=0,
            extra_headers=to_zero)
        assert raw.headers["x-deepinfer-rank"] == "0"
        return int(raw.headers["x-deepinfer-api-process"]), raw.parse().choices[0].finish_reason
    # The new rank process serves both API processes (on the inputs its restart named).
    assert _on_each_process(api2.url, short) == {0: "length", 1: "length"}
    api2.wait_idle()


def test_api_server_count_below_one_is_a_one_line_error(capsys) -> None:
    from deepinfer.serve.cli import main

    assert main(["--port", "0", "--accelerator", "cpu", "--api-server-count", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "deepinfer-serve: error: --api-server-count must be >= 1, got 0"


def test_a_rank_sends_each_process_its_own_results_and_everyone_the_stats() -> None:
    import zmq

    from deepinfer.serve.ranks.ipc import EngineStats, RequestError, StepResult, TokenDelta
    from deepinfer.serve.ranks.outbox import RankOutbox

    ctx = zmq.Context()
    try:
        readers = []
        for k in range(3):
            pull = ctx.socket(zmq.PULL)
            pull.bind(f"inproc://out-{k}")
            pull.setsockopt(zmq.RCVTIMEO, 2000)
            readers.append(pull)
        outbox = RankOutbox(ctx, tuple(f"inproc://out-{k}" for k in range(3)))
        outbox.admit("a", 1, num_samples=2)
        outbox.admit("b", 2, num_samples=1)
        outbox.admit("c", 1, num_samples=1)
        stats = EngineStats(1, 0, 0.5, 10, 0, 0, 0)

        def delta(rid: str, index: int, finished: bool) -> TokenDelta:
            return TokenDelta(rid, index, [7], "x", finished, None, None, [], 3, 0)
        outbox.step_result(0, [delta("a", 0, True), delta("b", 0, False)],
                           [RequestError("c", "bad")], stats)
        got = [r.recv_pyobj() for r in readers]
        assert all(isinstance(g, StepResult) and g.stats == stats for g in got)
        assert got[0].deltas == [] and got[0].errors == []
        assert [d.request_id for d in got[1].deltas] == ["a"]
        assert [e.request_id for e in got[1].errors] == ["c"]
        assert [d.request_id for d in got[2].deltas] == ["b"]
        assert outbox.num_tracked == 2  # a has a sample left, b runs; c failed
        outbox.step_result(0, [delta("a", 1, True), delta("b", 0, True)], [], stats)
        got = [r.recv_pyobj() for r in readers]
        assert [d.request_id for d in got[1].deltas] == ["a"]
        assert [d.request_id for d in got[2].deltas] == ["b"]
        assert outbox.num_tracked == 0  # nothing is remembered past a request's end
        outbox.admit("d", 2, num_samples=1)
        outbox.forget("d")  # aborted
        assert outbox.num_tracked == 0
    finally:
        ctx.destroy(linger=0)
