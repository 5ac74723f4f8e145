"""/v1/chat/completions and /v1/completions, streaming and not."""
from __future__ import annotations

import asyncio
import inspect
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.sampling import SamplingParams
from deepinfer.serve.api.errors import APIError
from deepinfer.serve.api.generation import (
    Choice,
    Generation,
    check_length,
    route_request,
    stream_generation,
    truncate_prompt,
    usage,
)
from deepinfer.serve.api.limits import RequestLimits
from deepinfer.serve.api.prompt_logprobs import after_first_token, continued, vllm_prompt_logprobs
from deepinfer.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.serve.api.sse import DONE, EventStream, event
from deepinfer.serve.api.state import ServerState
from deepinfer.serve.chat.deepseek_encoding import THINK_OPEN
from deepinfer.serve.chat.format import render_chat
from deepinfer.serve.chat.tool_parsers import (
    ForcedShape,
    OutputReader,
    ToolRequest,
    is_forced,
    named_function,
)
from deepinfer.serve.grammar.constraint_limits import check_constraint, check_tools
from deepinfer.serve.grammar.pool import GrammarUnavailable
from deepinfer.serve.grammar.structured_fields import constraint_field
from deepinfer.serve.ranks.router import Route, affinity_key

UNLIKELY_LOGPROB = -9999.0  # OpenAI's logprob for a token that is very unlikely
RANK_HEADER = "x-deepinfer-rank"  # which engine rank(s) served the request
API_PROCESS_HEADER = "x-deepinfer-api-process"  # which API process (--api-server-count) did


def _served_by(state: ServerState, routes: list[Route]) -> dict[str, str]:
    return {RANK_HEADER: ",".join(str(r.rank) for r in routes),
            API_PROCESS_HEADER: str(state.supervisor.client_id)}


