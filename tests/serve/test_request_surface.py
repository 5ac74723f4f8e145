"""The request surface (docs/compatibility.md): every field of OpenAI's chat and completions
references and of vLLM's extensions is implemented, accepted with no effect, or refused; vLLM's
extensions behave as in vLLM, checked against transformers (the chat template), the tokenizer
and the server itself; what agent frameworks send by default is accepted.

The refusals themselves (a 400 naming the field) are rows of bad_input_cases.py."""
from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from deepinfer.serve.api.app import create_app
from deepinfer.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.serve.api.request_fields import CHAT, COMPLETION, UnknownFields
from deepinfer.serve.api.state import ServerState
from deepinfer.serve.metrics.server import ServerMetrics

MODEL = "tiny-chat"
HI = [{"role": "user", "content": "Hi"}]
PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]

# vLLM's request fields beyond OpenAI's (vllm/entrypoints/openai/protocol.py).
VLLM_COMMON = ["top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
               "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
               "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
               "allowed_token_ids", "bad_words", "use_beam_search", "structured_outputs",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "guided_whitespace_pattern", "priority",
               "request_id", "logits_processors", "return_tokens_as_token_ids",
               "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
               "add_special_tokens", "response_format"]
VLLM_CHAT = ["echo", "add_generation_prompt", "continue_final_message", "documents",
             "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
             "structural_tag", "reasoning_effort", "include_reasoning", "best_of"]
VLLM_COMPLETION = ["prompt_embeds"]


def openai_fields(module) -> set[str]:
    params = module.CompletionCreateParamsBase.__annotations__
    return set(params) | {"stream"}  # `stream` is in the streaming/non-streaming subclasses


@pytest.mark.parametrize("model, table, names", [
    (ChatCompletionRequest, CHAT,
     openai_fields(openai.types.chat.completion_create_params) | {*VLLM_COMMON, *VLLM_CHAT}),
    (CompletionRequest, COMPLETION,
     openai_fields(openai.types.completion_create_params) | {*VLLM_COMMON, *VLLM_COMPLETION}),
], ids=["chat", "completions"])
def test_every_openai_and_vllm_field_is_served_or_judged(model, table, names):
    """The openai package's own parameter list (and vLLM's extensions): each name is a field
    of the request model or has a rule, so none can be silently dropped."""
    unjudged = sorted(n for n in names if n not in model.model_fields and n not in table)
    assert not unjudged


def test_ignored_unknown_fields_are_logged_once_per_name(caplog):
    unknown = UnknownFields(ignore=True)
    with caplog.at_level(logging.WARNING, "deepinfer.serve"):
        for _ in range(3):
            unknown.handle(["foo", "bar"])
    assert sorted(r.getMessage().split("'")[1] for r in caplog.records) == ["bar", "foo"]


class StubTokenizer:
    """Enough of a tokenizer for /tokenize and /detokenize: one id per character, and the
    add_special_tokens each encode got."""

    def __init__(self) -> None:
        self.specials: list[bool] = []
        self.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.specials.append(add_special_tokens)
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False,
                            continue_final_message=False, tokenize=False, **kwargs) -> str:
        return "".join(m["content"] for m in messages)


def app_client(tmp_path, ignore: bool) -> tuple[TestClient, StubTokenizer]:
    tokenizer = StubTokenizer()
    state = ServerState(None, None, tokenizer, MODEL, str(tmp_path), 64,
                        ServerMetrics(MODEL, False), prompt_tokenizer=tokenizer,
                        unknown_fields=UnknownFields(ignore))
    return TestClient(create_app(state)), tokenizer


