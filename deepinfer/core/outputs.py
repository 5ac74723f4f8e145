"""What the engine hands back after each step, per request and sample index."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.request import RequestTimes


@dataclass
class RequestOutput:
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # every output token so far
    text: str  # output text so far (cut at a stop string)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed the request (finish_reason "error")
    times: RequestTimes | None = None  # on its last output: when it arrived, ran, made tokens
