"""How often a rank sends a sample's new tokens: every step, every N tokens, or at its end.

With N = 1 (the default) every step's tokens go out at once. Under heavy streaming load the
API process pays per message and per SSE event (a socket write for each stream each step), so
`--stream-interval N` lets a rank hold a sample's tokens until N have gathered (SGLang's and
vLLM's option of that name). A non-streaming request (`AddRequest.final_only`) is read by its
client only at its end, so its tokens are held until then (vLLM's FINAL_ONLY outputs). Either
way a sample's first token goes out at once (the time to first token is measured on it) and
its last step too; the text, token ids and logprobs delivered are the same, in fewer, larger
deltas, each list copied once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from deepinfer.serve.ranks.ipc import TokenDelta

DEFAULT_STREAM_INTERVAL = 1


@dataclass
class _Sample:
    started: bool = False  # its first token went out
    held: list[TokenDelta] = field(default_factory=list)
    tokens: int = 0  # in `held`


@dataclass
class _Request:
    interval: int | None  # None: hold until the sample ends
    unfinished: int  # samples not ended yet
    samples: dict[int, _Sample] = field(default_factory=dict)


class StreamPacer:
    def __init__(self, interval: int = DEFAULT_STREAM_INTERVAL) -> None:
        if interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.interval = interval
        self._requests: dict[str, _Request] = {}  # the requests whose deltas are paced

    def admit(self, request_id: str, num_samples: int, final_only: bool = False) -> None:
        """A request the rank took: pace its deltas (nothing to do at interval 1 unless it
        is final-only)."""
        if final_only or self.interval > 1:
            interval = None if final_only else self.interval
            self._requests[request_id] = _Request(interval, num_samples)

    def pace(self, deltas: Iterable[TokenDelta]) -> list[TokenDelta]:
        """The deltas to send now."""
        return [d for d in map(self._add, deltas) if d is not None]

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted or failed): nothing of it is sent any more."""
        self._requests.pop(request_id, None)

    @property
    def num_held(self) -> int:
        """Requests with paced samples (0 once every admitted request ended or was dropped)."""
        return len(self._requests)

    def _add(self, delta: TokenDelta) -> TokenDelta | None:
        request = self._requests.get(delta.request_id)
        if request is None:
            return delta
        sample = request.samples.setdefault(delta.index, _Sample())
        sample.held.append(delta)
        sample.tokens += len(delta.new_token_ids)
        if delta.finished:
            request.unfinished -= 1
            if request.unfinished == 0:
                del self._requests[delta.request_id]
        elif sample.started and (request.interval is None or sample.tokens < request.interval):
            return None
        sample.started = True
        out = TokenDelta.joined(sample.held)
        sample.held, sample.tokens = [], 0
        return out
