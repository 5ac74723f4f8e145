"""How often a rank sends a sample's new tokens: every step, or every N tokens.

With N = 1 (the default) every step's tokens go out at once. Under heavy streaming load the
API process pays per message and per SSE event (a socket write for each stream each step), so
`--stream-interval N` lets a rank hold a sample's tokens until N have gathered (SGLang's and
vLLM's option of that name): the first token of a sample and its last step always go out at
once, so time to first token and the end of a stream are not delayed; the text, token ids and
logprobs a client receives are the same, in fewer, larger chunks.
"""
from __future__ import annotations

from typing import Iterable

from deepinfer.serve.ipc import TokenDelta

DEFAULT_STREAM_INTERVAL = 1


class StreamPacer:
    def __init__(self, interval: int = DEFAULT_STREAM_INTERVAL) -> None:
        if interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.interval = interval
        self._held: dict[tuple[str, int], TokenDelta] = {}  # (request, sample) -> not sent
        self._started: set[tuple[str, int]] = set()  # samples whose first token went out

    def pace(self, deltas: Iterable[TokenDelta]) -> list[TokenDelta]:
        """The deltas to send now: each sample's held tokens joined with its new ones once
        they reach the interval, at its first token, or at its end."""
        if self.interval == 1:
            return list(deltas)
        return [d for d in map(self._add, deltas) if d is not None]

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted or failed): nothing of it is sent any more."""
        for key in [k for k in (*self._held, *self._started) if k[0] == request_id]:
            self._held.pop(key, None)
            self._started.discard(key)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _add(self, delta: TokenDelta) -> TokenDelta | None:
        key = (delta.request_id, delta.index)
        held = self._held.pop(key, None)
        if held is not None:
            delta = held.then(delta)
        if delta.finished:
            self._started.discard(key)
            return delta
        if key not in self._started:
            self._started.add(key)
            return delta
        if len(delta.new_token_ids) >= self.interval:
            return delta
        self._held[key] = delta
        return None
