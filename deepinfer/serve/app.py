"""The FastAPI app: OpenAI routes, health, tokenizer helpers, metrics."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from deepinfer.serve.engine_client import EngineClient, RankView
from deepinfer.serve.errors import APIError, error_response, validation_message
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.protocol import (ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeRequest)


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    model_name: str
    model_dir: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = 0
    prompt_tokenizer: Any = None  # a VerifiedTokenizer; encode(text, add_special_tokens)
    grammars: Any = None  # a GrammarCompiler, built on the first constrained request

    def check_constraint(self, spec: Any) -> None:
        """Compile (and cache) a constraint here, so a bad one is a 400 before streaming."""
        from deepinfer.core.structured import GrammarCompiler

        if self.grammars is None:
            eos = (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
            self.grammars = GrammarCompiler(self.tokenizer, len(self.tokenizer), eos)
        self.grammars.matcher(spec)


def create_app(state: ServerState) -> FastAPI:
    from deepinfer.serve.routes_openai import chat_completions, completions

    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status == 400:
            state.metrics.bad_requests.labels(state.model_name).inc()
        return error_response(exc.message, exc.status, exc.param, exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        state.metrics.bad_requests.labels(state.model_name).inc()
        message, param = validation_message(exc.errors())
        return error_response(message, 400, param)

    if state.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=state.api_key)

    @app.post("/v1/chat/completions")
    async def _chat(body: ChatCompletionRequest, request: Request):
        check_model(state, body.model)
        return await chat_completions(state, body, request)

    @app.post("/v1/completions")
    async def _completions(body: CompletionRequest, request: Request):
        check_model(state, body.model)
        return await completions(state, body, request)

    @app.get("/v1/models")
    async def _models() -> dict:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "deepinfer", "root": state.model_dir,
            "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def _health() -> JSONResponse:
        body = health_body(state.client.ranks())
        return JSONResponse(body, status_code=200 if body["live"] else 503)

    @app.post("/tokenize")
    async def _tokenize(body: TokenizeRequest) -> dict:
        return await tokenize(state, body)

    @app.post("/detokenize")
    async def _detokenize(body: DetokenizeRequest) -> dict:
        vocab = len(state.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(f"token ids must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(state.tokenizer.decode, body.tokens)
        return {"prompt": text}

    @app.post("/reset_prefix_cache")
    async def _reset() -> dict:
        dropped = await state.client.control("reset_prefix_cache")
        return {"status": "ok", "dropped_pages": sum(int(d) for d in dropped if d is not None)}

    @app.get("/metrics")
    @app.get("/deepinfer/metrics")
    async def _metrics() -> Response:
        state.metrics.observe_engine(state.client.stats())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _APIKeyMiddleware:
    """Rejects /v1 requests without `Authorization: Bearer <key>`. Plain ASGI on purpose:
    Starlette's BaseHTTPMiddleware (@app.middleware) hides client disconnects from
    request.is_disconnected(), so abandoned non-streaming requests would keep generating."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization")
            if auth != self.expected:
                response = error_response("Incorrect API key provided.", 401, None,
                                          "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def health_body(ranks: list[RankView]) -> dict[str, Any]:
    """/health's JSON: "ok" when every rank serves, "degraded" when some died (the live ones
    take their sessions), "unavailable" (HTTP 503) when none is left."""
    live = [r.rank for r in ranks if r.alive]
    dead = [r.rank for r in ranks if not r.alive]
    status = "ok" if not dead else "degraded" if live else "unavailable"
    return {"status": status, "live": live, "dead": dead, "ranks": [
        {"rank": r.rank, "alive": r.alive, "pid": r.pid, "exitcode": r.exitcode,
         "in_flight": r.in_flight, "load_tokens": r.load_tokens,
         "lost_requests": r.lost_requests} for r in ranks]}


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(f"The model `{model}` does not exist. This server serves "
                       f"`{state.model_name}`.", param="model")


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    from deepinfer.serve.chat import render_chat

    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt or messages")
    if body.messages is not None:
        rendered = render_chat(state.tokenizer, state.model_dir,
                               [m.for_template() for m in body.messages], None, None)
        ids = await asyncio.to_thread(state.prompt_tokenizer.encode, rendered.prompt, False)
    else:
        ids = await asyncio.to_thread(state.prompt_tokenizer.encode, body.prompt,
                                      body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


def now() -> int:
    return int(time.time())
