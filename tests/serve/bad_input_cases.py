"""The hostile requests of test_bad_input.py: body builders and the table of cases, each
with the status it must get."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conftest import API_KEY, TINY_CONTEXT

MODEL = "tiny-chat"
VOCAB = 49152  # len(tokenizer) of the tiny checkpoint (SmolLM2's tokenizer)
REQUEST_TIMEOUT_S = 30.0  # longer than this is a hang: the tiny model answers in milliseconds
BODY_LIMIT = 1 << 20  # conftest starts the tiny servers with --max-request-body-mb 1
CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = ("/v1/chat/completions", "/v1/completions",
                                          "/tokenize", "/detokenize")
JSON_HEADERS = {"content-type": "application/json"}
HI = [{"role": "user", "content": "Hi"}]
LONE_SURROGATE = "a\ud800b"  # json.dumps (ensure_ascii) sends it as the escape "a\ud800b"
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", "properties": {}}}}

# The known-good request: greedy, fixed prompt, always 8 tokens (ignore_eos); logprobs=0 gives
# the sampled tokens one by one, so a change in any token shows.
BASELINE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}


# ---- building bodies -------------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is: `Infinity`, `NaN`, `1e999` are not standard JSON,
    but Python's JSON reader (the server's) accepts them."""
    text: str


def encode(value: Any) -> bytes:
    """A JSON body with Raw values spliced in. ensure_ascii (json.dumps' default) writes a lone
    surrogate as its escape, which is exactly what a hostile client sends."""
    raws: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@raw{len(raws) - 1}@"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@raw{i}@"', raw)
    return text.encode()


def chat(**fields: Any) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


def user(content: Any, **fields: Any) -> list[dict]:
    return [{"role": "user", "content": content, **fields}]


def assistant_calls(tool_calls: Any) -> list[dict]:
    return HI + [{"role": "assistant", "content": "", "tool_calls": tool_calls}]


