"""A request's state as the scheduler sees it: token ids and how many are computed."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepinfer.core.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestTimes:
    """A request's moments on its engine's clock (time.monotonic of the rank process): they
    compare with each other, never with another process's clock."""

    arrival: float  # added to the engine
    first_scheduled: float  # first admitted into a step (a preemption does not move it)
    first_token: float  # its first output token read back
    last_token: float  # its latest output token read back


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # the engine failed this request (its batch mates went on)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # resolved against the context length
    eos_token_ids: tuple[int, ...] = ()
    use_prefix_cache: bool = True
    cache_salt: bytes = b""  # extra key mixed into the first block hash
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    block_hashes: list[bytes] = field(default_factory=list)
    num_host_pages: int = 0  # prompt pages HiCache's write-through has taken (or given up on)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Speculative decoding: the tokens the draft layer proposed to follow the last one, to be
    # verified in the next step (cleared on preemption: the recompute proposes anew).
    draft_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens sampled by a step in flight, not yet in output_token_ids (0 or
    # 1). They count in num_tokens, so the scheduler plans the next step past them.
    num_pending: int = 0
    # Of num_computed_tokens, those the step in flight computes (its results not read yet).
    num_computed_in_flight: int = 0

    def took_tokens(self, now: float) -> None:
        """Output tokens were read back at `now`."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def times(self) -> RequestTimes | None:
        """Its moments so far; None until it has a token."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return RequestTimes(self.arrival_time, self.first_scheduled_time,
                            self.first_token_time, self.last_token_time or self.first_token_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: num_tokens less those still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating prompt and output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
