"""How a rank paces a sample's tokens: with --stream-interval N, N at a time after its first
one and its end at once; for a non-streaming request, its first token and then the rest at
its end. Unit checks of the pacer, the rank loop with a fake engine, the server through the
official openai client (the same text and logprobs as with interval 1, in fewer chunks; the
ITL histogram still counting tokens), and the one-line CLI error."""
from __future__ import annotations

import itertools
import os
import threading

import openai
import pytest
import zmq
from conftest import make_tiny_chat_checkpoint, scrape, served

from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.api import generation
from deepinfer.serve.api.generation import Choice, Generation
from deepinfer.serve.ranks.engine_proc import _loop
from deepinfer.serve.ranks.ipc import (
    AbortRequest,
    AddRequest,
    Control,
    ControlReply,
    StepResult,
    TokenDelta,
)
from deepinfer.serve.ranks.stream_pacing import StreamPacer
from tests.serve.rank_wires import PagedFakeAccelerator, fake_config, rank_wires


def delta(rid: str, token: int, index: int = 0, finished: bool = False) -> TokenDelta:
    return TokenDelta(rid, index, [token], f"<{token}>", finished,
                      "length" if finished else None, None, [TokenLogprobs(token, -1.0, 1)],
                      5, 0)


def sizes(sent: list[TokenDelta]) -> list[int]:
    return [len(d.new_token_ids) for d in sent]


def test_first_token_at_once_then_every_n_and_the_end_at_once() -> None:
    pacer, sent = StreamPacer(3), []
    pacer.admit("r", 1)
    for t in range(1, 9):
        sent += pacer.pace([delta("r", t, finished=t == 8)])
    assert sizes(sent) == [1, 3, 3, 1]
    assert [t for d in sent for t in d.new_token_ids] == list(range(1, 9))
    assert "".join(d.new_text for d in sent) == "".join(f"<{t}>" for t in range(1, 9))
    assert [lp.token_id for d in sent for lp in d.logprobs] == list(range(1, 9))
    assert sent[-1].finished and pacer.num_held == 0


def test_final_only_sends_the_first_token_then_the_rest_at_the_end() -> None:
    pacer, sent = StreamPacer(1), []
    pacer.admit("r", 1, final_only=True)
    pacer.admit("s", 1)  # streamed at interval 1: not paced at all
    for t in range(1, 7):
        sent += pacer.pace([delta("r", t, finished=t == 6), delta("s", 10 + t)])
    assert [(d.request_id, len(d.new_token_ids)) for d in sent if d.request_id == "r"] == \
        [("r", 1), ("r", 5)]
    assert sum(d.request_id == "s" for d in sent) == 6 and pacer.num_held == 0


def test_samples_pace_apart_and_a_dropped_request_leaves_nothing_held() -> None:
    pacer = StreamPacer(2)
    pacer.admit("r", 2)
    pacer.admit("q", 1)
    first = pacer.pace([delta("r", 1, 0), delta("r", 2, 1), delta("q", 3)])
    assert [(d.request_id, d.index) for d in first] == [("r", 0), ("r", 1), ("q", 0)]
    assert pacer.pace([delta("r", 4, 0), delta("q", 5)]) == []
    sent = pacer.pace([delta("r", 6, 0), delta("r", 7, 1, finished=True)])
    assert [(d.index, d.new_token_ids) for d in sent] == [(0, [4, 6]), (1, [7])]
    assert pacer.num_held == 2  # r's sample 0 and q go on
    pacer.drop("q")
    assert pacer.pace([delta("r", 8, 0, finished=True)])[0].new_token_ids == [8]
    assert pacer.num_held == 0
    assert pacer.pace([delta("q", 9)]) == [delta("q", 9)]  # not admitted: passed through
    with pytest.raises(ValueError):
        StreamPacer(0)