def schema_format(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def nested_dict(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def deep_dict_text(depth: int) -> Raw:
    """Nesting as JSON text: deeper than Python's own encoder recursion would go."""
    return Raw('{"a":' * depth + "{}" + "}" * depth)


@dataclass(frozen=True)
class Chunked:
    """A body sent with chunked transfer encoding (no Content-Length): `size` bytes of a JSON
    prompt, so only counting the bytes read can stop it."""
    size: int

    def chunks(self) -> Iterator[bytes]:
        yield b'{"prompt": "'
        sent = 0
        while sent < self.size:
            yield b"x" * 65536
            sent += 65536
        yield b'"}'


# ---- the table of hostile cases --------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: Any = None  # a JSON value (Raw inside allowed), bytes sent as they are, or Chunked
    method: str = "POST"
    status: int = 400
    headers: tuple[tuple[str, str], ...] = ()  # extra headers (the API key cases)
    param: str | None = None  # the field the error body must name, where the case checks it

    def request_kwargs(self) -> dict:
        headers = dict(self.headers)
        if self.body is None:
            return {"headers": headers}
        headers.update(JSON_HEADERS)
        if isinstance(self.body, Chunked):
            return {"headers": headers, "content": self.body.chunks()}
        content = self.body if isinstance(self.body, bytes) else encode(self.body)
        return {"headers": headers, "content": content}


def _chat_cases() -> list[Case]:
    cases = {
        # wrong types
        "n-word": chat(n="two"),
        "n-list": chat(n=[2]),
        "n-fraction": chat(n=1.5),
        "n-null": chat(n=None),
        "temperature-list": chat(temperature=[1]),
        "temperature-word": chat(temperature="hot"),
        "temperature-object": chat(temperature={"value": 1}),
        "messages-object": chat(messages={"role": "user", "content": "Hi"}),
        "messages-string": chat(messages="Hi"),
        "messages-null": chat(messages=None),
        "messages-missing": without(chat(), "messages"),
        "messages-empty": chat(messages=[]),
        "message-int": chat(messages=[5]),
        "message-without-role": chat(messages=[{"content": "Hi"}]),
        "message-bad-role": chat(messages=[{"role": "wizard", "content": "Hi"}]),
        "message-content-int": chat(messages=user(5)),
        "message-name-int": chat(messages=user("Hi", name=5)),
        "content-image-url": chat(messages=user([
            {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}])),
        "content-input-audio": chat(messages=user([
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])),
        "content-text-part-without-text": chat(messages=user([{"type": "text"}])),
        "content-text-part-int": chat(messages=user([{"type": "text", "text": 5}])),
        "content-part-without-type": chat(messages=user([{"text": "Hi"}])),
        "tool-calls-string": chat(messages=assistant_calls("call it")),
        "tool-calls-int-item": chat(messages=assistant_calls([5])),
        "tool-call-function-int": chat(messages=assistant_calls([{"function": 5}])),
        "stream-word": chat(stream="maybe"),
        "stream-options-string": chat(stream=True, stream_options="yes"),
        "stream-options-bad-flag": chat(stream=True, stream_options={"include_usage": "maybe"}),
        "user-int": chat(user=5),
        "logprobs-list": chat(logprobs=[1]),
        "chat-template-kwargs-string": chat(chat_template_kwargs="x"),
        # a keyword the server passes itself: the template call must fail as a 400
        "chat-template-kwargs-tokenize": chat(chat_template_kwargs={"tokenize": True}),
        # out of range numbers (Raw: the non-standard JSON numbers Python still reads)
        "n-zero": chat(n=0),
        "n-negative": chat(n=-1),
        "n-over-max-n": chat(n=17),
        "n-int32-overflow": chat(n=2**31),
        "n-1e10": chat(n=1e10),
        "temperature-negative": chat(temperature=-0.5),
        "temperature-infinity": chat(temperature=Raw("Infinity")),
        "temperature-minus-infinity": chat(temperature=Raw("-Infinity")),
        "temperature-nan": chat(temperature=Raw("NaN")),
        "temperature-1e999": chat(temperature=Raw("1e999")),
        "top-p-zero": chat(top_p=0),
        "top-p-above-one": chat(top_p=1.5),
        "top-p-negative": chat(top_p=-0.1),
        "top-p-nan": chat(top_p=Raw("NaN")),
        "top-k-minus-two": chat(top_k=-2),
        "top-k-int32-overflow": chat(top_k=2**31),
        "top-k-int64-overflow": chat(top_k=Raw("9223372036854775808")),
        "top-k-fraction": chat(top_k=1.5),
        "min-p-negative": chat(min_p=-0.1),
        "min-p-above-one": chat(min_p=1.1),
        "min-p-infinity": chat(min_p=Raw("Infinity")),
        "presence-penalty-above": chat(presence_penalty=2.5),
        "presence-penalty-below": chat(presence_penalty=-2.5),
        "presence-penalty-minus-infinity": chat(presence_penalty=Raw("-Infinity")),
        "frequency-penalty-above": chat(frequency_penalty=2.01),
        "frequency-penalty-below": chat(frequency_penalty=-3),
        "frequency-penalty-nan": chat(frequency_penalty=Raw("NaN")),
        "repetition-penalty-zero": chat(repetition_penalty=0),
        "repetition-penalty-1e-300": chat(repetition_penalty=1e-300),
        "repetition-penalty-below-min": chat(repetition_penalty=0.001),
        "repetition-penalty-above-max": chat(repetition_penalty=2.5),
        "repetition-penalty-infinity": chat(repetition_penalty=Raw("Infinity")),
        "repetition-penalty-negative": chat(repetition_penalty=-1),
        "max-tokens-zero": chat(max_tokens=0),
        "max-tokens-negative": chat(max_tokens=-1),
        "max-tokens-fraction": chat(max_tokens=2.5),
        "max-tokens-int32-overflow": chat(max_tokens=2**31),
        "max-tokens-int64-overflow": chat(max_tokens=2**63),
        "max-tokens-1e999": chat(max_tokens=Raw("1e999")),
        "max-tokens-beyond-context": chat(max_tokens=100_000),
        # the rendered "Hi" chat is ~30 tokens: with 511 more it passes the 512-token context
        "max-tokens-fills-context": chat(max_tokens=TINY_CONTEXT - 1),
        "max-completion-tokens-zero": chat(max_completion_tokens=0),
        "max-completion-tokens-negative": chat(max_completion_tokens=-3),
        "min-tokens-above-max-tokens": chat(min_tokens=5, max_tokens=2),
        "min-tokens-negative": chat(min_tokens=-1),
        "seed-int64-overflow": chat(seed=2**63),
        "seed-int64-underflow": chat(seed=-2**63 - 1),
        "seed-word": chat(seed="x"),
        "seed-fraction": chat(seed=0.5),
        "seed-infinity": chat(seed=Raw("Infinity")),
        "top-logprobs-21": chat(logprobs=True, top_logprobs=21),
        "top-logprobs-negative": chat(logprobs=True, top_logprobs=-1),
        "stop-token-ids-negative": chat(stop_token_ids=[-1]),
        "stop-token-ids-int32-overflow": chat(stop_token_ids=[2**31]),
        "stop-token-ids-beyond-vocab": chat(stop_token_ids=[VOCAB]),
        "stop-token-ids-over-max-stop": chat(stop_token_ids=list(range(17))),
        "stop-token-ids-string": chat(stop_token_ids="x"),
        "logit-bias-beyond-vocab": chat(logit_bias={str(VOCAB): 1}),
        "logit-bias-key-int64-overflow": chat(logit_bias={str(2**63): 1}),
        "logit-bias-infinity": chat(logit_bias={"5": Raw("Infinity")}),
        "logit-bias-nan": chat(logit_bias={"5": Raw("NaN")}),
        "logit-bias-list": chat(logit_bias=[5]),
        "allowed-token-ids-beyond-vocab": chat(allowed_token_ids=[1, VOCAB]),
        "allowed-token-ids-empty": chat(allowed_token_ids=[]),
        "allowed-token-ids-string": chat(allowed_token_ids="5"),
        "stop-over-max-stop": chat(stop=[f"s{i}" for i in range(17)]),
        "stop-empty-string": chat(stop=""),
        "stop-empty-item": chat(stop=["ok", ""]),
        "stop-int": chat(stop=5),
        "stop-list-of-ints": chat(stop=[1, 2]),
        # model
        "model-unknown": chat(model="gpt-9"),
        "model-int": chat(model=5),
        # tools
        "tool-choice-required-without-tools": chat(tool_choice="required"),
        "tool-choice-named-without-tools": chat(
            tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "tool-choice-missing-function": chat(
            tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool-choice-nameless": chat(tools=[TOOL],
                                     tool_choice={"type": "function", "function": {}}),
        "tool-choice-word": chat(tools=[TOOL], tool_choice="sometimes"),
        "tool-choice-name-int": chat(
            tools=[TOOL], tool_choice={"type": "function", "function": {"name": 5}}),
        "tool-name-with-spaces": chat(tools=[{"type": "function",
                                              "function": {"name": "no spaces!"}}]),
        "tool-name-empty": chat(tools=[{"type": "function", "function": {"name": ""}}]),
        "tool-name-65-chars": chat(tools=[{"type": "function", "function": {"name": "f" * 65}}]),
        "tool-name-missing": chat(tools=[{"type": "function", "function": {"description": "x"}}]),
        "tool-type-retrieval": chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
        "tools-string": chat(tools="get_weather"),
        "tool-parameters-string": chat(tools=[{"type": "function",
                                               "function": {"name": "f", "parameters": "x"}}]),
        "tool-parameters-bad-schema": chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "nonsense"}}}], tool_choice="required"),
        # response_format
        "json-schema-without-schema": chat(response_format={"type": "json_schema"}),
        "json-schema-schema-string": chat(response_format=schema_format("not a schema")),
        "json-schema-bad-type": chat(response_format=schema_format({"type": "nonsense"})),
        "json-schema-bad-regex": chat(response_format=schema_format(
            {"type": "string", "pattern": "("})),
        "response-format-unknown-type": chat(response_format={"type": "yaml"}),
        "response-format-string": chat(response_format="json"),
        # text that is not Unicode: lone surrogates wherever a string goes
        "surrogate-content": chat(messages=user(LONE_SURROGATE)),
        "surrogate-content-part": chat(messages=user([{"type": "text",
                                                       "text": LONE_SURROGATE}])),
        "surrogate-name": chat(messages=user("Hi", name=LONE_SURROGATE)),
        "surrogate-stop": chat(stop=[LONE_SURROGATE]),
        "surrogate-streaming": chat(messages=user(LONE_SURROGATE), stream=True),
        # checks made in the route (not by the schema) must come before a stream starts
        "stream-max-tokens-beyond-context": chat(stream=True, max_tokens=100_000),
        "stream-tool-choice-missing-function": chat(
            stream=True, tools=[TOOL], tool_choice={"type": "function",
                                                    "function": {"name": "nope"}}),
        "stream-json-schema-bad-type": chat(stream=True, response_format=schema_format(
            {"type": "nonsense"})),
        "stream-n-over-max-n": chat(stream=True, n=17),
        "surrogate-tool-description": chat(tools=[{"type": "function", "function": {
            "name": "f", "description": LONE_SURROGATE}}]),
        "surrogate-in-unknown-key": chat(**{LONE_SURROGATE: 1}),
        # nesting past 64 levels, wherever it is (even in a field the server ignores)
        "nested-100-in-unknown-field": chat(vendor_field=nested_list(100)),
        "nested-100-in-template-kwargs": chat(chat_template_kwargs=nested_dict(100)),
        "nested-900-in-content-part": chat(messages=user([{"type": "text", "text": "Hi",
                                                           "meta": deep_dict_text(900)}])),
    }
    return [Case(f"chat-{name}", CHAT, body) for name, body in cases.items()]