@pytest.mark.parametrize("ignore", [False, True])
def test_the_switch_decides_unknown_fields(tmp_path, ignore):
    """--ignore-unknown-fields reaches the routes: an unknown field is then ignored, else a
    400 naming it; a field OpenAI or vLLM defines is judged the same either way."""
    http, _ = app_client(tmp_path, ignore)
    r = http.post("/detokenize", json={"tokens": [72, 105], "foo": 1})
    if ignore:
        assert r.status_code == 200 and r.json() == {"prompt": "Hi"}, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "foo", r.text
    r = http.post("/tokenize", json={"prompt": "Hi", "chat_template": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_tokenize_special_tokens_default_as_in_vllm(tmp_path):
    """A prompt gets the tokenizer's special tokens unless told not to; rendered messages
    carry the template's own and get none unless asked (vLLM's defaults)."""
    http, tokenizer = app_client(tmp_path, False)
    for body in ({"prompt": "Hi"}, {"prompt": "Hi", "add_special_tokens": False},
                 {"messages": HI, "add_generation_prompt": False},
                 {"messages": HI, "add_generation_prompt": False, "add_special_tokens": True}):
        assert http.post("/tokenize", json=body).status_code == 200
    assert tokenizer.specials == [True, False, False, True]


# ---- against the tiny server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tokenizer(tiny_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_server.args[tiny_server.args.index("--model") + 1])


def test_tokenize_renders_as_transformers(http, hf_tokenizer):
    """/tokenize of messages: the ids of transformers' rendering, with the generation prompt,
    without it, and with the final message left open; token strings as the tokenizer's."""
    cases = [({"messages": HI}, dict(add_generation_prompt=True)),
             ({"messages": HI, "add_generation_prompt": False}, dict(add_generation_prompt=False)),
             ({"messages": PREFILL, "add_generation_prompt": False,
               "continue_final_message": True}, dict(continue_final_message=True))]
    for body, hf in cases:
        r = http.post("/tokenize", json={**body, "return_token_strs": True})
        assert r.status_code == 200, r.text
        text = hf_tokenizer.apply_chat_template(body["messages"], tokenize=False, **hf)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        out = r.json()
        assert out["tokens"] == ids and out["count"] == len(ids)
        assert out["token_strs"] == hf_tokenizer.convert_ids_to_tokens(ids)
        assert out["max_model_len"] == 512
    # the open final message: it ends the prompt, no end-of-turn token after it
    assert hf_tokenizer.decode(ids).endswith(PREFILL[-1]["content"])
    assert r.json()["tokens"][-1] != hf_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_continue_final_message_and_echo(client, http, hf_tokenizer):
    """The chat continues the open final message: its prompt is /tokenize's, and with `echo`
    the answer starts with the message (streamed the same)."""
    extra = {"add_generation_prompt": False, "continue_final_message": True,
             "return_token_ids": True}
    r = client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=4,
                                       temperature=0, extra_body=extra)
    prompt = http.post("/tokenize", json={"messages": PREFILL, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    assert r.model_extra["prompt_token_ids"] == prompt
    echoed = client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=4,
                                            temperature=0, extra_body={**extra, "echo": True})
    lead = PREFILL[-1]["content"]
    assert echoed.choices[0].message.content == lead + r.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=PREFILL, max_tokens=4, temperature=0, stream=True,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        echoed.choices[0].message.content


def test_chat_echo_needs_the_replys_role(client):
    """With a generation prompt the reply is the assistant's: a user's last message is not
    echoed."""
    plain, echoed = (client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, temperature=0, extra_body=extra)
        for extra in ({}, {"echo": True}))
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_return_token_ids(client, http):
    """Completions and chat: the prompt's ids are /tokenize's, the output's decode to its
    text; a stream brings the same ids, the prompt's with each choice's first chunk only."""
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                  temperature=0, extra_body={"return_token_ids": True})
    choice = r.choices[0].model_extra
    assert choice["prompt_token_ids"] == http.post(
        "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    assert len(choice["token_ids"]) == r.usage.completion_tokens == 6
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == \
        r.choices[0].text
    chunks = [c.choices[0].model_extra for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        extra_body={"return_token_ids": True})]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5,
                                          temperature=0, extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == http.post(
        "/tokenize", json={"messages": HI}).json()["tokens"]
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    """The prompt's last k tokens, as if only they were sent (greedy: the same tokens)."""
    ids = list(range(300, 340))
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 12})
    tail = client.completions.create(model=MODEL, prompt=ids[-12:], max_tokens=5,
                                     temperature=0)
    assert cut.usage.prompt_tokens == 12 and cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    head = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0,
        extra_body={"truncate_prompt_tokens": 4, "truncation_side": "right",
                    "return_token_ids": True})
    assert head.choices[0].model_extra["prompt_token_ids"] == ids[:4]
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=1).choices[0]
    # vLLM's choice has both keys, null when not asked for.
    assert plain.model_extra["prompt_token_ids"] is None and plain.model_extra["token_ids"] is None


CHOICES = ["red", "green", "deep blue"]
REGEX = r"(yes|no)-[0-9]{2}"


