"""Request bodies parsed and validated in one pass by pydantic's own JSON parser.

FastAPI's default body handling decodes the JSON with the standard library and then validates
the Python objects, two passes of the event loop where pydantic's parser on the bytes makes
one. Bodies of at least --large-body-kb are parsed in a worker
process instead (serve/api/body_parse.py). Errors take FastAPI's path (RequestValidationError), so
they become the same OpenAI 400 body. A parsed body is then screened for the fields it
carries that the model does not hold (serve/api/request_fields.py).
"""
from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from deepinfer.serve.api.body_parse import BodyRefused, LargeBodyParser
from deepinfer.serve.api.errors import APIError
from deepinfer.serve.api.request_fields import UnknownFields, screen

M = TypeVar("M", bound=BaseModel)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency giving the request's body as `model`, screened."""
    async def parse(request: Request) -> M:
        body = await _parsed(model, request)
        server = request.app.state.server
        screen(body, getattr(server, "unknown_fields", None) or UnknownFields())
        return body
    return parse


async def _parsed(model: type[M], request: Request) -> M:
    raw = await request.body()
    large: LargeBodyParser | None = getattr(request.app.state.server, "large_bodies", None)
    if large is not None and len(raw) >= large.threshold_bytes:
        return _accepted(await large.parse(model, raw))
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        raise _invalid(errors) from None


def _accepted(parsed: M | BodyRefused) -> M:
    if not isinstance(parsed, BodyRefused):
        return parsed
    if parsed.errors is not None:
        raise _invalid(parsed.errors)
    raise APIError(parsed.message, param=parsed.param)


def _invalid(errors: list[dict]) -> RequestValidationError:
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors])