def _completion_cases() -> list[Case]:
    cases = {
        "prompt-missing": without(completion(), "prompt"),
        "prompt-null": completion(prompt=None),
        "prompt-int": completion(prompt=5),
        "prompt-object": completion(prompt={"text": "Hi"}),
        "prompt-empty-list": completion(prompt=[]),
        "prompt-empty-token-list-in-batch": completion(prompt=[[1, 2], []]),
        "prompt-mixed-types": completion(prompt=["Hi", 1]),
        "prompt-token-negative": completion(prompt=[-1]),
        "prompt-token-vocab-size": completion(prompt=[VOCAB]),
        "prompt-token-1e6": completion(prompt=[10**6]),
        "prompt-token-int32-overflow": completion(prompt=[2**31]),
        "prompt-token-int64-overflow": completion(prompt=[2**63]),
        "prompt-batch-token-negative": completion(prompt=[[1, 2], [-5]]),
        "prompts-over-max-prompts": completion(prompt=["Hi"] * 65),
        "token-prompts-over-max-prompts": completion(prompt=[[1]] * 65),
        "prompt-text-beyond-context": completion(prompt="word " * 700),
        "prompt-ids-beyond-context": completion(prompt=[100] * 600),
        "prompt-ids-fill-context": completion(prompt=[100] * TINY_CONTEXT, max_tokens=1),
        "prompt-plus-max-tokens-beyond-context": completion(prompt=[100] * (TINY_CONTEXT - 1)),
        # just under the 1 MB body limit: read, tokenized, then refused for its length
        "prompt-900kb": completion(prompt="word " * 180_000),
        "surrogate-prompt": completion(prompt=LONE_SURROGATE),
        "surrogate-prompt-in-list": completion(prompt=["ok", LONE_SURROGATE]),
        "surrogate-stop": completion(stop=LONE_SURROGATE),
        "suffix": completion(suffix="the end"),
        "logprobs-21": completion(logprobs=21),
        "logprobs-negative": completion(logprobs=-1),
        "logprobs-word": completion(logprobs="x"),
        "echo-list": completion(echo=[1]),
        "n-over-max-n": completion(n=17),
        "max-tokens-zero": completion(max_tokens=0),
        "min-tokens-above-max-tokens": completion(min_tokens=3),
        "stop-over-max-stop": completion(stop=[str(i) for i in range(17)]),
        "json-schema-without-schema": completion(response_format={"type": "json_schema"}),
        "model-unknown": completion(model="gpt-9"),
        "temperature-nan": completion(temperature=Raw("NaN")),
        "nested-100-in-prompt": completion(prompt=nested_list(100)),
        "stream-prompt-token-vocab-size": completion(stream=True, prompt=[VOCAB]),
        "stream-prompts-over-max-prompts": completion(stream=True, prompt=["Hi"] * 65),
        "stream-prompt-ids-beyond-context": completion(stream=True, prompt=[100] * 600),
        "stream-suffix": completion(stream=True, suffix="the end"),
        "stream-logit-bias-beyond-vocab": completion(stream=True, logit_bias={str(VOCAB): 1}),
        "stream-allowed-token-ids-negative": completion(stream=True, allowed_token_ids=[-1]),
    }
    return [Case(f"completions-{name}", COMPLETIONS, body) for name, body in cases.items()]


