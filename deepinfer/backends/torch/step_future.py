"""What a torch backend's launch() returns (async scheduling): the step's sampled ids on the
device, for the next step's inputs, and their copy on the way to the host.

On a GPU the copy goes to pinned host memory with an event behind it, so reading the result
waits for this step only, never for the step launched after it (a plain .tolist() would sync
the whole stream). Two pinned buffers take turns: at most one step is unread while the next
one is launched.
"""
from __future__ import annotations

import torch

from deepinfer.core.batch import InputsFromLastStep, SamplerOutput
from deepinfer.core.transfer import tensor_on


class HostTokenBuffers:
    """Pinned [max_rows] int64 buffers used in turn by consecutive steps."""

    def __init__(self, max_rows: int, count: int = 2) -> None:
        self.buffers = [torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
                        for _ in range(count)]
        self.turn = 0

    def next(self, rows: int) -> torch.Tensor:
        if rows > self.buffers[0].numel():  # a bigger step than planned: grow every buffer
            self.buffers = [torch.empty(rows, dtype=torch.int64, pin_memory=True)
                            for _ in self.buffers]
        self.turn = (self.turn + 1) % len(self.buffers)
        return self.buffers[self.turn][:rows]


class DeviceTokens:
    """A launched step's sampled ids: `tokens` on the device, result() on the host."""

    def __init__(self, tokens: torch.Tensor, host: HostTokenBuffers | None = None) -> None:
        self.tokens = tokens
        self.read = False  # result() was called: the host has waited for this step's end
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda and host is not None:
            self._host = host.next(tokens.numel())
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    @property
    def event(self) -> torch.cuda.Event | None:
        """The step's end on its stream (None off the GPU)."""
        return self._event

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        self.read = True
        ids = self._host.tolist()
        return SamplerOutput(token_ids=ids, logprobs=[None] * len(ids))


def fill_from_last_step(input_ids: torch.Tensor, last: InputsFromLastStep | None) -> None:
    """Write the ids the step in flight sampled into this step's input_ids (on the device,
    in stream order: no host wait)."""
    if last is None:
        return
    index = tensor_on([last.token_indices, last.rows], input_ids.device)
    tokens = last.source.tokens[index[1]].to(input_ids.dtype)
    input_ids.index_put_((index[0],), tokens)
