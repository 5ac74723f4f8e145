"""Deltas of one sample queued behind each other reach the stream as one delta (one SSE write),
equal to them in order; other samples' deltas and errors are kept for the next read. The inbox
they wait in hands items over in order, wakes its reader, and survives a cancelled read."""
from __future__ import annotations

import asyncio

from deepinfer.core.batch import TokenLogprobs
from deepinfer.serve.ranks.inbox import Inbox, coalesce
from deepinfer.serve.ranks.ipc import TokenDelta


def delta(index: int, ids: list[int], text: str, finished: bool = False) -> TokenDelta:
    return TokenDelta("r", index, ids, text, finished, "length" if finished else None, None,
                      [TokenLogprobs(t, -0.5, 1) for t in ids], 7, 3 + len(ids))


def queue_of(*items) -> Inbox:
    queue = Inbox()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_queued_deltas_of_a_sample_join_in_order() -> None:
    queue = queue_of(delta(0, [2], "b"), delta(0, [3, 4], "cd", finished=True))
    joined, held = coalesce(delta(0, [1], "a"), queue)
    assert held is None and queue.empty()
    assert joined.new_token_ids == [1, 2, 3, 4] and joined.new_text == "abcd"
    assert [lp.token_id for lp in joined.logprobs] == [1, 2, 3, 4]
    assert joined.finished and joined.finish_reason == "length" and joined.num_cached_tokens == 5


def test_another_sample_or_an_error_is_held_for_the_next_read() -> None:
    error = RuntimeError("rank died")
    queue = queue_of(delta(0, [2], "b"), delta(1, [9], "z"), delta(0, [3], "c"), error)
    joined, held = coalesce(delta(0, [1], "a"), queue)
    assert joined.new_token_ids == [1, 2] and held.index == 1
    joined, held = coalesce(held, queue)
    assert joined.new_token_ids == [9] and held.new_token_ids == [3]
    joined, held = coalesce(held, queue)
    assert joined.new_token_ids == [3] and held is error


def test_nothing_joins_past_a_finished_delta_or_an_empty_queue() -> None:
    done = delta(0, [1], "a", finished=True)
    queue = queue_of(delta(1, [5], "e"))
    assert coalesce(done, queue) == (done, None) and queue.qsize() == 1
    alone = delta(1, [5], "e")
    assert coalesce(alone, Inbox()) == (alone, None)


def test_inbox_wakes_its_reader_in_order_and_survives_a_cancelled_read() -> None:
    async def run() -> list:
        inbox = Inbox()
        reader = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        assert not reader.done()
        inbox.put_nowait("a")
        inbox.put_nowait("b")
        got = [await reader, await inbox.get()]
        cancelled = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        inbox.put_nowait("c")
        got.append(await asyncio.wait_for(inbox.get(), 1))
        try:
            inbox.get_nowait()
        except asyncio.QueueEmpty:
            got.append("empty")
        return got

    assert asyncio.run(run()) == ["a", "b", "c", "empty"]


def test_the_receiver_reads_every_waiting_step_before_a_stream_runs() -> None:
    """Steps the API process has not read yet all reach the inbox in one go, so the stream
    that fell behind joins them into one write; read one per turn of the loop, the stream
    would wake after the first and write each step on its own."""
    import os

    import zmq

    from deepinfer.serve.ranks.health import RankHealthConfig
    from deepinfer.serve.ranks.ipc import StepResult
    from deepinfer.serve.ranks.request_stream import RequestStream
    from deepinfer.serve.ranks.supervisor import RankSupervisor, output_addr

    async def run() -> tuple[int, TokenDelta]:
        client = RankSupervisor(None, 1, health=RankHealthConfig(max_restarts=0))
        RequestStream(client)  # the supervisor's requests: client.requests
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(output_addr(client._dir, 0))
        try:
            inbox = Inbox()
            client.requests._queues["r"] = inbox
            for i in range(3):
                push.send_pyobj(StepResult(0, [delta(0, [i], str(i), finished=i == 2)]))
            while not client._output.poll(0):  # delivered (ipc is asynchronous)
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            receiver = asyncio.ensure_future(client._receive())
            first = await asyncio.wait_for(inbox.get(), 5)
            waiting = inbox.qsize()  # what arrived with the first step, before this ran
            joined, _ = coalesce(first, inbox)
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
            return waiting, joined
        finally:
            push.close(linger=0)
            client._ctx.destroy(linger=0)
            for name in os.listdir(client._dir):
                os.unlink(os.path.join(client._dir, name))
            os.rmdir(client._dir)

    waiting, joined = asyncio.run(run())
    assert waiting == 2
    assert joined.new_token_ids == [0, 1, 2] and joined.new_text == "012" and joined.finished