def _tokenizer_cases() -> list[Case]:
    tokenize = {
        "both-prompt-and-messages": {"prompt": "Hi", "messages": HI},
        "neither-prompt-nor-messages": {"add_special_tokens": True},
        "prompt-int": {"prompt": 5},
        "messages-object": {"messages": {"role": "user", "content": "Hi"}},
        "messages-empty": {"messages": []},
        "message-bad-role": {"messages": [{"role": "wizard", "content": "Hi"}]},
        "content-image-url": {"messages": user([{"type": "image_url",
                                                 "image_url": {"url": "http://x.invalid"}}])},
        "tool-calls-int-item": {"messages": assistant_calls([5])},
        "tool-call-function-int": {"messages": assistant_calls([{"function": 5}])},
        "add-special-tokens-list": {"prompt": "Hi", "add_special_tokens": [1]},
        "surrogate-prompt": {"prompt": LONE_SURROGATE},
        "surrogate-messages": {"messages": user(LONE_SURROGATE)},
        "model-unknown-type": {"prompt": "Hi", "model": 5},
    }
    detokenize = {
        "negative": {"tokens": [-1]},
        "vocab-size": {"tokens": [VOCAB]},
        "int32-overflow": {"tokens": [2**31]},
        "int64-overflow": {"tokens": [2**63]},
        "string": {"tokens": "1 2 3"},
        "missing": {},
        "null": {"tokens": None},
        "fraction": {"tokens": [1.5]},
        "nested": {"tokens": [[1]]},
    }
    return ([Case(f"tokenize-{k}", TOKENIZE, v) for k, v in tokenize.items()]
            + [Case(f"detokenize-{k}", DETOKENIZE, v) for k, v in detokenize.items()])


