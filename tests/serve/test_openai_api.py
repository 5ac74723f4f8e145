"""The OpenAI API of a real `deepinfer-serve`, called with the official `openai` client.

Most tests use the `tiny` server (random weights, SmolLM2 tokenizer and chat template, see
conftest.py); its text is gibberish, so the tests compare the server with itself (stream vs not,
same seed twice, one prompt vs a batch) and with the tokenizer, rather than with fixed text.
The `smol` server (the embedded SmolLM2-135M-Instruct) checks that answers make sense.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import uuid

import httpx
import pytest
from conftest import UNTRUSTED_MARKER

MODEL = "tiny-chat"
TINY_CONTEXT = 512  # the tiny checkpoint's max_position_embeddings (conftest.py)
MESSAGES = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat(client, messages=MESSAGES, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def complete(client, prompt, **kwargs):
    kwargs.setdefault("max_tokens", 6)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def stream_chat(client, messages=MESSAGES, **kwargs):
    """Stream a chat completion; return (chunks, {index: content}, {index: finish_reason})."""
    chunks = list(chat(client, messages, stream=True, **kwargs))
    content: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "two finish reasons for one choice"
                reasons[choice.index] = choice.finish_reason
    return chunks, content, reasons


def tokenize(http, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["tokens"])
    return r.json()["tokens"]


# ---- models, chat ----------------------------------------------------------------------------
def test_models_lists_served_name(client, http, tiny_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == TINY_CONTEXT
    model_dir = tiny_server.args[tiny_server.args.index("--model") + 1]
    assert model_dir not in http.get("/v1/models").text  # no local path leaves the server


def test_model_folder_code_never_runs_untrusted(client, tiny_server):
    """The tiny checkpoint ships an encoding.py (conftest.plant_untrusted_encoder): without
    --trust-remote-code the chat is the tokenizer's template and the file is never imported."""
    model_dir = tiny_server.args[tiny_server.args.index("--model") + 1]
    assert chat(client, max_tokens=2).choices[0].message.content is not None
    assert not os.path.exists(os.path.join(model_dir, UNTRUSTED_MARKER))
    with open(tiny_server.log_path) as f:
        assert "encoding.py is not run (pass --trust-remote-code" in f.read()


def test_chat_non_stream(client, http):
    resp = chat(client, max_tokens=8)
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.id.startswith("chatcmpl-")
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    u = resp.usage
    assert 1 <= u.completion_tokens <= 8
    if choice.finish_reason == "length":
        assert u.completion_tokens == 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens == len(tokenize(http, messages=MESSAGES))