@pytest.mark.parametrize("extra, pattern", [
    ({"guided_choice": CHOICES}, "|".join(map(re.escape, CHOICES))),
    ({"structured_outputs": {"choice": CHOICES}}, "|".join(map(re.escape, CHOICES))),
    ({"guided_regex": REGEX}, REGEX),
    ({"structured_outputs": {"regex": REGEX}}, REGEX),
    ({"guided_grammar": 'root ::= "up" | "down" [0-9]'}, r"up|down[0-9]"),
], ids=["guided_choice", "so-choice", "guided_regex", "so-regex", "guided_grammar"])
def test_structured_outputs_constrain_the_random_model(client, extra, pattern):
    """The random model's output (several samples) matches the constraint exactly, on chat
    and on completions."""
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=24, n=3,
                                          temperature=1.0, seed=5, extra_body=extra)
    text = client.completions.create(model=MODEL, prompt="Say:", max_tokens=24, n=3,
                                     temperature=1.0, seed=5, extra_body=extra)
    outputs = [c.message.content for c in chat.choices] + [c.text for c in text.choices]
    assert all(re.fullmatch(pattern, o) for o in outputs), outputs


def test_guided_json_and_structural_tags(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40,
                                      temperature=0, extra_body=extra)
        text = r.choices[0].text
        if r.choices[0].finish_reason == "stop":
            value = json.loads(text)
            assert set(value) == {"n"} and isinstance(value["n"], int)
        else:  # whitespace is free in JSON; a random model may spend its budget on it
            assert text.lstrip().startswith("{"), text
    # xgrammar's structural tag: here a constant, forced from the start
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok!"}}
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=8, temperature=1.0,
                                  extra_body={"structured_outputs": {"structural_tag": tag}})
    assert r.choices[0].text == "ok!"
    # vLLM's older shape (structures and triggers) compiles too: free text until a trigger
    legacy = {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": schema, "end": "</f>"}]}
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                       extra_body={"structural_tag": json.dumps(legacy)})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_unsupported_endpoints_say_so(client, http):
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model=MODEL, input="Hi")
    assert "does not support the /v1/embeddings endpoint" in err.value.body["message"]
    for path in ("/v1/responses", "/v1/audio/speech", "/v1/moderations", "/pooling",
                 "/v1/score", "/v1/rerank"):
        r = http.post(path, json={})
        assert r.status_code == 404 and "does not support" in r.json()["error"]["message"]
        assert "/v1/chat/completions" in r.json()["error"]["message"]
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("Not found")


def test_an_unknown_field_is_refused_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                       extra_body={"temprature": 0.5})
    assert err.value.body["param"] == "temprature"


# ---- what agent frameworks send --------------------------------------------------------------
def recorded_bodies(run) -> list[dict]:
    """The JSON bodies a framework sends, recorded by a transport that answers each with a
    minimal valid response (stream or not)."""
    bodies: list[dict] = []
    answer = {"id": "x", "object": "chat.completion", "created": 1, "model": MODEL,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                          "finish_reason": "stop"}]}

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if body.get("stream"):
            data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=data)
        return httpx.Response(200, json=answer)

    run(httpx.MockTransport(handle))
    return bodies


def langchain_requests(transport) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url="http://recorded/v1", api_key="k", max_tokens=4,
                     temperature=0.2, top_p=0.9, frequency_penalty=0.1, presence_penalty=0.1,
                     seed=1, stop=["\n\n"], stream_usage=True, logprobs=True, top_logprobs=2,
                     http_client=httpx.Client(transport=transport))
    llm.invoke("Hi")
    list(llm.stream("Hi"))
    llm.bind_tools([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]).invoke("Hi")


def agents_requests(transport) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    client = openai.AsyncOpenAI(base_url="http://recorded/v1", api_key="k",
                                http_client=httpx.AsyncClient(transport=transport))
    settings = ModelSettings(temperature=0.3, top_p=0.9, max_tokens=4, parallel_tool_calls=True,
                             store=False, metadata={"run": "1"}, include_usage=True,
                             tool_choice="auto", reasoning=None)
    agent = Agent(name="a", instructions="Be brief.", tools=[lookup], model_settings=settings,
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))

    async def both() -> None:
        await Runner.run(agent, "Hi")
        async for _ in Runner.run_streamed(agent, "Hi").stream_events():
            pass

    asyncio.run(both())


@pytest.mark.parametrize("framework", [langchain_requests, agents_requests],
                         ids=["langchain-openai", "openai-agents"])
def test_agent_framework_requests_are_accepted(http, framework):
    bodies = recorded_bodies(framework)
    assert len(bodies) >= 2
    for body in bodies:
        body = {**body, "max_tokens": 2} if "max_completion_tokens" not in body else body
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, (body, r.text)