def _surface_cases() -> list[Case]:
    """Fields of OpenAI's or vLLM's API that this server refuses, fields no API defines, and
    fields that contradict each other: each a 400 naming the field (docs/compatibility.md)."""
    so = "structured_outputs"
    named = {
        # (path, body, the field the error names)
        "unknown-scalar": (CHAT, chat(foo=1), "foo"),
        "unknown-null": (COMPLETIONS, completion(bar=None), "bar"),
        "unknown-nested-10": (COMPLETIONS, completion(vendor=nested_list(10)), "vendor"),
        "unknown-on-tokenize": (TOKENIZE, {"prompt": "Hi", "foo": 1}, "foo"),
        "unknown-on-detokenize": (DETOKENIZE, {"tokens": [1], "foo": 1}, "foo"),
        "chat-field-on-completions": (COMPLETIONS, completion(messages=HI), "messages"),
        "store-true": (CHAT, chat(store=True), "store"),
        "metadata-string": (CHAT, chat(metadata="x"), "metadata"),
        "audio": (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
        "modalities-audio": (CHAT, chat(modalities=["text", "audio"]), "modalities"),
        "prediction": (CHAT, chat(prediction={"type": "content", "content": "x"}),
                       "prediction"),
        "web-search": (CHAT, chat(web_search_options={}), "web_search_options"),
        "functions": (CHAT, chat(functions=[{"name": "f"}]), "functions"),
        "function-call": (CHAT, chat(function_call="auto"), "function_call"),
        "chat-template": (CHAT, chat(chat_template="{{ 7 * 7 }}"), "chat_template"),
        "chat-template-on-tokenize": (TOKENIZE, {"messages": HI, "chat_template": "x"},
                                      "chat_template"),
        "best-of-above-n": (COMPLETIONS, completion(best_of=2), "best_of"),
        "beam-search": (COMPLETIONS, completion(use_beam_search=True), "use_beam_search"),
        "priority": (CHAT, chat(priority=1), "priority"),
        "logits-processors": (CHAT, chat(logits_processors=["os.system"]), "logits_processors"),
        "guided-backend-outlines": (CHAT, chat(guided_decoding_backend="outlines"),
                                    "guided_decoding_backend"),
        "stream-options-without-stream": (CHAT, chat(stream_options={"include_usage": True}),
                                          "stream_options"),
        "continuous-usage-stats": (COMPLETIONS, completion(
            stream=True, stream_options={"continuous_usage_stats": True}), "stream_options"),
        "continue-final-and-generation-prompt": (CHAT, chat(continue_final_message=True),
                                                 "continue_final_message"),
        "continue-final-and-generation-prompt-tokenize": (
            TOKENIZE, {"messages": HI, "continue_final_message": True},
            "continue_final_message"),
        "top-logprobs-without-logprobs": (CHAT, chat(top_logprobs=2), "top_logprobs"),
        "return-token-ids-chat-stream": (CHAT, chat(stream=True, return_token_ids=True),
                                         "return_token_ids"),
        "truncate-zero": (COMPLETIONS, completion(truncate_prompt_tokens=0),
                          "truncate_prompt_tokens"),
        "truncate-minus-two": (CHAT, chat(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        "truncate-over-context": (CHAT, chat(truncate_prompt_tokens=TINY_CONTEXT + 1),
                                  "truncate_prompt_tokens"),
        "two-constraints": (CHAT, chat(guided_regex="a+", response_format={
            "type": "json_object"}), "guided_regex"),
        "structured-outputs-two-kinds": (COMPLETIONS, completion(
            structured_outputs={"regex": "a", "choice": ["a"]}), so),
        "structured-outputs-none": (COMPLETIONS, completion(structured_outputs={}), so),
        "structured-outputs-unknown-key": (COMPLETIONS, completion(
            structured_outputs={"regexp": "a"}), "structured_outputs.regexp"),
        "structured-outputs-bad-regex": (CHAT, chat(structured_outputs={"regex": "("}), so),
        "structured-outputs-backend": (CHAT, chat(structured_outputs={
            "regex": "a", "backend": "outlines"}), so),
        "guided-choice-empty": (COMPLETIONS, completion(guided_choice=[]), "guided_choice"),
        "guided-json-text-not-json": (CHAT, chat(guided_json="{nope"), "guided_json"),
        "guided-grammar-bad": (CHAT, chat(guided_grammar="root ::= "), "guided_grammar"),
        "constraint-and-forced-tool": (CHAT, chat(tools=[TOOL], tool_choice="required",
                                                  guided_regex="a"), "tool_choice"),
        "cache-salt-empty": (CHAT, chat(cache_salt=""), "cache_salt"),
        "documents-not-strings": (CHAT, chat(documents=[{"title": 5}]), "documents.0.title"),
    }
    return [Case(f"surface-{name}", path, body, param=param)
            for name, (path, body, param) in named.items()]


def _raw_body_cases() -> list[Case]:
    """Bodies that are not a JSON object, sent as bytes to every JSON route (each parses its own
    body, so each can fail on its own)."""
    bodies = {
        "malformed-json": b'{"prompt": "Hi",',
        "empty": b"",
        "json-list": b"[]",
        "json-number": b"5",
        "json-null": b"null",
        "json-string": b'"Hi"',
        "trailing-garbage": b'{"prompt": "Hi"} and more',
        "non-utf8-in-string": b'{"prompt": "\xff\xfe", "messages": [], "tokens": []}',
        # a surrogate encoded as UTF-8 bytes: Python's reader lets it through (surrogatepass)
        "utf8-encoded-surrogate": b'{"prompt": "a\xed\xa0\x80b"}',
        "deep-list-100k": b"[" * 100_000 + b"]" * 100_000,
        "deep-dict-100k": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    }
    routes = {"chat": CHAT, "completions": COMPLETIONS, "tokenize": TOKENIZE,
              "detokenize": DETOKENIZE}
    return [Case(f"body-{name}-{route}", path, body)
            for name, body in bodies.items() for route, path in routes.items()]


def _size_cases() -> list[Case]:
    over = completion(prompt="x" * (BODY_LIMIT + 1000))
    return [
        Case("size-over-limit-content-length-completions", COMPLETIONS, over, status=413),
        Case("size-over-limit-content-length-chat", CHAT,
             chat(messages=user("x" * (BODY_LIMIT + 1000))), status=413),
        Case("size-20mb-content-length", COMPLETIONS, completion(prompt="x" * (20 << 20)),
             status=413),
        Case("size-over-limit-chunked-completions", COMPLETIONS,
             Chunked(BODY_LIMIT + (64 << 10)), status=413),
        Case("size-over-limit-chunked-tokenize", TOKENIZE, Chunked(BODY_LIMIT + (64 << 10)),
             status=413),
        Case("size-8mb-chunked", CHAT, Chunked(8 << 20), status=413),
    ]


def _route_cases() -> list[Case]:
    return [
        Case("route-unknown-get", "/nope", method="GET", status=404),
        Case("route-unknown-post", "/v1/nope", chat(), status=404),
        Case("route-v1-root", "/v1", method="GET", status=404),
        Case("route-model-by-id", f"/v1/models/{MODEL}", method="GET", status=404),
        Case("route-percent-encoded-bytes", "/v1/%ff%fe", method="GET", status=404),
        Case("route-long-path", "/" + "a" * 8000, method="GET", status=404),
        Case("method-get-chat", CHAT, method="GET", status=405),
        Case("method-get-completions", COMPLETIONS, method="GET", status=405),
        Case("method-patch-chat", CHAT, chat(), method="PATCH", status=405),
        Case("method-delete-models", "/v1/models", method="DELETE", status=405),
        Case("method-put-tokenize", TOKENIZE, {"prompt": "Hi"}, method="PUT", status=405),
        Case("method-get-detokenize", DETOKENIZE, method="GET", status=405),
        Case("method-post-health", "/health", {}, status=405),
        Case("method-post-metrics", "/metrics", {}, status=405),
        Case("method-get-reset-prefix-cache", "/reset_prefix_cache", method="GET", status=405),
        Case("method-options-chat", CHAT, method="OPTIONS", status=405),
    ]


def _auth_cases() -> list[Case]:
    """On the --api-key server: 401 on every path but /health without the right key."""
    paths = [("POST", CHAT, chat(model=None)), ("POST", COMPLETIONS, completion(model=None)),
             ("GET", "/v1/models", None), ("POST", TOKENIZE, {"prompt": "Hi"}),
             ("POST", DETOKENIZE, {"tokens": [1]}), ("POST", "/reset_prefix_cache", None),
             ("GET", "/metrics", None), ("GET", "/deepinfer/metrics", None),
             ("GET", "/v1/nope", None)]
    cases = []
    for method, path, body in paths:
        name = path.strip("/").replace("/", "-")
        cases.append(Case(f"auth-missing-key-{name}", path, body, method, 401))
        cases.append(Case(f"auth-wrong-key-{name}", path, body, method, 401,
                          (("authorization", "Bearer wrong-key"),)))
    near_misses = {  # almost the right header: still refused
        "lowercase-scheme": f"bearer {API_KEY}",
        "no-scheme": API_KEY,
        "basic-scheme": f"Basic {API_KEY}",
        "double-space": f"Bearer  {API_KEY}",  # (h11 refuses to send a trailing space)
        "key-prefix": f"Bearer {API_KEY[:-1]}",
        "key-with-suffix": f"Bearer {API_KEY}x",
        "bearer-only": "Bearer",
    }
    for name, value in near_misses.items():
        cases.append(Case(f"auth-{name}", COMPLETIONS, completion(model=None), "POST", 401,
                          (("authorization", value),)))
    cases.append(Case("auth-key-in-x-api-key-header", COMPLETIONS, completion(model=None),
                      "POST", 401, (("x-api-key", API_KEY),)))
    # the right key lets a bad body through to validation: then it is a 400
    cases.append(Case("auth-right-key-bad-body", COMPLETIONS, completion(model=None, n=0),
                      "POST", 400, (("authorization", f"Bearer {API_KEY}"),)))
    return cases


TINY_CASES = (_chat_cases() + _completion_cases() + _tokenizer_cases() + _raw_body_cases()
              + _size_cases() + _route_cases() + _surface_cases())
AUTH_CASES = _auth_cases()

# Fields OpenAI's or vLLM's API defines that ask nothing of this server are accepted with no
# effect (docs/compatibility.md): the baseline with them must give the baseline's tokens.
ACCEPTED = {
    "metadata-object": {"metadata": {"trace": "abc", "tags": "a,b"}},
    "openai-fields-not-served": {"store": False, "service_tier": "auto",
                                 "safety_identifier": "u1", "prompt_cache_retention": "24h"},
    "best-of-equal-to-n": {"best_of": 1},
    "vllm-defaults": {"use_beam_search": False, "length_penalty": 1.0, "priority": 0,
                      "spaces_between_special_tokens": True, "request_id": "r-1",
                      "guided_decoding_backend": "xgrammar", "bad_words": [],
                      "logits_processors": None, "return_tokens_as_token_ids": False},
    "prompt-cache-key": {"prompt_cache_key": "conversation-7"},
}
