"""The SSE chunks built as text (serve/api/sse.py) against json.dumps of the same objects, and
against the official openai client's types."""
import json

import openai.types as oai
import openai.types.chat as oai_chat
import pytest

from deepinfer.serve.api.sse import DONE, EventStream, event

TEXTS = ["", "plain", 'quote " backslash \\ slash /', "new\nline\ttab\r", "\x00\x01\x1f\x7f",
         "héllo 世界 🙂", "\u2028\u2029", "\ufffd"]  # the last: a decoder's partial UTF-8
MODELS = ["m", 'we"ird\\name', "модель"]


def _decode(chunk: str) -> dict:
    assert chunk.startswith("data: ") and chunk.endswith("\n\n") and chunk.count("\n\n") == 1
    return json.loads(chunk[len("data: "):-2])


def _expected(rid: str, obj: str, created: int, model: str, choices: list, **extra) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            **extra}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_completion_text_chunk(model, text, reason):
    events = EventStream("cmpl-1", "text_completion", 1700000000, model)
    got = _decode(events.text(3, text, reason))
    choice = {"index": 3, "text": text, "finish_reason": reason, "logprobs": None}
    assert got == _expected("cmpl-1", "text_completion", 1700000000, model, [choice])
    assert got == _decode(event(got))
    if reason is not None:  # the client's Completion type refuses a null finish_reason (it
        oai.Completion.model_validate(got)  # builds streamed chunks without validating them)


@pytest.mark.parametrize("text", TEXTS)
def test_chat_content_chunk(text):
    events = EventStream("chatcmpl-1", "chat.completion.chunk", 5, "m")
    got = _decode(events.content(0, text))
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None}
    assert got == _expected("chatcmpl-1", "chat.completion.chunk", 5, "m", [choice])
    oai_chat.ChatCompletionChunk.model_validate(got)


def test_any_choice_and_usage_chunk():
    events = EventStream("chatcmpl-2", "chat.completion.chunk", 7, MODELS[1])
    choice = {"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                                    "function": {"name": "f",
                                                                 "arguments": "{\"a\": 1}"}}]},
              "finish_reason": "tool_calls", "logprobs": None}
    got = _decode(events.choice(choice))
    assert got == _expected("chatcmpl-2", "chat.completion.chunk", 7, MODELS[1], [choice])
    oai_chat.ChatCompletionChunk.model_validate(got)
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
             "prompt_tokens_details": {"cached_tokens": 0}}
    got = _decode(events.usage(usage))
    assert got == _expected("chatcmpl-2", "chat.completion.chunk", 7, MODELS[1], [],
                            usage=usage)
    oai_chat.ChatCompletionChunk.model_validate(got)
    assert DONE == "data: [DONE]\n\n"


def test_logprobs_ride_in_the_text_and_content_chunks():
    events = EventStream("cmpl-3", "text_completion", 9, "m")
    logprobs = {"tokens": ["é"], "token_logprobs": [-0.25], "top_logprobs": [{"é": -0.25}],
                "text_offset": [0]}
    choice = {"index": 0, "text": "é", "finish_reason": "length", "logprobs": logprobs}
    got = _decode(events.text(0, "é", "length", logprobs))
    assert got == _expected("cmpl-3", "text_completion", 9, "m", [choice])
    oai.Completion.model_validate(got)
    chat = EventStream("chatcmpl-3", "chat.completion.chunk", 9, "m")
    content_lp = {"content": [{"token": "é", "logprob": -0.25, "bytes": [195, 169],
                               "top_logprobs": []}]}
    got = _decode(chat.content(2, "é", content_lp))
    assert got["choices"] == [{"index": 2, "delta": {"content": "é"}, "finish_reason": None,
                               "logprobs": content_lp}]
    oai_chat.ChatCompletionChunk.model_validate(got)
