"""The server-sent events of one streamed response, built as text.

Every chunk of a stream repeats the same id, object, created and model around its one choice,
so that part is encoded once per stream; per token only the choice is, and a plain text or
content delta is formatted around the C string encoder (json.dumps only for logprobs and
tool calls).
Under hundreds of streams this is the API process's work per token (json.dumps of the whole
chunk was an eighth of it).
"""
from __future__ import annotations

import json
from json.encoder import encode_basestring  # json.dumps's C string encoder, non-ASCII kept

DONE = "data: [DONE]\n\n"
_TAIL = "]}\n\n"


def event(obj: dict) -> str:
    """One event of any JSON object (errors, one-off chunks)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _json(value: dict | None) -> str:
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


def _reason(finish_reason: str | None) -> str:
    return "null" if finish_reason is None else encode_basestring(finish_reason)


class EventStream:
    """The chunks of one response (`obj`: "text_completion" or "chat.completion.chunk")."""

    def __init__(self, response_id: str, obj: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{encode_basestring(response_id)},'
                      f'"object":{encode_basestring(obj)},"created":{int(created)},'
                      f'"model":{encode_basestring(model)},"choices":[')

    def choice(self, choice: dict) -> str:
        return self._head + json.dumps(choice, ensure_ascii=False) + _TAIL

    def text(self, index: int, text: str, finish_reason: str | None = None,
             logprobs: dict | None = None, extra: dict | None = None) -> str:
        """A completions choice; `extra`: more keys of the choice (vLLM's token ids)."""
        more = "".join(f",{encode_basestring(k)}:{json.dumps(v)}" for k, v in extra.items()) \
            if extra else ""
        return (f'{self._head}{{"index":{index},"text":{encode_basestring(text)},'
                f'"finish_reason":{_reason(finish_reason)},"logprobs":{_json(logprobs)}'
                f'{more}}}{_TAIL}')

    def content(self, index: int, content: str, logprobs: dict | None = None) -> str:
        """A chat choice whose delta is content only, not the last."""
        return (f'{self._head}{{"index":{index},"delta":{{"content":'
                f'{encode_basestring(content)}}},"finish_reason":null,'
                f'"logprobs":{_json(logprobs)}}}{_TAIL}')

    def usage(self, usage: dict) -> str:
        """The usage chunk (stream_options.include_usage): no choices."""
        return f'{self._head}],"usage":{json.dumps(usage)}}}\n\n'