def test_chat_stream_matches_non_stream(client):
    full = chat(client, max_tokens=10, seed=3)
    chunks, content, reasons = stream_chat(client, max_tokens=10, seed=3,
                                           stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # usage only on the last chunk, which carries no choice
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert content == {0: full.choices[0].message.content}
    assert reasons == {0: full.choices[0].finish_reason}
    # without include_usage no chunk has usage
    plain, content2, _ = stream_chat(client, max_tokens=10, seed=3)
    assert all(c.usage is None for c in plain) and content2 == content


def test_chat_n2_sampled_choices_differ(client):
    resp = chat(client, n=2, temperature=1.0, seed=123, max_tokens=8,
                extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    texts = [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # seeds seed and seed+1 over a near-uniform distribution
    assert resp.usage.completion_tokens == 16
    again = chat(client, n=2, temperature=1.0, seed=123, max_tokens=8,
                 extra_body={"ignore_eos": True})
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    # streamed, both choices arrive with their own index
    _, content, reasons = stream_chat(client, n=2, temperature=1.0, seed=123, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    assert [content[0], content[1]] == texts and reasons == {0: "length", 1: "length"}


def test_seed_reproducibility(client):
    kw = dict(temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True})
    a = complete(client, "Once upon a time", seed=7, **kw).choices[0].text
    b = complete(client, "Once upon a time", seed=7, **kw).choices[0].text
    c = complete(client, "Once upon a time", seed=8, **kw).choices[0].text
    assert a == b
    assert a != c  # 12 tokens sampled at temperature 1 from ~49k tokens: never all equal
    d = chat(client, seed=7, **kw).choices[0].message.content
    e = chat(client, seed=7, **kw).choices[0].message.content
    assert d == e


def test_max_tokens_and_max_completion_tokens(client):
    ignore = {"ignore_eos": True}
    r = chat(client, max_tokens=3, extra_body=ignore)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = chat(client, max_tokens=7, max_completion_tokens=2, extra_body=ignore)
    assert r.usage.completion_tokens == 2  # the newer field wins
    r = chat(client, max_tokens=None, max_completion_tokens=4, extra_body=ignore)
    assert r.usage.completion_tokens == 4
    # completions default to 16 tokens, as OpenAI's do
    r = client.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body=ignore)
    assert r.usage.completion_tokens == 16


def test_min_tokens_and_ignore_eos(client, http):
    r = complete(client, "The sea", max_tokens=6, extra_body={"min_tokens": 6,
                                                              "ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    # stop_token_ids end the output at once unless min_tokens holds them back
    first = complete(client, "The sea", max_tokens=1).choices[0].text
    ids = tokenize(http, prompt=first, add_special_tokens=False)
    if len(ids) != 1:  # fixed weights: either always or never
        pytest.skip(f"greedy token {first!r} does not re-tokenize to one id")
    tok = ids[0]
    r = complete(client, "The sea", max_tokens=6, extra_body={"stop_token_ids": [tok]})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == tok
    r = complete(client, "The sea", max_tokens=6, extra_body={"stop_token_ids": [tok],
                                                              "min_tokens": 4})
    assert r.usage.completion_tokens >= 4


# ---- completions -----------------------------------------------------------------------------
def test_completions_prompt_shapes(client, http):
    prompts = ["The capital of France is", "One, two, three,"]
    single = [complete(client, p) for p in prompts]
    for p, r in zip(prompts, single):
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].index == 0 and r.choices[0].text
        assert r.usage.prompt_tokens == len(tokenize(http, prompt=p))
    texts = [r.choices[0].text for r in single]

    batch = complete(client, prompts)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == texts
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in single)
    assert batch.usage.completion_tokens == sum(r.usage.completion_tokens for r in single)

    ids = [tokenize(http, prompt=p) for p in prompts]
    one = complete(client, ids[0])
    assert one.choices[0].text == texts[0] and one.usage.prompt_tokens == len(ids[0])
    many = complete(client, ids)
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == texts

    # n samples per prompt: prompt k owns indices k*n .. k*n+n-1
    nn = complete(client, ids, n=2, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in nn.choices) == [0, 1, 2, 3]
    assert nn.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # once per prompt, as OpenAI
    assert nn.usage.completion_tokens == 4 * 6


def test_completions_stream(client):
    full = complete(client, ["Alpha beta", "Gamma delta"], max_tokens=5)
    chunks = list(complete(client, ["Alpha beta", "Gamma delta"], max_tokens=5, stream=True,
                           stream_options={"include_usage": True}))
    text: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert text == {c.index: c.text for c in full.choices}


def test_completions_echo(client, http):
    prompt = "Roses are red, violets are"
    r = complete(client, prompt, echo=True, max_tokens=4)
    plain = complete(client, prompt, max_tokens=4).choices[0].text
    assert r.choices[0].text == prompt + plain
    ids = tokenize(http, prompt=prompt)
    r = complete(client, ids, echo=True, max_tokens=4)
    decoded = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert r.choices[0].text == decoded + plain


def test_completions_logprobs(client):
    r = complete(client, "Numbers: 1 2 3", max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 2  # keys are token texts: equal texts merge
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy takes the top
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in "".join(lp.tokens)
    plain = complete(client, "Numbers: 1 2 3", max_tokens=5)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text


def test_chat_logprobs(client):
    r = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0 and math.isfinite(item.logprob)
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0], abs=1e-4)  # greedy takes the top
        assert item.bytes == list(item.token.encode())
    assert r.choices[0].message.content == chat(client, max_tokens=6).choices[0].message.content
    r = chat(client, max_tokens=2, logprobs=True)  # top_logprobs defaults to none
    assert all(item.top_logprobs == [] for item in r.choices[0].logprobs.content)
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_completions_top_logprobs_hold_the_sampled_token(client):
    """As OpenAI's legacy completions and vLLM: the N most likely plus the sampled token, so
    `logprobs: 0` lists the sampled token alone (its text is `tokens`' entry). Random weights
    spread the tiny model's mass over the vocabulary: samples are rarely in the top 2."""
    kw = dict(temperature=1.0, seed=11, max_tokens=6, extra_body={"ignore_eos": True})
    lp = complete(client, "Numbers: 1 2 3", logprobs=0, **kw).choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    wide = complete(client, "Numbers: 1 2 3", logprobs=2, **kw).choices[0].logprobs
    assert wide.tokens == lp.tokens  # the same seed samples the same tokens
    for token, chosen, top in zip(wide.tokens, wide.token_logprobs, wide.top_logprobs):
        assert top[token] == chosen and 1 <= len(top) <= 3
    assert any(len(top) == 3 for top in wide.top_logprobs)


def test_chat_top_logprobs_lead_with_the_sampled_token(client):
    """vLLM's chat list: the first top_logprobs of [sampled token, most likely ones]."""
    r = chat(client, temperature=1.0, seed=5, max_tokens=6, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True})
    for item in r.choices[0].logprobs.content:
        first, *rest = item.top_logprobs
        assert len(rest) == 2 and (first.token, first.logprob) == (item.token, item.logprob)
        assert item.token not in [t.token for t in rest]
        values = [t.logprob for t in rest]
        assert values == sorted(values, reverse=True)


