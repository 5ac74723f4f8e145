"""The FastAPI app: OpenAI routes, health, tokenizer helpers, metrics."""
from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from deepinfer.serve.api.errors import (
    APIError,
    error_response,
    http_error_message,
    validation_message,
)
from deepinfer.serve.api.guards import APIKeyMiddleware, BodyLimitMiddleware
from deepinfer.serve.api.json_body import json_body
from deepinfer.serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from deepinfer.serve.api.routes_openai import chat_completions, completions, render
from deepinfer.serve.api.shutdown import AdmissionMiddleware
from deepinfer.serve.api.state import ServerState, server_state
from deepinfer.serve.ranks.rank import RankView

State = Annotated[ServerState, Depends(server_state)]
routes = APIRouter()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None)
    app.state.server = state
    _add_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.limits.max_body_bytes)
    if state.api_key:  # outermost: an unauthenticated body is never read
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key,
                           open_paths=OPEN_PATHS | (METRICS_PATHS if state.metrics_public
                                                    else frozenset()))
    if state.drain is not None:  # outermost: a stopping server answers everyone alike
        app.add_middleware(AdmissionMiddleware, drain=state.drain)
    app.include_router(routes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status == 400:
            _count_bad_request(server_state(request))
        return error_response(exc.message, exc.status, exc.param, exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count_bad_request(server_state(request))
        message, param = validation_message(exc.errors())
        return error_response(message, 400, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own errors (unknown path, wrong method, a body that is not JSON text):
        # the OpenAI error body too, never FastAPI's {"detail": ...}.
        if exc.status_code == 400:
            _count_bad_request(server_state(request))
        if exc.status_code == 404:
            return error_response(not_found_message(request.url.path), 404)
        return error_response(http_error_message(exc), exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left while its body was read (or the body came too slowly and the
        # connection was closed): nobody reads this answer, but a handled error is not logged
        # as a crash.
        return error_response("client disconnected", 499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(f"internal error: {type(exc).__name__}", 500)


def _count_bad_request(state: ServerState) -> None:
    state.metrics.bad_requests.labels(state.model_name).inc()


@routes.post("/v1/chat/completions")
async def _chat(request: Request, state: State,
                body: ChatCompletionRequest = Depends(json_body(ChatCompletionRequest))):
    check_model(state, body.model)
    return await chat_completions(state, body, request)


@routes.post("/v1/completions")
async def _completions(request: Request, state: State,
                       body: CompletionRequest = Depends(json_body(CompletionRequest))):
    check_model(state, body.model)
    return await completions(state, body, request)


@routes.get("/v1/models")
async def _models(state: State) -> dict:
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created,
        "owned_by": "deepinfer", "root": state.model_name,
        "max_model_len": state.max_model_len}]}


@routes.get("/health")
async def _health(request: Request, state: State) -> JSONResponse:
    # Process ids only for whoever holds the key (or when there is none).
    detailed = not state.api_key or APIKeyMiddleware.authorized(request.scope, state.api_key)
    body = health_body(state.supervisor.ranks(), detailed)
    body["api_process"] = state.supervisor.client_id  # which of --api-server-count answered
    return JSONResponse(body, status_code=200 if body["live"] else 503)


@routes.post("/tokenize")
async def _tokenize(state: State,
                    body: TokenizeRequest = Depends(json_body(TokenizeRequest))) -> dict:
    check_model(state, body.model)
    return await tokenize(state, body)


@routes.post("/detokenize")
async def _detokenize(state: State,
                      body: DetokenizeRequest = Depends(json_body(DetokenizeRequest))) -> dict:
    check_model(state, body.model)
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(f"token ids must be in [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens)
    return {"prompt": text}


@routes.post("/reset_prefix_cache")
async def _reset(state: State) -> dict:
    dropped = await state.supervisor.control("reset_prefix_cache")
    return {"status": "ok", "dropped_pages": sum(int(d) for d in dropped if d is not None)}


@routes.get("/metrics")
@routes.get("/deepinfer/metrics")
async def _metrics(state: State) -> Response:
    state.metrics.observe_engine(state.supervisor.stats())
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


OPEN_PATHS = frozenset({"/health"})
METRICS_PATHS = frozenset({"/metrics", "/deepinfer/metrics"})


def health_body(ranks: list[RankView], detailed: bool = True) -> dict[str, Any]:
    """/health's JSON: "ok" when every rank serves, "degraded" when some do not (dead,
    restarting or not answering: the live ones take their sessions), "failed" when some rank
    is given up on (it died --max-rank-restarts times in a row: it needs an operator) while
    others serve, "unavailable" (HTTP 503) when none serves. `detailed` adds process ids and
    exit codes."""
    live = [r.rank for r in ranks if r.alive]
    dead = [r.rank for r in ranks if not r.alive]
    failed = [r.rank for r in ranks if r.state == "failed"]
    status = "ok" if not dead else "unavailable" if not live else \
        "failed" if failed else "degraded"
    rows = []
    for r in ranks:
        row = {"rank": r.rank, "alive": r.alive, "state": r.state, "restarts": r.restarts,
               "in_flight": r.in_flight, "load_tokens": r.load_tokens,
               "lost_requests": r.lost_requests}
        if detailed:
            row.update(pid=r.pid, exitcode=r.exitcode)
        rows.append(row)
    return {"status": status, "live": live, "dead": dead, "failed": failed, "ranks": rows}


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(f"The model `{model}` does not exist. This server serves "
                       f"`{state.model_name}`.", param="model")


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    """vLLM's /tokenize: a prompt, or messages rendered as /v1/chat/completions renders them
    (generation prompt, continued final message, tools, template variables)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt or messages")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        rendered = await render(state, body.messages, tools, None, body.add_generation_prompt,
                                body.chat_template_kwargs, body.continue_final_message)
        text, special = rendered.prompt, bool(body.add_special_tokens)
    else:
        text, special = body.prompt, body.add_special_tokens is not False
    ids = await asyncio.to_thread(state.prompt_tokenizer.encode, text, special)
    out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
           "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return out


# Endpoints of OpenAI's and vLLM's APIs that this server does not serve: a 404 that says so.
UNSUPPORTED_ENDPOINTS = (
    "/v1/embeddings", "/v1/responses", "/v1/audio", "/v1/images", "/v1/moderations",
    "/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/score", "/pooling", "/classify",
    "/v1/files", "/v1/batches", "/v1/fine_tuning", "/v1/assistants", "/v1/threads",
    "/v1/vector_stores", "/v1/uploads", "/v1/realtime", "/v1/chat/completions/",
    "/v1/conversations", "/v1/evals", "/v1/containers", "/v1/videos", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/invocations", "/v1/messages")
SERVED_ENDPOINTS = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
                    "POST /tokenize, POST /detokenize, GET /health, GET /metrics, "
                    "POST /reset_prefix_cache")


def not_found_message(path: str) -> str:
    """A 404's words: an endpoint of OpenAI's or vLLM's API this server lacks is named as
    such; any other path is just not found. Both list what the server does serve."""
    if any(path == p or path.startswith(p.rstrip("/") + "/") for p in UNSUPPORTED_ENDPOINTS):
        return (f"This server does not support the {path} endpoint. It serves "
                f"{SERVED_ENDPOINTS} (see docs/compatibility.md).")
    return f"Not found: {path[:200]}. This server serves {SERVED_ENDPOINTS}."


def now() -> int:
    return int(time.time())
