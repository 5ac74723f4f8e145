"""OpenAI-style error bodies; every user mistake becomes one of these, never a traceback."""
from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.err_type = err_type or _default_type(status)


def _default_type(status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    try:
        return HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:  # not a standard status, e.g. nginx's 499 (client closed the request)
        return "ClientClosedRequest" if status == 499 else "error"


def error_body(message: str, status: int = 400, param: str | None = None,
               err_type: str | None = None) -> dict:
    err = APIError(message, status, param, err_type)
    return {"error": {"message": err.message, "type": err.err_type, "param": err.param,
                      "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None,
                   err_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, err_type), status_code=status,
                        headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Summarise pydantic errors in one line, naming the first offending field."""
    parts, param = [], None
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = ".".join(loc)
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body", param


def http_error_message(exc) -> str:
    """A Starlette HTTPException in words; FastAPI's body-parsing failure names its cause."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body nests too deeply"
    if exc.status_code == 400 and cause is not None:
        return f"the request body could not be parsed: {type(cause).__name__}"
    return str(exc.detail)