def test_logit_bias_forces_a_token_under_greedy_decoding(client, http):
    """OpenAI's logit_bias (token ids as string keys): +100 makes greedy decoding take that
    token at every step, -100 keeps the unbiased favourite out."""
    token = tokenize(http, prompt=" lighthouse", add_special_tokens=False)[0]
    text = http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
    r = complete(client, "Once upon a time", max_tokens=4, logprobs=0,
                 logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [text] * 4
    r = chat(client, max_tokens=3, logit_bias={str(token): 100},
             extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == text * 3
    free = complete(client, "Once upon a time", max_tokens=1, logprobs=1)
    first = free.choices[0].logprobs.tokens[0]
    favourite = tokenize(http, prompt=first, add_special_tokens=False)
    if len(favourite) == 1:  # the favourite's text tokenizes back to that one id
        banned = complete(client, "Once upon a time", max_tokens=1, logprobs=1,
                          logit_bias={str(favourite[0]): -100})
        assert banned.choices[0].logprobs.tokens[0] != first


def test_allowed_token_ids_keep_seeded_samples_in_the_set(client, http):
    allowed = tokenize(http, prompt=" red green blue", add_special_tokens=False)
    texts = {http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    r = complete(client, "Colours:", temperature=1.0, seed=2, max_tokens=10, logprobs=0,
                 extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert len(r.choices[0].logprobs.tokens) == 10
    assert set(r.choices[0].logprobs.tokens) <= texts


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"49152": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 101}), ("allowed_token_ids", [49152]), ("allowed_token_ids", []),
])
def test_bad_logit_bias_and_allowed_ids_are_400s_naming_the_field(client, field, value):
    import openai

    extra = {"extra_body": {field: value}}
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, "Hi", max_tokens=1, **extra)
    assert info.value.param == field
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=1, stream=True, **extra)
    assert info.value.param == field