def test_rank_loop_sends_paced_deltas_and_forgets_an_aborted_request(tmp_path) -> None:
    engine = Engine(fake_config(tmp_path, 256), PagedFakeAccelerator(), load_tokenizer=False)
    wires = rank_wires("paced")
    ctx, to_rank, from_rank = wires.ctx, wires.to_rank, wires.from_rank
    pacer = StreamPacer(4)
    loop = threading.Thread(target=_loop, args=(engine, 0, wires.rank_in, wires.rank_out,
                                                os.getppid()), kwargs={"pacer": pacer})
    loop.start()
    try:
        ten = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        to_rank.send_pyobj(AddRequest("r", list(range(1, 20)), ten))
        got = _deltas_until(from_rank, "r", lambda d: d.finished)
        assert sizes(got) == [1, 4, 4, 1] and got[-1].finished
        to_rank.send_pyobj(AddRequest("f", list(range(1, 20)), ten, final_only=True))
        reports: list[StepResult] = []
        got = _deltas_until(from_rank, "f", lambda d: d.finished, reports)
        assert sizes(got) == [1, 9]
        # The steps whose tokens were held still reported the rank's stats.
        assert sum(not r.deltas and r.stats.running == 1 for r in reports) >= 8
        long = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
        to_rank.send_pyobj(AddRequest("a", list(range(1, 20)), long))
        _deltas_until(from_rank, "a", lambda d: True)  # its first token
        to_rank.send_pyobj(AbortRequest("a"))
        to_rank.send_pyobj(Control("stats", 7))  # answered after the abort was handled
        while not isinstance(from_rank.recv_pyobj(), ControlReply):
            pass
        assert pacer.num_held == 0
    finally:
        to_rank.send_pyobj(Control("shutdown", 1))
        loop.join(timeout=30)
        ctx.destroy(linger=0)
    assert not loop.is_alive()
    assert engine.kv.num_request_blocks() == 0


def _deltas_until(sock: zmq.Socket, rid: str, done,
                  reports: list[StepResult] | None = None) -> list[TokenDelta]:
    """`rid`'s deltas until `done` says so (every StepResult read into `reports`)."""
    out = []
    while True:
        message = sock.recv_pyobj()
        if isinstance(message, StepResult):
            if reports is not None:
                reports.append(message)
            for d in message.deltas:
                if d.request_id == rid:
                    out.append(d)
                    if done(d):
                        return out


@pytest.fixture(scope="module")
def paced_server(tmp_path_factory):
    ckpt = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("ckpt")))
    with served("paced", [
            "--model", ckpt, "--served-model-name", "tiny", "--block-size", "16",
            "--num-kv-blocks", "64", "--dtype", "float32", "--max-num-seqs", "4",
            "--stream-interval", "4"], tmp_path_factory.mktemp("logs"), "tiny") as proc:
        yield proc


def test_openai_client_streams_the_same_completion_in_chunks_of_four(paced_server) -> None:
    client = openai.OpenAI(base_url=paced_server.base_url, api_key="none")
    args = dict(model="tiny", prompt="one two three", max_tokens=10, temperature=0,
                logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]  # its rank sends 1 + 9 tokens
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args)
              if c.choices]
    tokens = [len(c.logprobs.tokens) for c in chunks if c.logprobs and c.logprobs.tokens]
    # The rank sends 1, 4, 4, 1; deltas that queue up behind a busy API process are joined into
    # one write (tests/serve/test_delta_coalescing.py), so a chunk may hold several of them,
    # but no chunk ends inside a paced group and the first token is never held back.
    ends = set(itertools.accumulate(tokens))
    assert tokens[0] == 1 and ends <= {1, 5, 9, 10} and 10 in ends
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert chunks[-1].finish_reason == "length"
    # The ITL histogram counts tokens, not chunks: 9 gaps for each 10-token completion.
    assert scrape(paced_server.url)["vllm:inter_token_latency_seconds_count"] == 18


def test_a_delta_of_n_tokens_spreads_its_wait_over_n_gaps(monkeypatch) -> None:
    clock = iter([1.0, 5.0, 5.0, 6.0])
    monkeypatch.setattr(generation.time, "monotonic", lambda: next(clock))
    gen = Generation([1, 2], [Choice(0)])
    gen.apply(delta("r", 1))  # the first token at t = 1
    gen.apply(TokenDelta("r", 0, [2, 3, 4, 5], "", False, None, None, [], 2, 0))  # t = 5
    gen.apply(TokenDelta("r", 0, [], "", False, None, None, [], 2, 0))  # no token: no gap
    gen.apply(delta("r", 6, finished=True))  # t = 6
    assert gen.first_token == 1.0 and gen.itls == [1.0, 1.0, 1.0, 1.0, 1.0]


def test_stream_interval_below_one_is_a_one_line_error(capsys) -> None:
    from deepinfer.serve.cli import main

    assert main(["--port", "0", "--accelerator", "cpu", "--stream-interval", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "deepinfer-serve: error: --stream-interval must be >= 1, got 0"
