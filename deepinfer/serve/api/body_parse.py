"""Large request bodies parsed and validated in a worker process.

pydantic parses and validates holding the GIL, so a body of millions of token ids parsed on the
event loop (or in a thread) stalls every other request and stream of the API process for the
whole parse. A body of at least --large-body-kb goes to a worker process instead (spawned on
the first such body; at most MAX_WORKERS), and comes back as the validated model. The worker
also refuses a prompt of token ids that cannot fit the model's context (the engine would refuse
it later): such a list is never sent back to be unpickled here, only its 400 is.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from deepinfer.serve.api.errors import APIError

M = TypeVar("M", bound=BaseModel)
MAX_WORKERS = 2
PARSE_TIMEOUT_S = 30.0  # a body within --max-request-body-mb parses in well under a second


@dataclass(frozen=True)
class BodyRefused:
    """Why the worker refused a body: pydantic's errors (their location and message only; an
    error's input may be the whole list) or a message and the field it names."""

    errors: list[dict[str, Any]] | None = None
    message: str = ""
    param: str | None = None


def parse_body(model: type[M], raw: bytes, max_model_len: int) -> M | BodyRefused:
    """The worker's job: `raw` validated as `model`, or why not."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        return BodyRefused([{"loc": e["loc"], "msg": e["msg"], "type": e["type"]}
                            for e in exc.errors(include_url=False, include_context=False,
                                                include_input=False)])
    longest = longest_id_prompt(body)
    if longest >= max_model_len:
        # generation.check_length's words, which the request would meet later
        return BodyRefused(message=f"This model's maximum context length is {max_model_len} "
                                   f"tokens. However, your prompt has {longest} tokens.",
                           param="prompt")
    return body


def longest_id_prompt(body: BaseModel) -> int:
    """The length of the longest prompt given as token ids (0 if none is)."""
    prompt = getattr(body, "prompt", None)
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], str):
        return 0
    if isinstance(prompt[0], int):
        return len(prompt)
    return max(len(p) for p in prompt)


class LargeBodyParser:
    """Bodies of at least `threshold_bytes`, parsed in worker processes (see the module)."""

    def __init__(self, threshold_bytes: int, max_model_len: int) -> None:
        self.threshold_bytes = threshold_bytes
        self.max_model_len = max_model_len
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, model: type[M], raw: bytes) -> M | BodyRefused:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(MAX_WORKERS, mp_context=mp.get_context("spawn"))
        pool = self._pool  # the one this parse ran in, whatever others did meanwhile
        try:
            job = pool.submit(parse_body, model, raw, self.max_model_len)
            return await asyncio.wait_for(asyncio.wrap_future(job), PARSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(f"the request body was not parsed within {PARSE_TIMEOUT_S:g} s",
                           503) from None
        except BrokenProcessPool:
            # A worker died (killed?): a new pool for the next body. Every parse in flight
            # sees the break; only the first replaces the pool, so a newer one is left alone.
            pool.shutdown(wait=False, cancel_futures=True)
            if self._pool is pool:
                self._pool = None
            raise APIError("the request body's parser failed; retry", 503) from None

    def close(self) -> None:
        """Stop the workers (a parse under way finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