def test_stop_strings(client):
    prompt = "A list of colours: red, green,"
    base = complete(client, prompt, max_tokens=16, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = [m for m in re.finditer(r"[A-Za-z]{3,}", text) if m.start() > 0]
    if not words:
        pytest.skip(f"greedy text {text!r} has no word to stop on")
    stop = words[0].group()[:3]
    cut = text.index(stop)
    r = complete(client, prompt, max_tokens=16, stop=[stop, "unlikely-stop-string"])
    assert r.choices[0].text == text[:cut] and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    r = complete(client, prompt, max_tokens=16, stop=stop,
                 extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text[:cut + len(stop)]
    # streamed: the stop string is never sent, not even in part
    streamed = "".join(c.choices[0].text for c in complete(client, prompt, max_tokens=16,
                                                           stop=[stop], stream=True)
                       if c.choices)
    assert streamed == text[:cut]

    # chat
    full = chat(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    words = [m for m in re.finditer(r"[A-Za-z]{3,}", full) if m.start() > 0]
    if words:
        stop = words[0].group()[:3]
        r = chat(client, max_tokens=16, stop=stop)
        assert r.choices[0].message.content == full[:full.index(stop)]
        assert r.choices[0].finish_reason == "stop"
        _, content, reasons = stream_chat(client, max_tokens=16, stop=[stop])
        assert content[0] == full[:full.index(stop)] and reasons[0] == "stop"


# ---- prefix caching --------------------------------------------------------------------------
def test_prefix_caching(client, http, tiny_server):
    # a unique long prompt (several 16-token blocks) nobody has cached yet
    prompt = f"Request {uuid.uuid4().hex}. " + " ".join(
        f"item {i} is {'red' if i % 2 else 'blue'};" for i in range(40))
    first = complete(client, prompt, max_tokens=2)
    n = first.usage.prompt_tokens
    assert n > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = complete(client, prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    off = complete(client, prompt, max_tokens=2, extra_body={"prefix_cache": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert off.choices[0].text == first.choices[0].text
    assert counter(tiny_server.metrics(), "vllm:prefix_cache_hits") >= cached

    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["dropped_pages"] >= cached // 16
    again = complete(client, prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text
    # the chat API reports cached tokens the same way
    long_messages = [{"role": "user", "content": prompt}]
    chat(client, long_messages, max_tokens=1)
    assert chat(client, long_messages, max_tokens=1).usage.prompt_tokens_details \
        .cached_tokens > 0


# ---- tool calls ------------------------------------------------------------------------------
def test_tool_choice_named_non_stream(client):
    # After the forced `<tool_call>` opening, the call's JSON schema constrains the output, so
    # even the random model can only write a valid call to get_weather; it may still run out
    # of tokens inside the free-text city string: then the call carries the arguments so far.
    r = chat(client, tools=[WEATHER_TOOL, TIME_TOOL],
             tool_choice={"type": "function", "function": {"name": "get_weather"}},
             max_tokens=48)
    choice = r.choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.message.content is None
    if choice.finish_reason == "tool_calls":
        assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)
    else:
        assert choice.finish_reason == "length" and r.usage.completion_tokens == 48


def test_tool_choice_named_stream_matches_non_stream(client):
    kw = dict(tools=[WEATHER_TOOL], max_tokens=48,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = chat(client, **kw).choices[0]
    chunks, content, reasons = stream_chat(client, **kw)
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert reasons[0] == full.finish_reason and content[0] == ""
    assert [tc.function.arguments for tc in calls] == \
        [c.function.arguments for c in full.message.tool_calls]


def _json_layout(call_text: str) -> str:
    """A call's JSON text with its string values emptied (one cut off too): what is left is
    the JSON's own punctuation and whitespace."""
    return re.sub(r'"(?:[^"\\]|\\.)*("|$)', '""', call_text)


def test_forced_call_cut_by_max_tokens_is_a_call_with_the_arguments_so_far(client):
    """As OpenAI answers a call cut off: tool_calls with the arguments written so far (a JSON
    prefix of the whole call's), content null, finish_reason length; stream or not."""
    kw = dict(tools=[WEATHER_TOOL, TIME_TOOL],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(client, max_tokens=64, **kw).choices[0].message.tool_calls[0].function
    r = chat(client, max_tokens=14, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather" and r.usage.completion_tokens == 14
    assert whole.arguments.startswith(call.arguments)
    chunks, content, reasons = stream_chat(client, max_tokens=14, **kw)
    streamed = [tc.function for c in chunks for ch in c.choices for tc in
                (ch.delta.tool_calls or [])]
    assert reasons[0] == "length" and content[0] == ""
    assert [(f.name, f.arguments) for f in streamed] == [(call.name, call.arguments)]
    # "required" cut off before any call could be read: no call, and none of the forced
    # opening's markup as content.
    early = chat(client, max_tokens=1, tools=[WEATHER_TOOL, TIME_TOOL],
                 tool_choice="required").choices[0]
    assert early.finish_reason == "length" and not early.message.content


def test_forced_call_json_has_no_free_whitespace(client):
    """A forced call is compact JSON: sampled from the random model (which, where JSON allows
    whitespace, would often pick some), whitespace is only the one space after ':' and ','."""
    r = chat(client, tools=[WEATHER_TOOL, TIME_TOOL], n=4, seed=11, temperature=1.5,
             tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=32)
    for choice in r.choices:
        arguments = choice.message.tool_calls[0].function.arguments
        assert arguments.startswith("{"), arguments  # no tokens spent before the arguments
        layout = _json_layout(arguments)
        assert re.findall(r"\s", layout) == re.findall(r"(?<=[:,])\s", layout), layout


def test_json_schema_response_format_constrains_the_random_model(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = chat(client, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "flag", "schema": schema}})
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content)["ok"], bool)
    else:  # whitespace is free in JSON; a random model may spend its budget on it
        assert choice.message.content.lstrip().startswith("{")


def test_tools_auto_and_none_stream_plain_text(client):
    # SmolLM2's template ignores tools, so with "auto"/"none" the prompt is the same as
    # without tools, and the text must come through unchanged, streamed or not.
    plain = chat(client, max_tokens=10).choices[0].message.content
    for choice in ("auto", "none"):
        r = chat(client, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=10)
        assert r.choices[0].message.content == plain and not r.choices[0].message.tool_calls
        _, content, _ = stream_chat(client, tools=[WEATHER_TOOL], tool_choice=choice,
                                    max_tokens=10)
        assert content[0] == plain


def test_tool_result_round_trip_renders(client):
    """A conversation holding a tool call and its result is accepted (arguments as JSON)."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    r = chat(client, messages, tools=[WEATHER_TOOL], max_tokens=3)
    assert r.choices[0].message.role == "assistant"


def test_an_agents_tool_turn_with_null_content_is_accepted(http):
    """What agent frameworks send back after a tool call: content null (or absent) beside
    tool_calls. The template (SmolLM2's) renders no tool calls: the call is in the prompt as
    the text this server forces and parses."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
    assert r.status_code == 200, r.text
    del messages[1]["content"]
    ids = tokenize(http, messages=messages)
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in text


# ---- tokenizer endpoints, metrics ------------------------------------------------------------
def test_tokenize_detokenize_round_trip(http):
    text = "Hello world, how are you today? Ünïcödé ✓"
    ids = tokenize(http, prompt=text, add_special_tokens=False)
    assert ids and all(isinstance(t, int) for t in ids)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
    r = http.post("/tokenize", json={"prompt": text})
    assert r.json()["max_model_len"] == TINY_CONTEXT
    chat_ids = tokenize(http, messages=[{"role": "user", "content": text}])
    assert len(chat_ids) > len(ids)
    assert text in http.post("/detokenize", json={"tokens": chat_ids}).json()["prompt"]


def test_metrics(client, http, tiny_server):
    complete(client, "metrics please", max_tokens=2)
    for path in ("/metrics", "/deepinfer/metrics"):
        r = http.get(path)
        assert r.status_code == 200
        for name in ("vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
                     "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_hits", "vllm:num_requests_running",
                     "deepinfer_tokenizer:encode_seconds", "deepinfer_tokenizer:verify_checks"):
            assert name in r.text, name
        # auto selection picks fastokens for the SmolLM2 tokenizer (it equals hf on the probes)
        assert any(line.startswith("deepinfer_tokenizer:backend") and 'backend="fastokens"' in line
                   and line.endswith(" 1.0") for line in r.text.splitlines()), r.text
    before = tiny_server.metrics()
    r = complete(client, "count me", max_tokens=3, extra_body={"ignore_eos": True})
    after = tiny_server.metrics()
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
    assert after["vllm:prompt_tokens_total"] == \
        before["vllm:prompt_tokens_total"] + r.usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 3
    assert after["vllm:time_to_first_token_seconds_count"] == \
        before["vllm:time_to_first_token_seconds_count"] + 1


def counter(metrics: dict[str, float], name: str) -> float:
    """A counter's value, exposed as NAME_total (prometheus_client) or bare NAME (a gauge)."""
    return metrics.get(f"{name}_total", metrics.get(name, 0.0))


# ---- disconnects free their blocks -----------------------------------------------------------
def _gauges(server):
    g = server.metrics()
    return g["vllm:num_requests_running"], g["vllm:kv_cache_usage_perc"]


def test_disconnect_mid_stream_frees_blocks(tiny_server):
    tiny_server.wait_idle()
    before = tiny_server.metrics().get("vllm:generation_tokens_total", 0.0)
    max_tokens = 400  # several seconds of work if it kept running after the client left
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60.0) as c:
        with c.stream("POST", f"{tiny_server.base_url}/chat/completions", json=body) as r:
            assert r.status_code == 200
            # keep the line iterator alive: dropping it mid-body closes the connection
            lines = r.iter_lines()
            data: list[str] = []
            while len(data) < 3:  # the role chunk and two content chunks
                line = next(lines)
                if line.startswith("data: "):
                    data.append(line)
            assert json.loads(data[2][6:])["choices"][0]["delta"]["content"]
            running, usage = _gauges(tiny_server)
            assert running == 1 and usage > 0  # it really was running
            # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    tiny_server.wait_idle(timeout=15.0)
    assert time.monotonic() - t0 < 15.0
    # it did not run to the end
    assert tiny_server.metrics().get("vllm:generation_tokens_total", 0.0) - before < max_tokens


def test_disconnect_non_stream_frees_blocks(tiny_server):
    tiny_server.wait_idle()
    before = tiny_server.metrics().get("vllm:generation_tokens_total", 0.0)
    body = {"model": MODEL, "prompt": "Go on forever:", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(f"{tiny_server.base_url}/completions", json=body)
    tiny_server.wait_idle(timeout=15.0)
    assert tiny_server.metrics().get("vllm:generation_tokens_total", 0.0) - before < 400
    # and the server still answers
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


# ---- the real default model ------------------------------------------------------------------
SMOL = "SmolLM2-135M-Instruct"


def test_smol_capital_of_france(smol_client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = smol_client.chat.completions.create(model=SMOL, messages=messages, temperature=0,
                                            max_tokens=16)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert smol_client.models.list().data[0].id == SMOL
    chunks = smol_client.chat.completions.create(model=SMOL, messages=messages, temperature=0,
                                                 max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_smol_api_process_runs_without_torch(smol_server, smol_client):
    """The API process tokenizes, renders chats and streams without torch (~200 MB resident):
    only the ranks load it. (A first constrained request, later in this module, loads it for
    xgrammar.) Checked before any such request to this server."""
    r = smol_client.chat.completions.create(model=SMOL, max_tokens=4, messages=[
        {"role": "user", "content": "Hello"}])
    assert r.choices[0].message.content
    assert not _maps_torch(smol_server.proc.pid)
    assert any(_maps_torch(pid) for pid in smol_server.children)  # the rank


def test_smol_tool_call(smol_client):
    """End to end through a real model: the named function's schema makes the call valid."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = smol_client.chat.completions.create(
        model=SMOL, messages=messages, temperature=0, max_tokens=48, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)


def test_smol_json_object(smol_client):
    r = smol_client.chat.completions.create(
        model=SMOL, temperature=0, max_tokens=128, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return a JSON object with the keys "name" and '
                   '"age" for a cat named Tom aged 3.'}])
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)

