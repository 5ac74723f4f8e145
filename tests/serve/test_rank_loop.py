"""The rank process loop admits requests between any two steps: a request that arrives while
another one decodes is in the very next step's batch, not after the other one finishes."""
from __future__ import annotations

import os
import threading

import zmq

from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.ranks.engine_proc import _loop
from deepinfer.serve.ranks.ipc import AbortRequest, AddRequest, Control, ControlReply, StepResult
from tests.serve.rank_wires import PagedFakeAccelerator, fake_config, rank_wires

LONG = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)


class _SteppedEngine(Engine):
    """Takes a step only when the test releases one, so the test knows which step is which."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Semaphore(0)  # the loop has drained its inbox, is in step()
        self.gate = threading.Semaphore(0)

    def step(self):
        self.entered.release()
        self.gate.acquire()
        return super().step()

    def wait_entered(self) -> None:
        # A loop that died never enters: fail in seconds rather than hang.
        assert self.entered.acquire(timeout=30), "the rank loop stopped stepping"

    def run_one(self, outbox: zmq.Socket) -> list[str]:
        """Let the step the loop waits in run; the ids it produced tokens for."""
        self.wait_entered()
        self.gate.release()
        return [d.request_id for d in _results(outbox).deltas]


def _results(outbox: zmq.Socket) -> StepResult:
    while True:
        message = outbox.recv_pyobj()
        if isinstance(message, StepResult) and message.deltas:
            return message


def test_request_sent_mid_decode_starts_in_the_next_step(tmp_path):
    engine = _SteppedEngine(fake_config(tmp_path, 512), PagedFakeAccelerator(),
                            load_tokenizer=False)
    wires = rank_wires("mid-decode")
    ctx, to_rank, from_rank = wires.ctx, wires.to_rank, wires.from_rank
    loop = threading.Thread(target=_loop, args=(engine, 0, wires.rank_in, wires.rank_out,
                                                os.getppid()))
    loop.start()
    try:
        to_rank.send_pyobj(AddRequest("busy", list(range(1, 40)), LONG))
        for _ in range(3):  # "busy" is decoding, one token per step
            assert engine.run_one(from_rank) == ["busy"]
        # The loop has drained its inbox and waits inside the next step: "new" arrives
        # during that step, so the step after it must carry its first token.
        engine.wait_entered()
        to_rank.send_pyobj(AddRequest("new", list(range(1, 30)), LONG))
        engine.entered.release()
        assert engine.run_one(from_rank) == ["busy"]
        # Its whole prefill and first token, beside the decode that did not pause for it.
        assert engine.run_one(from_rank) == ["busy", "new"]
    finally:
        to_rank.send_pyobj(AbortRequest("busy"))
        to_rank.send_pyobj(AbortRequest("new"))
        to_rank.send_pyobj(Control("shutdown", 1))
        engine.gate.release()  # the step it may be waiting in
        loop.join(timeout=30)
        while not isinstance(from_rank.recv_pyobj(), ControlReply):
            pass
        ctx.destroy(linger=0)
    assert not loop.is_alive()
    assert engine.kv.num_request_blocks() == 0
