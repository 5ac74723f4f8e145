"""The reading shared by the formats whose calls carry JSON arguments between markers (Hermes,
Llama 3 JSON, Mistral, DeepSeek-V3): a state machine over the streamed text.

Text goes out as content until a family's opener (or, for families whose calls may start the
answer unmarked, a call at the start) is seen; what could still be an opener, and the
whitespace before it, is held back. From the opener on the answer is the calls region: each
call goes out whole, arguments and all, once its body is complete; text between and after
calls is dropped. At the end a body cut off by max_tokens is a call with the arguments
written so far (OpenAI's answer to a cut-off call), and a region in which no call could be
read is content after all, so nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import re
from abc import abstractmethod
from enum import Enum
from typing import Any

from deepinfer.serve.chat.stream_markers import WHITESPACE, holdback, trailing_space
from deepinfer.serve.chat.tool_parsers.base import (
    CallStream,
    OutputReader,
    ToolParser,
    ToolRequest,
    finish_reason,
    new_call_id,
)

_WS = WHITESPACE
# The start of a {"name": ..., "arguments"/"parameters": ...} object, however far it got.
_PARTIAL_OBJECT = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?'
                             r'(?:\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*))?', re.DOTALL)

_OBJECT_START = re.compile(r'\s*(\{\s*("(n(a(m(e("?)?)?)?)?)?\s*:?\s*)?)?', re.DOTALL)
Call = tuple[str, str]  # a call's name and its arguments as JSON text


class _State(Enum):
    START = "start"  # nothing decided yet: the answer may open with an unmarked call
    TEXT = "text"
    CALLS = "calls"


class JsonCallParser(ToolParser):
    """A family's markers and how a call body is read; the stream machine is shared."""

    openers: tuple[str, ...] = ()  # markers that open the calls region anywhere in the text

    def leads(self, text: str, request: ToolRequest) -> bool | None:
        """Whether the answer so far opens with an unmarked call (True), cannot (False), or
        cannot tell yet (None). Most formats always mark their calls."""
        return False

    @abstractmethod
    def scan(self, region: str) -> tuple[list[str], str | None]:
        """The calls region's complete call bodies, and the body still open at its end."""

    @abstractmethod
    def read(self, body: str, request: ToolRequest) -> Call | None:
        """A complete body as a call of one of the request's tools, or None."""

    @abstractmethod
    def read_partial(self, body: str, request: ToolRequest) -> Call | None:
        """A body cut off: its call with the arguments written so far, if its tool is
        known."""

    def reader(self, request: ToolRequest) -> OutputReader | None:
        return _Reader(self, request) if request.use_tools and request.names else None


class _Reader(OutputReader):
    def __init__(self, parser: JsonCallParser, request: ToolRequest) -> None:
        self.parser, self.request = parser, request

    def stream(self) -> CallStream:
        return JsonCallStream(self.parser, self.request)