class _RoutedStream(StreamingResponse):
    """A stream that releases its routes however it ends: a client gone before the first byte
    means the body is never iterated, and its rank's load would stay counted forever."""

    def __init__(self, content: AsyncIterator[str], routes: list[Route],
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _release(self.routes)


def _release(routes: list[Route]) -> None:
    for route in routes:
        route.release()


def _route_all(state: ServerState, keys: list[str], prompts: list[list[int]]) -> list[Route]:
    routes: list[Route] = []
    try:
        for key, ids in zip(keys, prompts):
            routes.append(route_request(state.requests, key, len(ids)))
    except APIError:
        _release(routes)
        raise
    return routes


def _params(state: ServerState, body: ChatCompletionRequest | CompletionRequest,
            num_prompts: int = 1) -> SamplingParams:
    _check_limits(state.limits, body, num_prompts)
    vocab = len(state.tokenizer)
    if any(t >= vocab for t in body.stop_token_ids or ()):
        raise APIError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    _check_token_fields(state.limits, body, vocab)
    try:
        return body.to_sampling_params(state.sampling_defaults)
    except ValueError as exc:
        raise APIError(str(exc)) from exc


def _check_limits(limits: RequestLimits, body: ChatCompletionRequest | CompletionRequest,
                  num_prompts: int) -> None:
    if body.n > limits.max_n:
        raise APIError(f"n must be <= {limits.max_n} on this server, got {body.n}", param="n")
    if num_prompts > limits.max_prompts:
        raise APIError(f"at most {limits.max_prompts} prompts per request on this server, got "
                       f"{num_prompts}", param="prompt")
    if max(len(body.stop_list()), len(body.stop_token_ids or ())) > limits.max_stop:
        raise APIError(f"at most {limits.max_stop} stop strings and {limits.max_stop} stop "
                       "token ids per request on this server", param="stop")


def _check_token_fields(limits: RequestLimits, body: ChatCompletionRequest | CompletionRequest,
                        vocab: int) -> None:
    """logit_bias and allowed_token_ids: token ids of this tokenizer, at most
    --max-biased-tokens of each (by default the vocabulary's size), since the sampler
    scatters every entry at every step."""
    bound = limits.max_biased_tokens or vocab
    bias = body.token_bias() or {}
    for param, ids in (("logit_bias", bias), ("allowed_token_ids", body.allowed_token_ids)):
        if not ids:
            continue
        if len(ids) > bound:
            raise APIError(f"{param} may hold at most {bound} token ids on this server, got "
                           f"{len(ids)}", param=param)
        if max(ids) >= vocab:  # the schema made them non-negative
            raise APIError(f"{param} token ids must be in [0, {vocab})", param=param)


async def _compile_constraint(state: ServerState, params: SamplingParams, param: str) -> str | None:
    """The request's constraint within the limits and compiled (a 400 otherwise, before any
    streaming): the grammar its rank loads, or None where there is none to send."""
    if params.structured is None:
        return None
    check_constraint(state.limits, params.structured, param)
    try:
        return (await state.grammars.compile(params.structured)).serialized
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc
    except GrammarUnavailable as exc:
        raise APIError(str(exc), 503) from exc


async def _until_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            raise APIError("client disconnected", status=499)
    return task.result()


# ---- chat ----------------------------------------------------------------------------------
async def render(state: ServerState, messages: list, tools: list[dict] | None = None,
                 tool_choice: Any = None, add_generation_prompt: bool = True,
                 template_kwargs: dict | None = None, continue_final: bool = False,
                 documents: list[dict] | None = None):
    """The chat rendered with the checkpoint's template; anything it rejects is a 400."""
    check_template_kwargs(state.tokenizer, template_kwargs)
    try:
        return await asyncio.to_thread(
            render_chat, state.tokenizer, state.chat_format, [m.for_template() for m in messages],
            tools, tool_choice, add_generation_prompt, template_kwargs, continue_final,
            documents)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise APIError(f"could not render the chat: {exc}", param="messages") from exc
    except Exception as exc:  # template errors (jinja raise_exception) are user errors too
        raise APIError(f"the chat template rejected the messages: {exc}",
                       param="messages") from exc


def check_template_kwargs(tokenizer: Any, kwargs: dict | None) -> None:
    """Template variables only: a key that is one of apply_chat_template's own parameters
    would let a client swap the server's template (`chat_template`: arbitrary, unbounded
    Jinja run in the API process) or change what rendering returns (`tokenize`, ...)."""
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    taken = sorted(own & set(kwargs or ()))
    if taken:
        raise APIError(f"chat_template_kwargs may only set template variables, not "
                       f"{', '.join(taken)}", param="chat_template_kwargs")


async def chat_completions(state: ServerState, body: ChatCompletionRequest, request: Request):
    params = _params(state, body)
    check_tools(state.limits, body.tools)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    if body.tool_choice not in (None, "none", "auto") and not tools:
        raise APIError("tool_choice needs tools", param="tool_choice")
    names = {t["function"]["name"] for t in tools or []}
    if hasattr(body.tool_choice, "function") and body.tool_choice.function.get("name") not in names:
        raise APIError("tool_choice names a function that is not in tools", param="tool_choice")
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "function") \
        else body.tool_choice
    parser = state.chat_format.tool_parser
    forced = bool(tools) and is_forced(choice)
    if body.continue_final_message and forced:
        raise APIError("continue_final_message cannot be combined with a forced tool call",
                       param="continue_final_message")
    rendered = await render(state, body.messages, tools, choice, body.add_generation_prompt,
                            template_variables(body), body.continue_final_message,
                            body.documents)
    # The prompt opened <think> (a thinking mode): reasoning comes first.
    thinking = rendered.prompt.endswith(THINK_OPEN)
    if forced:  # the parser's constraint makes the answer exactly a call
        if params.structured is not None:
            raise APIError(f"{constraint_field(body)} cannot be combined with a forced tool "
                           "call", param="tool_choice")
        try:
            params.structured = parser.constraint(
                tools, choice, ForcedShape(thinking, body.parallel_tool_calls))
        except ValueError as exc:
            raise APIError(str(exc), param="tool_choice") from exc
    prompt_ids = await asyncio.to_thread(state.prompt_tokenizer.encode, rendered.prompt,
                                         body.add_special_tokens)
    prompt_ids = truncate_prompt(prompt_ids, body.truncate_prompt_tokens, state.max_model_len,
                                 body.truncation_side)
    check_length(len(prompt_ids), params, state.max_model_len)  # before any compile
    grammar = await _compile_constraint(state, params,
                                        "tools" if forced else constraint_field(body))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation(prompt_ids, [Choice(i) for i in range(params.n)])
    key = affinity_key(request.headers, body.prompt_cache_key or body.user,
                       [m.model_dump(exclude_none=True) for m in body.messages])
    route = route_request(state.requests, key, len(prompt_ids))
    stream = stream_generation(state.requests, state.metrics, rid, prompt_ids, params,
                               body.uses_prefix_cache(), gen, route,
                               final_only=not body.stream, grammar=grammar)
    echo = chat_echo(body)
    use_tools = bool(tools) and body.tool_choice != "none"
    reader = parser.reader(ToolRequest(frozenset(names) if use_tools else frozenset(),
                                       rendered.forced_prefix, named_function(choice), thinking,
                                       use_tools))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chat_chunks(state, rid, gen, stream, reader, include_usage, body.logprobs)
        if echo:
            chunks = _echoed_chunks(chunks, rid, state.model_name, params.n, echo)
        return _RoutedStream(chunks, [route], _served_by(state, [route]))

    async def collect() -> None:
        async for _ in stream:
            pass

    try:
        await _until_disconnect(request, collect())
    finally:
        route.release()
    choices = [_chat_choice(state, c, reader, body.logprobs) for c in gen.choices]
    response = {"id": rid, "object": "chat.completion", "created": _now(),
                "model": state.model_name, "choices": choices, "usage": usage([gen]),
                "prompt_logprobs": _prompt_logprobs(state, gen)}
    _chat_extensions(response, gen, echo, body.return_token_ids)
    return JSONResponse(response, headers=_served_by(state, [route]))


