"""Request bodies parsed and validated in one pass by pydantic's own JSON parser.

FastAPI's default body handling decodes the JSON with the standard library and then validates
the Python objects; for a 32K-token-id prompt that is ~4.3 ms of the event loop, against ~2.7
ms for pydantic's parser on the bytes. Errors take FastAPI's path (RequestValidationError),
so they become the same OpenAI 400 body.
"""
from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency giving the request's body as `model`."""
    async def parse(request: Request) -> M:
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])}
                      for e in exc.errors(include_url=False, include_context=False)]
            raise RequestValidationError(errors) from None
    return parse