class JsonCallStream(CallStream):
    def __init__(self, parser: JsonCallParser, request: ToolRequest) -> None:
        self._p, self._r = parser, request
        self._buf = request.forced  # the forced opening is part of the answer
        self._state = _State.START
        self._held = ""  # whitespace before the calls region (content if no call is read)
        self._region = ""
        self._read = 0  # complete bodies of the region read so far
        self.num_calls = 0

    def deltas(self, text: str, finished: bool = False,
               engine_reason: str | None = None) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        self._run(out, finished)
        if finished and self._state is _State.CALLS:
            self._finish(out, engine_reason)
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return finish_reason(self.num_calls, engine_reason)

    def _run(self, out: list[dict], final: bool) -> None:
        if self._state is _State.START:
            lead = self._p.leads(self._buf, self._r)
            if lead is None and not final:
                return  # hold everything until the start is known
            self._state = _State.CALLS if lead else _State.TEXT
        if self._state is _State.TEXT:
            pos, marker = _earliest(self._buf, self._p.openers)
            if marker is None:
                keep = 0 if final else holdback(self._buf, self._p.openers)
                self._content(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            before = self._buf[:pos]
            space = trailing_space(before)
            self._content(out, before[:len(before) - space])
            self._held, self._buf = before[len(before) - space:], self._buf[pos:]
            self._state = _State.CALLS
        self._region += self._buf
        self._buf = ""
        bodies, _ = self._p.scan(self._region)
        for body in bodies[self._read:]:
            self._call(out, self._p.read(body, self._r))
        self._read = len(bodies)

    def _finish(self, out: list[dict], engine_reason: str | None) -> None:
        _, tail = self._p.scan(self._region)
        if tail is not None:
            call = self._p.read(tail, self._r)
            if call is None and engine_reason == "length":
                call = self._p.read_partial(tail, self._r)
            self._call(out, call)
        # Markup that held no call was text after all; but a forced call's opening (ours) cut
        # off before any call could be read is no answer text: nothing is returned as content.
        if not self.num_calls and not self._r.forced:
            self._content(out, self._held + self._region)

    def _call(self, out: list[dict], call: Call | None) -> None:
        if call is None:
            return
        out.append({"tool_calls": [{"index": self.num_calls, "id": new_call_id(),
                                    "type": "function",
                                    "function": {"name": call[0], "arguments": call[1]}}]})
        self.num_calls += 1

    @staticmethod
    def _content(out: list[dict], text: str) -> None:
        if not text:
            return
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})


# ---- helpers for the families ------------------------------------------------------------
def object_call(body: str, request: ToolRequest) -> Call | None:
    """A complete {"name": ..., "arguments": {...}} object (Llama writes "parameters")."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return object_as_call(obj, body, request)


def object_as_call(obj: Any, body: str, request: ToolRequest) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in request.names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return obj["name"], arguments
    return obj["name"], _raw_arguments(body, arguments)


def _raw_arguments(body: str, arguments: Any) -> str:
    """The arguments as the model wrote them (so a call cut off and the same call complete
    agree on its text), where they end the object; else as JSON of ours."""
    match = _PARTIAL_OBJECT.match(body)
    if match and match.group(3) is not None:
        raw = match.group(3).rstrip(_WS)
        if raw.endswith("}"):
            raw = raw[:-1].rstrip(_WS)
            try:
                if json.loads(raw) == arguments:
                    return raw
            except json.JSONDecodeError:
                pass
    return json.dumps(arguments, ensure_ascii=False)


def partial_object_call(body: str, request: ToolRequest) -> Call | None:
    """The name and the arguments so far of a {"name": ..., "arguments": ... object cut off."""
    match = _PARTIAL_OBJECT.match(body)
    if match is None:  # cut off before the name: a forced call's name is known all the same
        opened = _OBJECT_START.fullmatch(body) is not None
        return (request.named, "") if opened and request.named is not None else None
    name = resolve_name(match.group(1), match.group(2) is not None, request)
    return None if name is None else (name, (match.group(3) or "").rstrip(_WS))


def resolve_name(text: str, complete: bool, request: ToolRequest) -> str | None:
    """The tool a call names; a name cut off stands for the one tool it can still become."""
    if complete:
        return text if text in request.names else None
    if request.named is not None and request.named.startswith(text):
        return request.named
    matches = [n for n in request.names if n.startswith(text)]
    return matches[0] if len(matches) == 1 else None


def json_objects(text: str, separators: str = _WS) -> tuple[list[str], str | None]:
    """Complete JSON values one after another (separated by `separators`), and the rest that
    is not (yet) one; None when nothing is left."""
    decoder, bodies, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return bodies, None
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return bodies, text[i:]
        bodies.append(text[i:end])
        i = end


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(text), None
    for marker in markers:
        pos = text.find(marker, 0, best + len(marker))
        if 0 <= pos < best:
            best, found = pos, marker
    return best, found