def template_variables(body: ChatCompletionRequest) -> dict | None:
    """chat_template_kwargs, with reasoning_effort as a variable (vLLM passes it so too) unless
    the kwargs set it."""
    if body.reasoning_effort is None:
        return body.chat_template_kwargs
    return {"reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}


def chat_echo(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content, when its role is the reply's (the
    assistant's with a generation prompt, else the last message's own), leads the answer."""
    if not body.echo:
        return ""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    return last.for_template()["content"] if last.role == role else ""


def _chat_extensions(response: dict, gen: Generation, echo: str, token_ids: bool) -> None:
    """A chat response with vLLM's extensions: the echoed message, the token ids."""
    for choice, c in zip(response["choices"], gen.choices):
        if echo:
            choice["message"]["content"] = echo + (choice["message"]["content"] or "")
        if token_ids:
            choice["token_ids"] = list(c.token_ids)
    if token_ids:
        response["prompt_token_ids"] = gen.prompt_token_ids


async def _echoed_chunks(chunks: AsyncIterator[str], rid: str, model: str, n: int,
                         echo: str) -> AsyncIterator[str]:
    """A chat stream with the echoed message after each choice's role chunk (the first n)."""
    events = EventStream(rid, "chat.completion.chunk", _now(), model)
    sent = 0
    try:
        async for chunk in chunks:
            yield chunk
            sent += 1
            if sent == n:
                for index in range(n):
                    yield events.content(index, echo)
    finally:  # a client gone: the inner stream aborts its engine requests now, not at GC
        await chunks.aclose()


def _chat_choice(state: ServerState, c: Choice, reader: OutputReader | None,
                 want_logprobs: bool) -> dict:
    if reader is None:
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
    else:
        message, reason = reader.message(c.text, c.finish_reason)
    return {"index": c.index, "message": message, "finish_reason": reason,
            "logprobs": _chat_logprobs(state, c.logprobs) if want_logprobs else None}


async def _chat_chunks(state: ServerState, rid: str, gen: Generation, stream: AsyncIterator,
                       reader: OutputReader | None, include_usage: bool,
                       want_logprobs: bool) -> AsyncIterator[str]:
    events = EventStream(rid, "chat.completion.chunk", _now(), state.model_name)

    def chunk(index: int, delta: dict, reason: str | None = None, logprobs=None) -> str:
        return events.choice({"index": index, "delta": delta, "finish_reason": reason,
                              "logprobs": logprobs})

    for c in gen.choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    calls = {c.index: reader.stream() for c in gen.choices} if reader is not None else {}
    try:
        async for delta, c in stream:
            lp = _chat_logprobs(state, delta.logprobs) if want_logprobs and delta.logprobs \
                else None
            if reader is None:
                if delta.new_text:
                    yield events.content(c.index, delta.new_text, lp)
                if delta.finished:
                    yield chunk(c.index, {}, c.finish_reason)
                continue
            read = calls[c.index]
            # Logprobs of tokens that are all held-back markup still go out.
            deltas = read.deltas(delta.new_text, delta.finished, c.finish_reason) or (
                [{}] if lp else [])
            for i, d in enumerate(deltas):
                yield chunk(c.index, d, None, lp if i == 0 else None)
            if delta.finished:
                yield chunk(c.index, {}, read.finish_reason(c.finish_reason))
    except APIError as exc:
        yield _error_event(exc)
        return
    # One write for the usage chunk and [DONE]: a socket send each is most of a chunk's cost.
    yield (events.usage(usage([gen])) if include_usage else "") + DONE


def _error_event(exc: APIError) -> str:
    """A stream's end when it fails: the error, then [DONE] as after any end (clients stop
    reading at [DONE])."""
    return event({"error": {"message": exc.message, "type": exc.err_type,
                            "code": exc.status}}) + DONE


def _token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id])


