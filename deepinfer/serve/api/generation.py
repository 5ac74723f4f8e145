"""Running one engine request for the API: collect deltas, time them, and check limits."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.request import RequestTimes
from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.api.errors import APIError
from deepinfer.serve.metrics.server import Phases, ServerMetrics
from deepinfer.serve.ranks.inbox import RequestAborted
from deepinfer.serve.ranks.ipc import TokenDelta
from deepinfer.serve.ranks.rank import EngineRequestError, RankDiedError
from deepinfer.serve.ranks.request_stream import RequestStream
from deepinfer.serve.ranks.router import NoLiveRankError, Route


@dataclass
class Choice:
    index: int
    # The text as its deltas brought it, joined when read: `text += piece` on an attribute
    # copies the whole text each token (quadratic in a long answer).
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    times: RequestTimes | None = None  # from the rank, once it finished the sample

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


@dataclass
class Generation:
    """All samples of one prompt, filled in as deltas arrive."""

    prompt_token_ids: list[int]
    choices: list[Choice]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: the prompt's entries (None first), from the first delta
    # that brings them (every sample scores the same prompt).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    itls: list[float] = field(default_factory=list)

    def apply(self, delta: TokenDelta) -> Choice:
        self._time_tokens(time.monotonic(), len(delta.new_token_ids))
        choice = self.choices[delta.index]
        if delta.new_text:
            choice.pieces.append(delta.new_text)
        choice.token_ids.extend(delta.new_token_ids)
        choice.logprobs.extend(delta.logprobs)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            choice.times = delta.times
        self.num_cached_tokens = delta.num_cached_tokens
        return choice

    def _time_tokens(self, now: float, n: int) -> None:
        """Inter-token gaps, one per token after the first: a delta of n tokens (paced by
        --stream-interval, or joined where the API fell behind) spreads the wait since the
        last token over its n tokens, so the ITL histogram counts tokens, not deltas."""
        if self.first_token is None:
            self.first_token = self.last_token = now
            self.itls.extend([0.0] * max(0, n - 1))  # tokens that came with the first
        elif n:
            self.itls.extend([(now - self.last_token) / n] * n)
            self.last_token = now

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def phases(self) -> Phases | None:
        """Where the generation's time went on its rank, all n samples together (they share
        the arrival and rank clock): None unless the rank finished every sample."""
        times = [c.times for c in self.choices]
        if not times or any(t is None for t in times):
            return None
        scheduled = min(t.first_scheduled for t in times)
        first = min(t.first_token for t in times)
        last = max(t.last_token for t in times)
        return Phases(queue=scheduled - times[0].arrival, prefill=first - scheduled,
                      decode=last - first, inference=last - scheduled)


def route_request(requests: RequestStream, route_key: str, prompt_tokens: int) -> Route:
    """Route before any response starts, so no live rank is a plain 503 (and the rank can be
    named in a response header). The caller releases the route on every path."""
    try:
        return requests.route(route_key, prompt_tokens)
    except NoLiveRankError as exc:
        raise APIError(str(exc), status=503) from exc


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int,
                    side: str | None = None, param: str = "truncate_prompt_tokens"
                    ) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the
    context holds), or its first with `side` "right"; more than the context is a 400."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1 or keep > max_model_len:
        raise APIError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the "
                       f"context length), got {keep}", param=param)
    return ids[:keep] if side == "right" else ids[-keep:]


def check_length(prompt_len: int, params: SamplingParams, limit: int,
                 param: str = "messages") -> None:
    if prompt_len >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                       f"your prompt has {prompt_len} tokens.", param=param)
    if params.max_tokens is not None and prompt_len + params.max_tokens > limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, you "
                       f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in "
                       f"the prompt, {params.max_tokens} for the completion). Please reduce "
                       "the prompt or max_tokens.", param="max_tokens")


async def stream_generation(requests: RequestStream, metrics: ServerMetrics, request_id: str,
                            prompt_ids: list[int], params: SamplingParams, prefix_cache: bool,
                            gen: Generation, route: Route, final_only: bool = False,
                            grammar: str | None = None
                            ) -> AsyncIterator[tuple[TokenDelta, Choice]]:
    """Yield (delta, its choice) from the routed rank; record metrics once the whole
    generation is over, or as it is aborted: by the server (RequestAborted) or by its client
    leaving (the consumer closes or cancels this generator). A rank that dies ends it with a
    503; requests that fail are not recorded. `final_only`: a non-streaming response;
    `grammar`: the constraint compiled (RequestStream.generate)."""
    try:
        async for delta in requests.generate(request_id, prompt_ids, params, prefix_cache,
                                             route=route, final_only=final_only,
                                             grammar=grammar):
            yield delta, gen.apply(delta)
    except EngineRequestError as exc:
        raise APIError(str(exc), status=exc.status) from exc
    except RankDiedError as exc:
        raise APIError(str(exc), status=503) from exc
    except RequestAborted as exc:
        _observe(metrics, gen, params, route.rank)
        raise APIError(str(exc), status=exc.status) from exc
    except (GeneratorExit, asyncio.CancelledError):
        _observe(metrics, gen, params, route.rank)
        raise
    _observe(metrics, gen, params, route.rank)


def _observe(metrics: ServerMetrics, gen: Generation, params: SamplingParams,
             rank: int) -> None:
    """Record a generation that ended: "abort" if any sample had no end of its own."""
    ended = all(c.finish_reason is not None for c in gen.choices)
    metrics.observe_request(gen.choices[0].finish_reason if ended else "abort",
                            len(gen.prompt_token_ids), gen.num_output_tokens,
                            None if gen.first_token is None else gen.first_token - gen.start,
                            gen.itls, time.monotonic() - gen.start, engine=rank, n=params.n,
                            max_tokens=params.max_tokens, phases=gen.phases())


def usage(gens: list[Generation]) -> dict[str, Any]:
    prompt = sum(len(g.prompt_token_ids) for g in gens)
    completion = sum(g.num_output_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.num_cached_tokens for g in gens)}}