def _json_logprob(logprob: float) -> float:
    """-inf (a token the model rules out) as the -9999.0 OpenAI documents: JSON has no -inf."""
    return max(logprob, UNLIKELY_LOGPROB)


def _chat_logprobs(state: ServerState, items: list[TokenLogprobs]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        text = _token_text(state, tid)
        return {"token": text, "logprob": _json_logprob(lp), "bytes": list(text.encode())}

    return {"content": [{**entry(i.token_id, i.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in _chat_top(i)]}
                        for i in items]}


def _chat_top(item: TokenLogprobs) -> list[tuple[int, float]]:
    """A chat token's top_logprobs as vLLM gives them: the first N (top_logprobs) of the
    sampled token followed by the most likely ones, the sampled token listed once. Greedy
    decoding samples the most likely token, so there this is the N most likely in order."""
    others = [(token, lp) for token, lp in item.top if token != item.token_id]
    return [(item.token_id, item.logprob), *others][:len(item.top)]


# ---- completions ---------------------------------------------------------------------------
async def completions(state: ServerState, body: CompletionRequest, request: Request):
    params = _params(state, body, len(body.prompts()))
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    prompts = []
    for p in body.prompts():
        if isinstance(p, str):
            ids = await asyncio.to_thread(state.prompt_tokenizer.encode, p,
                                          body.add_special_tokens)
        else:
            vocab = len(state.tokenizer)
            if not p or min(p) < 0 or max(p) >= vocab:  # C loops, no Python per id
                raise APIError(f"prompt token ids must be non-empty and in [0, {vocab})",
                               param="prompt")
            ids = list(p)
        ids = truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len,
                                  body.truncation_side)
        check_length(len(ids), params, state.max_model_len, param="prompt")
        prompts.append(ids)
    grammar = await _compile_constraint(state, params, constraint_field(body))
    rid = f"cmpl-{uuid.uuid4().hex}"
    gens = [Generation(ids, [Choice(i) for i in range(params.n)]) for ids in prompts]
    # Each prompt of a batch routes on its own key (headers or user pin them all together).
    sources = body.prompts()
    routes = _route_all(state, [affinity_key(request.headers, body.prompt_cache_key or body.user,
                                             None, src) for src in sources], prompts)
    streams = [stream_generation(state.requests, state.metrics, f"{rid}-{k}", ids, params,
                                 body.uses_prefix_cache(), g, route,
                                 final_only=not body.stream, grammar=grammar)
               for k, (ids, g, route) in enumerate(zip(prompts, gens, routes))]
    echo = [state.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _RoutedStream(
            _completion_chunks(state, rid, gens, streams, echo, params.n, include_usage,
                               body.logprobs is not None, body.return_token_ids, body.echo),
            routes, _served_by(state, routes))

    async def collect() -> None:
        async for _ in _merge(streams):
            pass

    try:
        await _until_disconnect(request, collect())
    finally:
        _release(routes)
    choices = []
    for k, gen in enumerate(gens):
        for c in gen.choices:
            choices.append({"index": k * params.n + c.index, "text": echo[k] + c.text,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "logprobs": _choice_logprobs(state, gen, c.logprobs, body.echo)
                            if body.logprobs is not None else None,
                            "prompt_logprobs": _prompt_logprobs(state, gen),
                            **(_token_ids(body.return_token_ids, gen.prompt_token_ids,
                                          c.token_ids) or _NO_TOKEN_IDS)})
    return JSONResponse({"id": rid, "object": "text_completion", "created": _now(),
                         "model": state.model_name, "choices": choices, "usage": usage(gens)},
                        headers=_served_by(state, routes))


# vLLM's completions choice has both keys, null unless return_token_ids asked for them.
_NO_TOKEN_IDS = {"prompt_token_ids": None, "token_ids": None}


def _token_ids(wanted: bool, prompt: list[int] | None, output: list[int]) -> dict:
    """vLLM's return_token_ids on a completions choice: the prompt's ids (None past the
    first chunk of a stream) and the output's."""
    return {"prompt_token_ids": prompt, "token_ids": list(output)} if wanted else {}


async def _completion_chunks(state: ServerState, rid: str, gens: list[Generation], streams: list,
                             echo: list[str], n: int, include_usage: bool,
                             want_logprobs: bool, want_ids: bool = False,
                             echoes_prompt: bool = False) -> AsyncIterator[str]:
    events = EventStream(rid, "text_completion", _now(), state.model_name)
    echoed: set[tuple[int, int]] = set()
    offsets: dict[tuple[int, int], int] = {}  # characters of each choice's tokens so far
    try:
        async for k, (delta, c) in _merge(streams):
            text, first = delta.new_text, (k, c.index) not in echoed
            if first:
                echoed.add((k, c.index))
                text = echo[k] + text
            logprobs = None
            if want_logprobs:
                logprobs = _choice_logprobs(state, gens[k], delta.logprobs,
                                            first and echoes_prompt)
                logprobs, offsets[k, c.index] = continued(logprobs, offsets.get((k, c.index), 0))
            yield events.text(k * n + c.index, text,
                              delta.finish_reason if delta.finished else None, logprobs,
                              _token_ids(want_ids, gens[k].prompt_token_ids if first else None,
                                         delta.new_token_ids))
    except APIError as exc:
        yield _error_event(exc)
        return
    yield (events.usage(usage(gens)) if include_usage else "") + DONE


def _completion_logprobs(state: ServerState, items: list[TokenLogprobs]) -> dict:
    tokens = [_token_text(state, i.token_id) for i in items]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [_json_logprob(i.logprob) for i in items],
            "top_logprobs": [_completion_top(state, text, i) for text, i in zip(tokens, items)],
            "text_offset": offsets}


def _choice_logprobs(state: ServerState, gen: Generation, items: list[TokenLogprobs],
                     echo: bool) -> dict:
    """A completion choice's logprobs; with echo the prompt's tokens come first (as vLLM
    lays them out)."""
    if not echo:
        return _completion_logprobs(state, items)
    return after_first_token(_token_text(state, gen.prompt_token_ids[0]),
                             _completion_logprobs(state, [*gen.prompt_logprobs[1:], *items]))


def _prompt_logprobs(state: ServerState, gen: Generation) -> list | None:
    return vllm_prompt_logprobs(gen.prompt_logprobs, lambda t: _token_text(state, t))


def _completion_top(state: ServerState, text: str, item: TokenLogprobs) -> dict[str, float]:
    """The sampled token (`text`) and the N most likely, as OpenAI's legacy completions and
    vLLM give them: up to N + 1 entries, the sampled token alone for `logprobs: 0`. Keys are
    token texts, so equal texts merge; the sampled token's own logprob stays under its text."""
    top = {text: _json_logprob(item.logprob)}
    for token, lp in item.top:
        top.setdefault(_token_text(state, token), _json_logprob(lp))
    return top


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, tagging items with the index of their source."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((k, item))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _now() -> int:
    import time

    return int(time.time())
